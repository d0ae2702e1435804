"""`brisk bench parallel`: tokens/s and bytes communicated per token for tensor x pipeline grids,
each beside one process on the same prompts (greedy, so the tokens must be identical too).

Two workloads: one sequence decoding (latency: every step waits on every collective) and a batch
of sequences (throughput: pipeline stages overlap on micro-batches). Bytes are the payload every
rank hands to collectives (all-reduce inside stages, activations between them, logit shards, step
messages), summed over ranks, over the tokens generated; prompt processing is included.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any

from brisk.engine.llm import LLM
from brisk.request import SamplingParams

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how vaccines train the immune system, step by step.",
    "List five ideas for a rainy weekend with children, with one sentence each.",
    "Describe the water cycle to a ten-year-old.",
    "What are the main differences between Python lists and tuples?",
    "Give a recipe for a simple tomato soup.",
    "Summarise the causes of the French Revolution in a paragraph.",
    "Write a polite email asking a colleague to review a document.",
]


def _run(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], int, float]:
    """(generated tokens per prompt, prompt tokens in all, seconds)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return [o.outputs[0].token_ids for o in outs], sum(len(o.prompt_token_ids) for o in outs), seconds


def _bytes(llm: LLM) -> dict[str, int]:
    """Payload bytes handed to collectives so far, summed over every rank, by kind."""
    runner = getattr(llm.engine.runner, "comm_stats", None)
    if runner is None:
        return {}
    ranks = runner()
    return {k: sum(r[k] for r in ranks) for k in ("all_reduce_bytes", "p2p_bytes", "gather_bytes", "control_bytes")}


def _measure(llm: LLM, workloads: dict[str, list[str]], max_tokens: int,
             reference: dict[str, list[list[int]]]) -> dict[str, Any]:
    """Each workload timed; the first LLM measured records the reference tokens, later ones are
    compared with them."""
    out: dict[str, Any] = {}
    for name, prompts in workloads.items():
        _run(llm, prompts[:1], 4)  # warm-up: first-call allocations, oneDNN primitives
        before = _bytes(llm)
        tokens, prompt_tokens, seconds = _run(llm, prompts, max_tokens)
        after = _bytes(llm)
        generated = sum(len(t) for t in tokens)
        row: dict[str, Any] = {"tokens_per_s": round(generated / seconds, 2), "seconds": round(seconds, 2)}
        if after:
            moved = {k: after[k] - before[k] for k in after}
            # every token the model ran (prompt and generated) crosses the same collectives
            processed = generated + prompt_tokens
            row["bytes_per_generated_token"] = round(sum(moved.values()) / generated)
            row["bytes_per_processed_token"] = round(sum(moved.values()) / processed)
            row["bytes_per_processed_token_by_kind"] = {k.removesuffix("_bytes"): round(v / processed)
                                                        for k, v in moved.items()}
        if name in reference:
            row["identical_to_one_process"] = tokens == reference[name]
        else:
            reference[name] = tokens
        out[name] = row
    return out


def bench_parallel(model: str, grid: list[tuple[int, int]], batch: int, max_tokens: int,
                   engine: dict[str, Any]) -> dict[str, Any]:
    """Each (T, P) of `grid` started fresh, measured, and closed; (1, 1) first as the reference."""
    workloads = {"batch_1": PROMPTS[:1], f"batch_{batch}": (PROMPTS * -(-batch // len(PROMPTS)))[:batch]}
    results: dict[str, Any] = {}
    reference: dict[str, list[list[int]]] = {}
    for tp, pp in [(1, 1), *[g for g in grid if g != (1, 1)]]:
        started = time.perf_counter()
        llm = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, **engine)
        start_s = time.perf_counter() - started
        try:
            row = _measure(llm, workloads, max_tokens, reference)
        finally:
            llm.close()
        results[f"tp{tp}_pp{pp}"] = {"processes": tp * pp, "start_s": round(start_s, 1), **row}
    base = results["tp1_pp1"]
    for row in results.values():
        for name in workloads:
            row[name]["speedup_vs_one_process"] = round(row[name]["tokens_per_s"] / base[name]["tokens_per_s"], 2)
    return {"bench": "parallel", "model": model, "max_tokens": max_tokens, "results": results,
            "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
            "note": "ranks share this machine's cores (torch threads per rank = cores // processes): with 2 cores, "
                    "more processes split the same compute and add a collective per layer half; the grid shows the "
                    "cost of communication, not a scaling this machine can give. The same command runs on a "
                    "multi-GPU node with --device cuda (NCCL)."}
