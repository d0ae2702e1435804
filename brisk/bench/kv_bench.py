"""`brisk bench kv`: the KV layouts side by side (paged blocks vs virtual rows), one process.

For every (context, batch) cell and layout, in alternating order: `batch` requests of `context`
prompt tokens are prefilled (prefill tokens/s: prompt tokens over the steps until every request
has its first token; early ones decode meanwhile), then all `batch` decode together for
`decode_tokens` steps (decode tokens/s over those steps), then they are aborted.
Measured beside: the KV bytes committed (paged: the pool, allocated whole at start-up; virtual:
resident pages of the reservations, from mincore, or the manager's count where mincore cannot tell,
as under gVisor) against the bytes the tokens use, the time
each step spent committing and releasing pages on the step's thread, and the page faults the
forward took (every thread but the commit-ahead one, read from /proc/self/task around the
runner's forward): zero means no forward waited on one.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from brisk.core.kv_groups import KVGroup
from brisk.engine.llm import LLM
from brisk.engine.llm_engine import LLMEngine
from brisk.request import SamplingParams
from brisk.runtime.paged_runner import PagedModelRunner, kv_block_bytes

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
    """Keys and values of one token in every layer (the paged layout's KV groups aside)."""
    layers = tuple(range(llm.model_config.num_hidden_layers))
    return kv_block_bytes(llm.model, 1, (KVGroup(0, layers),))


def _committed_bytes(engine: LLMEngine) -> int:
    """Paged: the whole pool (allocated at start-up); virtual: the resident pages, or where the OS
    cannot tell them (gVisor's mincore) the pages the manager counts."""
    runner = engine.runner
    assert isinstance(runner, PagedModelRunner)
    if runner.virtual is not None:
        resident = runner.virtual.resident_bytes()
        if resident is not None:
            return resident
        kv = engine.virtual_kv
        assert kv is not None
        return kv.pages.bytes if kv.pages is not None else kv.num_committed * runner.virtual.bytes_per_tile
    tensors = {t.data_ptr(): t for c in runner.kv_caches if c is not None for t in c}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _cell(llm: LLM, batch: int, context: int, decode_tokens: int, seed: int) -> dict[str, Any]:
    engine = llm.engine
    rng = random.Random(seed)
    vocab = llm.model_config.vocab_size
    # long enough that nobody finishes in the window: the requests are aborted after it
    params = SamplingParams(max_tokens=llm.max_model_len - context - 1, temperature=0.0, ignore_eos=True)
    memory = engine.runner.virtual if isinstance(engine.runner, PagedModelRunner) else None
    skip = set() if memory is None else memory.commit_thread_ids
    ids = [f"kv{seed}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(1000, vocab) for _ in range(context)], params)
    preempted = engine.scheduler.num_preemptions
    started = time.perf_counter()
    firsts: set[str] = set()
    while len(firsts) < batch:
        firsts |= {out.request_id for out in engine.step() if out.outputs[0].token_ids}
    prefill_s = time.perf_counter() - started
    steps, alloc, faults, tokens = [], [], [], 0
    committed = used = running = 0
    forward = engine.runner.execute

    def counted(*args: Any, **kwargs: Any) -> Any:  # page faults taken inside the forward itself
        before = _minor_faults(skip)
        try:
            return forward(*args, **kwargs)
        finally:
            faults.append(_minor_faults(skip) - before)

    engine.runner.execute = counted  # type: ignore[method-assign]
    for i in range(decode_tokens):  # every request decodes in every step of the window
        spent = memory.alloc_seconds if memory is not None else 0.0
        tokens += engine.scheduler.num_running
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
        alloc.append((memory.alloc_seconds if memory is not None else 0.0) - spent)
        if i == decode_tokens // 2:  # mid-window: what the running batch holds
            running = engine.scheduler.num_running
            done = sum(len(engine.scheduler.get_request(r).output_token_ids) for r in ids
                       if engine.scheduler.get_request(r) is not None)
            committed, used = _committed_bytes(engine), (batch * context + done) * _bytes_per_token(llm)
    del engine.runner.execute
    for rid in ids:
        engine.abort_request(rid)
    decode_s = sum(steps)
    return {"prefill_tok_s": round(batch * context / prefill_s, 1),
            "decode_tok_s": round(tokens / decode_s, 1),
            "committed_mib": round(committed / 2**20, 2), "used_mib": round(used / 2**20, 2),
            "alloc_ms_per_step": round(1000 * statistics.mean(alloc), 4),
            "alloc_ms_per_step_median": round(1000 * statistics.median(alloc), 4),
            "forward_faults_median": statistics.median(faults),
            "faulting_forwards": sum(1 for f in faults[1:] if f > 64),  # a tile is >= 64 faults here
            "decode_steps": len(steps), "running_mid_decode": running,
            "preemptions": engine.scheduler.num_preemptions - preempted}


def bench_kv(model: str, layouts: list[str], batches: list[int], contexts: list[int], decode_tokens: int,
             engine_args: dict[str, Any]) -> dict[str, Any]:
    """One engine per layout (each sized for the largest cell), cells run layout by layout in
    alternating order, so a slow phase of the machine hits both."""
    # room for what early requests decode while the last ones prefill (a token per step), so
    # every request is still running in the decode window
    chunk = int(engine_args.get("max_num_batched_tokens", 512))
    max_len = max(contexts) + decode_tokens + max(batches) * max(contexts) // chunk + 16
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
            "virtual_committed_from": _committed_from(llms), "cells": cells}


def _committed_from(llms: dict[str, LLM]) -> str | None:
    """Where the virtual layout's committed bytes come from (None without one)."""
    runners = [llm.engine.runner for llm in llms.values()]
    virtual = [r.virtual for r in runners if isinstance(r, PagedModelRunner) and r.virtual is not None]
    if not virtual:
        return None
    if virtual[0].resident_bytes() is not None:
        return "resident pages (mincore)"
    return ("the pages the manager counts: this system's mincore reports reserved pages as resident "
            "(as gVisor's does), so residency is not measured")
