"""The same model code on CUDA: tiny random models against the CPU float32 result.

Runs only where a CUDA device exists (marker `cuda`); CI on CPU skips it.
"""

from __future__ import annotations

import pytest
import torch

from brisk.config import ModelConfig
from brisk.model.llama import LlamaForCausalLM
from brisk.request import SamplingParams
from brisk.runtime.model_runner import ModelRunner, SeqStep
from brisk.sample.sampler import sample

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _model(dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG, dtype=torch.float32, max_positions=256)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.to(device=device, dtype=dtype).eval()


def _decode(model: LlamaForCausalLM, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """Prefill in two chunks (masked path), then greedy decode; returns first logits and tokens."""
    runner = ModelRunner(model, max_seqs=2, max_len=128)
    runner.execute([SeqStep(1, 0, prompt[:7])])
    logits = runner.execute([SeqStep(1, 7, prompt[7:])])
    first = logits[0].cpu()
    tokens: list[int] = []
    for i in range(steps):
        tokens.append(int(logits.argmax()))
        logits = runner.execute([SeqStep(1, len(prompt) + i, [tokens[-1]])])
    return first, tokens


PROMPT = [int(t) for t in torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(3))]


def test_float32_on_cuda_matches_cpu() -> None:
    cpu_logits, cpu_tokens = _decode(_model(torch.float32, "cpu"), PROMPT, 16)
    gpu_logits, gpu_tokens = _decode(_model(torch.float32, "cuda"), PROMPT, 16)
    torch.testing.assert_close(gpu_logits, cpu_logits, atol=1e-3, rtol=1e-3)
    assert gpu_tokens == cpu_tokens


def test_bfloat16_on_cuda_close_to_float32() -> None:
    ref, _ = _decode(_model(torch.float32, "cpu"), PROMPT, 1)
    got, _ = _decode(_model(torch.bfloat16, "cuda"), PROMPT, 1)
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_seeded_sampling_on_cuda_is_reproducible() -> None:
    logits = torch.randn(2, 128, device="cuda")
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=40)

    def draws() -> list[int]:
        gens = [torch.Generator(device="cuda").manual_seed(5), torch.Generator(device="cuda").manual_seed(6)]
        return [t for _ in range(10) for t in sample(logits, [p, p], gens)]

    assert draws() == draws()
