"""NCCL: the tiny model over 2 GPUs (tensor parallel, then 2 x 2 where 4 exist) gives the tokens
of one GPU. Runs only where CUDA devices exist (marker `cuda`); CI on CPU skips it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from brisk import LLM, SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

PROMPTS = ["w3 w5 w9", "w10 w11", "w7 w7 w7 w2 w40 w33 w12 w13 w14 w15 w16 w17 w18 w19 w20",
           " ".join(f"w{(7 * i) % 60 + 2}" for i in range(120))]  # long: activations past NCCL's small-message path
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
ENGINE = {"num_kv_blocks": 128, "block_size": 4, "device": "cuda"}


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_nccl_grid_gives_the_tokens_of_one_gpu(tiny_dir: Path, tp: int, pp: int) -> None:
    if tp * pp > torch.cuda.device_count():
        pytest.skip(f"needs {tp * pp} CUDA devices")
    single = LLM(str(tiny_dir), **ENGINE)
    reference = [o.outputs[0].token_ids for o in single.generate(PROMPTS, GREEDY, use_tqdm=False)]
    # two micro-batches whenever two requests share a step: sends forward and rows back interleave
    micro = 2 if pp > 1 else None
    with LLM(str(tiny_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_micro_batches=micro,
             **ENGINE) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
