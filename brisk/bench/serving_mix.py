"""Two engine benchmarks driven step by step, in one process, with JSON out.

`prefix`: time to first token of a request whose long prefix is already cached, against the same
request on a cold cache (prefix caching doing its job).

`mixed`: inter-token latency of running decodes, first alone, then while long prompts keep
arriving; with chunked prefill the prompts are cut into budget-sized chunks, so the running
decodes keep their pace (stall-free batching doing its job).
"""

from __future__ import annotations

import random
import time
from typing import Any

from brisk.bench.throughput import _pct
from brisk.engine.llm import LLM
from brisk.request import SamplingParams


def _random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1000, vocab) for _ in range(n)]


def _ttft(llm: LLM, rid: str, ids: list[int]) -> float:
    """Seconds from submission to the first token of a lone request (run to completion)."""
    eng = llm.engine
    start = time.perf_counter()
    eng.add_request(rid, ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    first = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
    assert first is not None
    return first - start


def bench_prefix(llm: LLM, prefix_len: int, suffix_len: int, repeats: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    vocab = llm.model_config.vocab_size
    misses, hits = [], []
    _ttft(llm, "warm", _random_ids(rng, 32, vocab))
    for i in range(repeats):
        prefix = _random_ids(rng, prefix_len, vocab)
        misses.append(_ttft(llm, f"miss{i}", prefix + _random_ids(rng, suffix_len, vocab)))
        hits.append(_ttft(llm, f"hit{i}", prefix + _random_ids(rng, suffix_len, vocab)))
    miss, hit = sorted(misses)[len(misses) // 2], sorted(hits)[len(hits) // 2]
    return {"bench": "prefix", "prefix_tokens": prefix_len, "suffix_tokens": suffix_len, "repeats": repeats,
            "ttft_miss_s": round(miss, 4), "ttft_hit_s": round(hit, 4), "hit_over_miss": round(hit / miss, 4),
            "prefix_hit_rate": round(llm.engine.scheduler.prefix_hit_rate, 4)}


def _decode_gaps(llm: LLM, decoders: list[str], steps: int, arrivals: dict[int, tuple[str, list[int]]],
                 long_params: SamplingParams) -> list[float]:
    """Run `steps` engine steps; return the gaps between consecutive tokens of the decoders."""
    eng = llm.engine
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    gaps: list[float] = []
    for step in range(steps):
        if step in arrivals:
            rid, ids = arrivals[step]
            eng.add_request(rid, ids, long_params)
        outs = eng.step()
        now = time.perf_counter()
        for out in outs:
            rid = out.request_id
            n = len(out.outputs[0].token_ids)
            if rid in decoders and n != counts.get(rid):
                if rid in last:
                    gaps.append(now - last[rid])
                last[rid], counts[rid] = now, n
    return gaps


def bench_mixed(llm: LLM, num_decoders: int, long_len: int, every: int, steps: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    vocab = llm.model_config.vocab_size
    eng = llm.engine
    decode_params = SamplingParams(max_tokens=10 * steps, temperature=0.0, ignore_eos=True)
    long_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    results: dict[str, Any] = {"bench": "mixed", "decoders": num_decoders, "long_prompt_tokens": long_len,
                               "long_prompt_every_steps": every, "steps": steps,
                               "max_num_batched_tokens": eng.scheduler_config.max_num_batched_tokens,
                               "chunked_prefill": eng.scheduler_config.enable_chunked_prefill,
                               "max_decode_slowdown": eng.scheduler_config.max_decode_slowdown}
    for phase, with_long in (("alone", False), ("with_long_prompts", True)):
        decoders = [f"{phase}-d{i}" for i in range(num_decoders)]
        for rid in decoders:
            eng.add_request(rid, _random_ids(rng, 64, vocab), decode_params)
        while any(eng.scheduler.get_request(r).num_output_tokens == 0 for r in decoders):  # type: ignore[union-attr]
            eng.step()  # until every decoder is past its prompt
        arrivals = ({s: (f"{phase}-long{s}", _random_ids(rng, long_len, vocab)) for s in range(0, steps, every)}
                    if with_long else {})
        gaps = _decode_gaps(llm, decoders, steps, arrivals, long_params)
        for rid in eng.unfinished_request_ids():
            eng.abort_request(rid)
        results[phase] = {"itl_p50_ms": round(_pct(gaps, 50) * 1000, 1), "itl_p99_ms": round(_pct(gaps, 99) * 1000, 1),
                          "tokens": len(gaps)}
    results["p99_ratio"] = round(results["with_long_prompts"]["itl_p99_ms"] / results["alone"]["itl_p99_ms"], 3)
    return results
