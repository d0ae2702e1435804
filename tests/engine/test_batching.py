"""The paged engine on the real model: batching, chunked prefill and prefix caching change no token."""

from __future__ import annotations

import random

import pytest

from brisk import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def wiki_words() -> list[str]:
    from tests.conftest import SHARED

    path = SHARED / "data" / "wikitext-2-raw" / "wiki.test.raw"
    if not path.is_file():
        pytest.skip(f"{path} not found (the team's shared data is absent)")
    return path.read_text(encoding="utf-8").split()[:20000]


def _prompts(llm: LLM, words: list[str], count: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of 1..max_len tokens cut from real text."""
    rng = random.Random(seed)
    tok = llm.get_tokenizer()
    out = []
    for i in range(count):
        n = 1 if i == 0 else rng.randint(2, max_len)
        start = rng.randrange(len(words) - 600)
        ids = tok.encode(" ".join(words[start:start + 600]))[:n]
        out.append(ids)
    return out


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def one_at_a_time(brisk_llm: LLM, wiki_words: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    # 20 prompts of up to 320 tokens: chunks of 256 split some, and the suite's time budget holds
    prompts = _prompts(brisk_llm, wiki_words, 20, 320)
    return prompts, [_run(brisk_llm, [p])[0] for p in prompts]


# Each flag is on in one run and off in the other; the prefix test below runs both on.
@pytest.mark.parametrize("chunked, prefix", [(True, False), (False, True)])
def test_batched_greedy_equals_one_at_a_time(brisk_llm: LLM, one_at_a_time, chunked: bool, prefix: bool) -> None:
    prompts, expected = one_at_a_time
    llm = _engine_variant(brisk_llm, chunked=chunked, prefix=prefix)
    assert _run(llm, prompts) == expected
    llm.engine.scheduler.check_invariants()
    assert llm.engine.scheduler.kv_usage == 0.0


def _engine_variant(base: LLM, **kw) -> LLM:
    """Same weights and tokenizer, a fresh engine with other flags (no reload)."""
    from brisk.config import CacheConfig, SchedulerConfig
    from brisk.engine.llm_engine import LLMEngine

    chunked, prefix = kw.get("chunked", True), kw.get("prefix", True)
    llm = object.__new__(LLM)
    llm.__dict__.update(base.__dict__)
    budget = kw.get("budget", 256 if chunked else base.max_model_len)
    cache = CacheConfig(block_size=16, num_kv_blocks=kw.get("blocks", 1024), enable_prefix_caching=prefix)
    sched = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=kw.get("seqs", 32),
                            max_model_len=base.max_model_len, enable_chunked_prefill=chunked)
    llm.engine = LLMEngine(base.model, base.tokenizer, cache, sched)
    return llm


def test_shared_system_prefix_hits_the_cache_and_changes_nothing(brisk_llm: LLM, wiki_words: list[str]) -> None:
    tok = brisk_llm.get_tokenizer()
    system = tok.encode(" ".join(wiki_words[:400]))[:300]
    questions = [tok.encode(f" Question {i}: what happened next in part {i}?") for i in range(12)]
    prompts = [system + q for q in questions]
    cold = _run(_engine_variant(brisk_llm, prefix=False), prompts)
    llm = _engine_variant(brisk_llm, prefix=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == cold
    assert llm.engine.scheduler.prefix_hit_rate > 0.5
    assert all(o.num_cached_tokens >= 288 for o in outs[1:])  # 18 full blocks of the shared 300 tokens


def test_preemption_under_a_tiny_kv_budget_changes_nothing(brisk_llm: LLM, wiki_words: list[str]) -> None:
    prompts = _prompts(brisk_llm, wiki_words, 12, 120, seed=3)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = _run(_engine_variant(brisk_llm, prefix=False), prompts, params)
    tight = _engine_variant(brisk_llm, prefix=False, blocks=24, budget=128)  # 384 tokens of KV for 12 requests
    assert _run(tight, prompts, params) == roomy
    sched = tight.engine.scheduler
    assert sched.num_preemptions > 0
    sched.check_invariants()
    assert sched.kv_usage == 0.0 and sched.num_running == 0 and sched.num_waiting == 0


def test_seeded_sampling_is_the_same_alone_and_in_any_batch(brisk_llm: LLM, wiki_words: list[str]) -> None:
    prompts = _prompts(brisk_llm, wiki_words, 6, 60, seed=5)
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    alone = _run(brisk_llm, [prompts[2]], seeded)[0]
    others = SamplingParams(max_tokens=20, temperature=1.0)
    mixed = brisk_llm.generate([{"prompt_token_ids": p} for p in prompts],
                               [seeded if i == 2 else others for i in range(6)], use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone


def test_n_completions_share_the_prompt_blocks(brisk_llm: LLM, wiki_words: list[str]) -> None:
    prompt = _prompts(brisk_llm, wiki_words, 2, 200, seed=9)[1]
    llm = _engine_variant(brisk_llm)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds per completion
    assert llm.engine.scheduler.prefix_hit_rate > 0  # siblings reused the first one's prompt blocks
    assert llm.engine.scheduler.kv_usage == 0.0


def test_stream_closed_early_aborts_and_frees_blocks(brisk_llm: LLM) -> None:
    llm = _engine_variant(brisk_llm)
    stream = llm.stream("Tell me a long story about dragons.", SamplingParams(max_tokens=200, temperature=0))
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert llm.engine.scheduler.kv_usage == 0.0 and not llm.engine.has_unfinished_requests()
    assert llm.generate("still works", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_bad_request_in_a_batch_leaves_nothing_queued(brisk_llm: LLM) -> None:
    llm = _engine_variant(brisk_llm)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["fine", "also fine"], [GREEDY, SamplingParams(logit_bias={10**7: 1.0})], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.scheduler.kv_usage == 0.0


def test_a_failed_step_ends_its_requests_and_leaves_no_stale_cache(brisk_llm: LLM, monkeypatch) -> None:
    """A forward that raises mid-prefill must not leave published-but-unwritten blocks behind."""
    llm = _engine_variant(brisk_llm)
    prompt = {"prompt_token_ids": list(range(1000, 1060))}
    expected = _run(_engine_variant(brisk_llm, prefix=False), [prompt["prompt_token_ids"]])[0]
    real = llm.engine.runner.execute

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(llm.engine.runner, "execute", boom)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    monkeypatch.setattr(llm.engine.runner, "execute", real)
    assert not llm.engine.has_unfinished_requests() and llm.engine.scheduler.kv_usage == 0.0
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == expected
    llm.engine.scheduler.check_invariants()


def test_generate_beside_an_open_stream_and_id_collisions(brisk_llm: LLM) -> None:
    llm = _engine_variant(brisk_llm)
    stream = llm.stream("Count to ten:", SamplingParams(max_tokens=30, temperature=0))
    next(stream)
    outs = llm.generate(["a", "b"], GREEDY, use_tqdm=False)  # must not swallow the stream's outputs
    assert [len(o.outputs[0].token_ids) for o in outs] == [24, 24]
    rest = list(stream)
    assert rest and rest[-1].finished
    eng = llm.engine
    eng.add_request("x", [5, 6, 7], SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=1))
    with pytest.raises(ValueError, match="collides"):
        eng.add_request("x#0", [5, 6, 7], GREEDY)
    eng.abort_request("x")
    assert eng.scheduler.kv_usage == 0.0


def test_stop_string_on_the_last_allowed_token_reports_stop(brisk_llm: LLM) -> None:
    free = brisk_llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0]
    tok = brisk_llm.get_tokenizer()
    ids = free.outputs[0].token_ids
    n = next(i for i in range(1, len(ids) + 1) if " 7" in tok.decode(ids[:i]))
    out = brisk_llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=n, temperature=0, stop=[" 7"]),
                             use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and " 7" not in out.text
