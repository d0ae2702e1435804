"""The whole engine (scheduler, paged runner, sampler) on CUDA against the same engine on CPU.

A tiny random model and a word-level tokenizer keep it independent of downloaded files. Runs only
where a CUDA device exists (marker `cuda`); CI on CPU skips it.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from brisk.config import CacheConfig, ModelConfig, SchedulerConfig
from brisk.engine.llm_engine import LLMEngine
from brisk.loader.tokenizer import Tokenizer
from brisk.model.llama import LlamaForCausalLM
from brisk.request import SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CFG = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)


def _tokenizer() -> Tokenizer:
    backend = Backend(models.WordLevel({f"w{i}": i for i in range(CFG.vocab_size)}, unk_token="w1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, bos_token_id=None, eos_token_id=0, add_bos=False, chat_template=None)


def _engine(device: str, dtype: torch.dtype) -> LLMEngine:
    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG, dtype=torch.float32, max_positions=512)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model = model.to(device=device, dtype=dtype).eval()
    # few blocks and a small budget: chunked prefill, prefix hits and preemption all happen
    return LLMEngine(model, _tokenizer(), CacheConfig(block_size=4, num_kv_blocks=48),
                     SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=6, max_model_len=256))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(1, CFG.vocab_size, (12,), generator=g).tolist()
    return [shared + torch.randint(1, CFG.vocab_size, (int(n),), generator=g).tolist()
            for n in torch.randint(1, 40, (10,), generator=g)]


def _run(engine: LLMEngine, params: SamplingParams) -> dict[str, list[int]]:
    for i, p in enumerate(_prompts()):
        engine.add_request(f"r{i}", p, params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    assert engine.scheduler.kv.num_free_blocks == engine.num_blocks
    return out


def test_batched_greedy_on_cuda_equals_cpu() -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert _run(_engine("cuda", torch.float32), params) == _run(_engine("cpu", torch.float32), params)


def test_bfloat16_engine_on_cuda_finishes_every_request() -> None:
    out = _run(_engine("cuda", torch.bfloat16), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert sorted(len(t) for t in out.values()) == [12] * 10


def test_seeded_sampling_on_cuda_is_reproducible() -> None:
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    assert _run(_engine("cuda", torch.float32), params) == _run(_engine("cuda", torch.float32), params)
