"""Gemma 3, Qwen3, Mistral and Phi-3 (sliding windows, QK norms, two rotary tables, LongRoPE) on CUDA
against HF transformers on the CPU: logits at every position and greedy continuations through the
paged engine (chunked prefill, prefix caching, CUDA's padded SDPA and the gather path, blocks that
leave the window let go). Runs only where a CUDA device exists (marker `cuda`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from brisk.model.base import forward_sequence
from tests.model.test_families import CONFIGS, IDS, _engine, _hf_greedy, _pair, _run, check_sliding_groups

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_logits_on_cuda_match_hf_at_every_position(family: str, tmp_path: Path) -> None:
    ours, hf = _pair(family, tmp_path)
    ours = ours.to("cuda")
    got = ours.compute_logits(forward_sequence(ours, IDS)).cpu()
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].float()
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("short_spans", ["padded", "gather"])
def test_greedy_on_cuda_through_the_paged_engine_equals_hf(family: str, short_spans: str, tmp_path: Path) -> None:
    """Prompts longer than the window in chunks of 12 and whole; a shared prefix hit the second time."""
    ours, hf = _pair(family, tmp_path)
    prompts = [IDS[:30], IDS[:30] + IDS[:5], IDS[3:14]]
    expected = [_hf_greedy(hf, p) for p in prompts]
    ours = ours.to("cuda")
    for budget in (12, 64):
        engine = _engine(ours, budget)
        engine.runner.short_spans = short_spans
        assert _run(engine, prompts) == expected, (budget, short_spans)


@pytest.mark.parametrize("short_spans", ["padded", "gather"])
def test_gemma3_sliding_layers_let_blocks_go_on_cuda(short_spans: str, tmp_path: Path) -> None:
    """A pool too small for three long requests at once: sliding layers keep only their window's blocks,
    preemption and a prefix hit happen, every output is still HF's."""
    check_sliding_groups(short_spans, tmp_path, "cuda")
