"""Peer engines for side-by-side benchmarks. Imported only by `brisk bench --compare ...`.

HF transformers is a benchmark peer here (and the reference in tests), never part of brisk's own
inference path, so it is imported lazily and is not a runtime dependency.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from brisk.errors import UserError
from brisk.loader.resolve import ModelSource


class HFPeer:
    """HF transformers `generate()` on the same weights brisk loads."""

    name = "hf"

    def __init__(self, source: ModelSource, dtype: torch.dtype) -> None:
        try:
            from transformers import AutoModelForCausalLM
        except ImportError:
            raise UserError("--compare hf needs transformers and accelerate: pip install transformers accelerate") from None
        path = Path(source.path)
        if source.kind == "gguf":
            self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        self.model.eval()

    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
        """Greedy, exactly `new_tokens` per prompt (left-padded batch); returns ids and seconds."""
        width = max(len(p) for p in prompt_ids)
        pad = 0
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
        start = time.perf_counter()
        out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        elapsed = time.perf_counter() - start
        return out[:, width:].tolist(), elapsed
