"""Every proposer on the default model: greedy output token-identical to plain decoding, batch 1
and 8, with chunked prefill and prefix caching on; the server reports speculation on /metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from brisk import LLM, SamplingParams
from brisk.speculative.heads import ResidualHeads, save_heads

GREEDY = SamplingParams(max_tokens=32, temperature=0.0)
SYSTEM = "You are a helpful assistant. Answer carefully, quoting the text you are given where it helps."
QUESTIONS = [
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "List the numbers one to ten, separated by commas.",
    "Summarize: The tram line will be extended by four kilometres to the university campus.",
    "Write a haiku about snow.",
    "def add(a, b):\n    return a + b\n\nRename add to plus and show the code.",
    "Name three colours.",
    "Say hello.",
]


def _heads_file(path: Path, kind: str, num: int, hidden: int, exit_layer: int | None = None,
                sequential: bool = False) -> str:
    """Random (untrained) heads: the drafts are poor, which verification must not notice."""
    heads = ResidualHeads(hidden, num, sequential=sequential)
    with torch.no_grad():
        heads.weight.normal_(0, 0.02)
    save_heads(path, heads, kind, "smollm2-135m", exit_layer, vocab=torch.arange(0, 49152, 3))
    return str(path)


def _methods(tmp: Path, hidden: int) -> dict[str, dict[str, object]]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4},
        "draft": {"method": "draft", "model": "smollm2-135m", "quantization": "int4",
                  "quantization_config": {"calibration": "none"}, "num_speculative_tokens": 3},
        "early_exit": {"method": "early_exit", "num_speculative_tokens": 2,
                       "heads": _heads_file(tmp / "exit.safetensors", "early_exit", 1, hidden, 20)},
        "medusa": {"method": "medusa", "num_speculative_tokens": "auto",
                   "heads": _heads_file(tmp / "medusa.safetensors", "medusa", 3, hidden, sequential=True)},
        "medusa_parallel": {"method": "medusa", "num_speculative_tokens": 3,
                            "heads": _heads_file(tmp / "medusa_p.safetensors", "medusa", 3, hidden)},
    }


@pytest.fixture(scope="module")
def prompts(brisk_llm: LLM) -> list[list[int]]:
    tok = brisk_llm.get_tokenizer()
    return [tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def plain(brisk_llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = brisk_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("method", ["ngram", "draft", "early_exit", "medusa", "medusa_parallel"])
def test_greedy_identical_batch_1_and_8(brisk_llm: LLM, prompts, plain, method: str, tmp_path: Path) -> None:
    llm = brisk_llm.with_speculation(_methods(tmp_path, brisk_llm.model_config.hidden_size)[method])
    assert llm.engine.scheduler.config.enable_chunked_prefill and llm.engine.scheduler.kv.enable_prefix_caching
    for i in (0, 3):  # batch 1
        out = llm.generate([{"prompt_token_ids": prompts[i]}], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == plain[i]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)  # batch 8
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = llm.engine.stats()
    assert stats["spec_draft_tokens"] > 0 and 0 <= stats["spec_acceptance_rate"] <= 1
    assert stats["prefix_hit_rate"] > 0  # the shared system prompt came from the cache
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.num_blocks
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_chunked_prefill_beside_speculating_decodes(brisk_llm: LLM, prompts, plain) -> None:
    """A 64-token budget: prompts arrive in chunks while other requests verify drafts."""
    from brisk.config import CacheConfig, SchedulerConfig, SpecConfig
    from brisk.engine.llm_engine import LLMEngine

    llm = brisk_llm.with_speculation(None)
    llm.engine = LLMEngine(brisk_llm.model, brisk_llm.tokenizer, CacheConfig(num_kv_blocks=256),
                           SchedulerConfig(max_num_batched_tokens=64, max_model_len=2048),
                           speculative=SpecConfig(method="ngram", num_speculative_tokens=4))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain


def test_speculative_config_errors_are_clear(brisk_llm: LLM, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown speculative method 'eagle'"):
        brisk_llm.with_speculation({"method": "eagle"})
    with pytest.raises(ValueError, match="needs \"model\""):
        brisk_llm.with_speculation({"method": "draft"})
    with pytest.raises(ValueError, match="num_speculative_tokens must be"):
        brisk_llm.with_speculation({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="not found"):
        brisk_llm.with_speculation({"method": "medusa", "heads": str(tmp_path / "none.safetensors")})
    wrong = _heads_file(tmp_path / "m.safetensors", "medusa", 2, brisk_llm.model_config.hidden_size)
    with pytest.raises(ValueError, match="holds medusa heads, not early_exit"):
        brisk_llm.with_speculation({"method": "early_exit", "heads": wrong})
    with pytest.raises(ValueError, match="exit_layer must be between 1 and 29"):
        brisk_llm.with_speculation({"method": "early_exit", "exit_layer": 30})
    with pytest.raises(ValueError, match="not valid JSON"):
        brisk_llm.with_speculation("{method: ngram}")
    with pytest.raises(ValueError, match="applies to method draft"):
        brisk_llm.with_speculation({"method": "ngram", "draft_vocab": 8192})
    with pytest.raises(ValueError, match="must be a number of tokens >= 1"):
        brisk_llm.with_speculation({"method": "draft", "model": "smollm2-135m", "draft_vocab": 0})
    with pytest.raises(ValueError, match="needs \"draft_vocab\""):
        brisk_llm.with_speculation({"method": "draft", "model": "smollm2-135m", "draft_vocab_file": "v.json"})
    (tmp_path / "v.json").write_text('{"ranked": [0, 1, 2]}')
    with pytest.raises(ValueError, match="not a ranking of this model's 49152 tokens"):
        brisk_llm.with_speculation({"method": "draft", "model": "smollm2-135m", "quantization": "gguf",
                                    "draft_vocab": 2, "draft_vocab_file": str(tmp_path / "v.json")})
