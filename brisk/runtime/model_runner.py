"""Turn "these sequences advance by these tokens" into one forward pass and logits.

The runner owns the KV tensors (the model holds none) and builds the flat batch: token ids,
positions and the attention metadata, all in one place per step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from brisk.config import ModelConfig
from brisk.model.attention import ContiguousAttention, KVCache, SeqSpan
from brisk.model.base import CausalLM


@dataclass(frozen=True)
class SeqStep:
    """One sequence's work this step: append `token_ids` after `start` cached tokens in `slot`."""

    slot: int
    start: int
    token_ids: list[int]


def allocate_contiguous_kv(cfg: ModelConfig, max_seqs: int, max_len: int, dtype: torch.dtype,
                           device: torch.device | str) -> list[KVCache]:
    """Per layer, keys and values `[max_seqs, the layer's kv_heads, max_len, head_dim]`.

    `torch.empty`: pages are only touched as tokens are written, and attention never reads past
    what was written, so untouched slots cost no resident memory.
    """
    shapes = [(max_seqs, cfg.kv_heads(i), max_len, cfg.head_dim) for i in range(cfg.num_hidden_layers)]
    return [(torch.empty(s, dtype=dtype, device=device), torch.empty(s, dtype=dtype, device=device)) for s in shapes]


_CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_context(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """SDPA backends for one forward. On CUDA, cuDNN attention builds a new execution plan for
    every new KV length (2 ms of host time per layer per decode step on an H200), so it is left
    out; flash and memory-efficient kernels take any length. Elsewhere: torch's own choice."""
    return sdpa_kernel(_CUDA_SDPA) if device.type == "cuda" else contextlib.nullcontext()


class ModelRunner:
    def __init__(self, model: CausalLM, max_seqs: int, max_len: int) -> None:
        self.model = model
        self.max_len = max_len
        self.device = model.device
        self.kv_caches = allocate_contiguous_kv(model.config, max_seqs, max_len, model.dtype, self.device)

    @torch.inference_mode()
    def execute(self, steps: list[SeqStep]) -> torch.Tensor:
        """Run one forward over all steps; return float32 logits of each step's last token `[len(steps), vocab]`."""
        ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        for step in steps:
            n = len(step.token_ids)
            assert n > 0 and step.start + n <= self.max_len, "scheduler must respect max_len"
            spans.append(SeqSpan(step.slot, step.start, n, len(ids)))
            ids.extend(step.token_ids)
            positions.extend(range(step.start, step.start + n))
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [num_tokens]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # [num_tokens]
        with sdpa_context(self.device):
            hidden = self.model(input_ids, pos, ContiguousAttention(self.kv_caches, spans))  # [num_tokens, hidden]
        last = [s.query_start + s.num_tokens - 1 for s in spans]
        rows = hidden[last[0]:last[0] + 1] if len(last) == 1 else hidden[torch.tensor(last, device=self.device)]
        return self.model.compute_logits(rows)  # [len(steps), vocab]
