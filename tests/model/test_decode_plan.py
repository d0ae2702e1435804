"""The C++ decode plan (model/decode_plan.py) computes exactly what the module path computes: the
same tokens and the same log-probabilities, bit for bit, for every Linear kind it serves; models it
cannot serve keep the module path; anything that may change the modules drops the plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from brisk import LLM, SamplingParams
from brisk.model.decode_plan import plan_supported
from brisk.quant import set_activations

pytestmark = pytest.mark.skipif(not plan_supported(), reason="needs the AVX-512 kernels")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def _outputs(llm: LLM, use_plan: bool) -> list[tuple[list[int], list[tuple[float, tuple]]]]:
    llm.model.use_decode_plan = use_plan
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    result = []
    for out in outs:
        c = out.outputs[0]
        assert c.logprobs is not None
        result.append((c.token_ids, [(step.logprob, step.top) for step in c.logprobs]))
    return result


@pytest.mark.parametrize("quantization,config", [(None, None), ("int4", None), ("int4", {"activations": "int8"}),
                                                 ("int4", {"activations": "int16"}), ("int8", None), ("gguf", None)])
def test_plan_gives_the_module_path_numbers_bit_for_bit(quantization: str | None, config: dict | None,
                                                        gguf_path: Path) -> None:
    llm = LLM("smollm2-135m", quantization=quantization, quantization_config=config, max_model_len=256,
              num_kv_blocks=64)
    with_plan = _outputs(llm, True)
    assert llm.model._decode_plan, "the plan should serve this model"
    assert with_plan == _outputs(llm, False)


def test_models_without_kernels_keep_the_module_path(gguf_path: Path) -> None:
    llm = LLM("smollm2-135m", quantization="w8a8", max_model_len=256, num_kv_blocks=64)
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.model._decode_plan is False  # W8A8 Linears have no single-kernel op in the plan


def test_enforce_eager_keeps_the_module_path(gguf_path: Path) -> None:
    llm = LLM("smollm2-135m", enforce_eager=True, max_model_len=256, num_kv_blocks=64)
    llm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert llm.model._decode_plan is None and not llm.model.use_decode_plan


def test_changing_the_modules_drops_the_plan(gguf_path: Path) -> None:
    llm = LLM("smollm2-135m", quantization="int4", max_model_len=256, num_kv_blocks=64)
    before = _outputs(llm, True)
    assert llm.model._decode_plan
    set_activations(llm.model, "int8")  # the plan had captured int16 activations (the default)
    assert llm.model._decode_plan is None
    after = _outputs(llm, True)
    assert llm.model._decode_plan and after != before
    llm.model.to(torch.float32)  # .to() may move or retype the weights: the plan goes
    assert llm.model._decode_plan is None
