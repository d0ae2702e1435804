"""`brisk bench kv`: the KV layouts side by side (paged blocks vs virtual rows), one process.

For every (context, batch) cell and layout, in alternating order: `batch` requests of `context`
prompt tokens are prefilled (prefill tokens/s: prompt tokens over the steps until every request
has its first token), then decoded `decode_tokens` steps (decode tokens/s over those steps).
Measured beside: the KV bytes committed (paged: the pool, allocated whole at start-up; virtual:
resident pages of the reservations, from mincore) against the bytes the tokens use, the time
each step spent committing and releasing pages on the step's thread, and the page faults the
forward's threads took (read per thread from /proc/self/task, leaving out the commit-ahead
thread): zero means no step waited on one.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from brisk.engine.llm import LLM
from brisk.engine.llm_engine import LLMEngine
from brisk.request import SamplingParams
from brisk.runtime.paged_runner import PagedModelRunner

# bench names -> (kv_layout, kv_huge_pages)
LAYOUTS = {"paged": ("paged", False), "virtual": ("virtual", False), "virtual_thp": ("virtual", True)}


def _minor_faults(skip: set[int]) -> int:
    """Minor page faults of this process's threads, but those in `skip` (native thread ids)."""
    total = 0
    for task in Path("/proc/self/task").iterdir():
        if int(task.name) in skip:
            continue
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        total += int(fields[7])  # minflt: field 10 of stat, the 8th after the command name
    return total


def _bytes_per_token(llm: LLM) -> int:
    runner = llm.engine.runner
    assert isinstance(runner, PagedModelRunner)
    k, _ = next(c for c in runner.kv_caches if c is not None)
    per_layer = 2 * k[0].numel() // runner.block_size * k.element_size()
    return per_layer * sum(1 for c in runner.kv_caches if c is not None)


def _committed_bytes(engine: LLMEngine) -> int:
    """Paged: the whole pool (allocated at start-up); virtual: the resident pages."""
    runner = engine.runner
    assert isinstance(runner, PagedModelRunner)
    if runner.virtual is not None:
        return runner.virtual.resident_bytes()
    tensors = {t.data_ptr(): t for c in runner.kv_caches if c is not None for t in c}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _cell(llm: LLM, batch: int, context: int, decode_tokens: int, seed: int) -> dict[str, Any]:
    engine = llm.engine
    rng = random.Random(seed)
    vocab = llm.model_config.vocab_size
    params = SamplingParams(max_tokens=decode_tokens + 1, temperature=0.0, ignore_eos=True)
    memory = engine.runner.virtual if isinstance(engine.runner, PagedModelRunner) else None
    skip = set() if memory is None else memory.commit_thread_ids
    for i in range(batch):
        engine.add_request(f"kv{seed}-{i}", [rng.randrange(1000, vocab) for _ in range(context)], params)
    started = time.perf_counter()
    outputs: dict[str, int] = {}
    while len(outputs) < batch or min(outputs.values()) < 1:
        for out in engine.step():
            outputs[out.request_id] = len(out.outputs[0].token_ids)
    prefill_s = time.perf_counter() - started
    steps, alloc, faults = [], [], []
    committed = used = 0
    while engine.has_unfinished_requests():
        spent = memory.alloc_seconds if memory is not None else 0.0
        before = _minor_faults(skip)
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
        faults.append(_minor_faults(skip) - before)
        alloc.append((memory.alloc_seconds if memory is not None else 0.0) - spent)
        if len(steps) == decode_tokens // 2:  # mid-decode: what the running batch holds
            committed, used = _committed_bytes(engine), batch * (context + len(steps) + 1) * _bytes_per_token(llm)
    decode_s = sum(steps)
    return {"prefill_tok_s": round(batch * context / prefill_s, 1),
            "decode_tok_s": round(batch * len(steps) / decode_s, 1) if decode_s else None,
            "committed_mib": round(committed / 2**20, 2), "used_mib": round(used / 2**20, 2),
            "alloc_ms_per_step": round(1000 * statistics.mean(alloc), 4) if alloc else 0.0,
            "alloc_ms_per_step_median": round(1000 * statistics.median(alloc), 4) if alloc else 0.0,
            "faults_per_step_median": statistics.median(faults) if faults else 0,
            "steady_faulting_steps": sum(1 for f in faults[1:] if f > 64),  # a tile is >= 64 faults here
            "decode_steps": len(steps)}


def bench_kv(model: str, layouts: list[str], batches: list[int], contexts: list[int], decode_tokens: int,
             engine_args: dict[str, Any]) -> dict[str, Any]:
    """One engine per layout (each sized for the largest cell), cells run layout by layout in
    alternating order, so a slow phase of the machine hits both."""
    max_len = max(contexts) + decode_tokens + 16
    llms = {layout: LLM(model, kv_layout=LAYOUTS[layout][0], kv_huge_pages=LAYOUTS[layout][1],
                        enable_prefix_caching=False, max_model_len=max_len, max_num_seqs=max(batches), **engine_args)
            for layout in layouts}
    cells: list[dict[str, Any]] = []
    for c, context in enumerate(contexts):
        for b, batch in enumerate(batches):
            order = layouts if (c + b) % 2 == 0 else list(reversed(layouts))
            row: dict[str, Any] = {"context": context, "batch": batch}
            for layout in order:
                row[layout] = _cell(llms[layout], batch, context, decode_tokens, seed=1000 * c + b)
            for other in (v for v in layouts if v != "paged" and "paged" in layouts):
                for key in ("prefill_tok_s", "decode_tok_s"):
                    p, v = row["paged"][key], row[other][key]
                    row[f"{other}_over_paged_{key.split('_')[0]}"] = round(v / p, 3) if p and v else None
            cells.append(row)
    first = next(iter(llms.values()))
    return {"bench": "kv", "model": model, "layouts": layouts, "decode_tokens": decode_tokens,
            "tile_tokens": {k: v.engine.scheduler.block_size for k, v in llms.items()},
            "kv_bytes_per_token": _bytes_per_token(first), "threads": os.environ.get("OMP_NUM_THREADS", "default"),
            "cells": cells}
