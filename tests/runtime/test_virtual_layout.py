"""The virtual KV layout end to end on the default model: the same greedy tokens as the paged
layout (chunked prefill, preemption), physical memory that follows the tokens (read from the
kernel's own accounting of the reservations), and clear errors for what it cannot do."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from brisk.config import CacheConfig, ModelConfig, SchedulerConfig
from brisk.engine.llm import LLM
from brisk.engine.llm_engine import LLMEngine
from brisk.model.llama import LlamaForCausalLM
from brisk.request import SamplingParams
from tests.speculative.conftest import tiny_tokenizer

MODEL = "smollm2-135m"
pytest.importorskip("brisk._C")
from brisk.runtime.virtual_kv import residency_readable  # noqa: E402 (needs the extension)

# where mincore reports reserved pages resident (gVisor), residency reads None: nothing to check it against
needs_residency = pytest.mark.skipif(not residency_readable(), reason="this system's mincore reports reserved "
                                     "pages as resident (as gVisor's does): residency cannot be read")


def _prompts(n: int = 32, longest: int = 1000, vocab: int = 40000) -> list[list[int]]:
    """n token prompts from 1 to `longest` tokens, lengths spread geometrically."""
    ratio = longest ** (1 / (n - 1))
    lengths = sorted({max(1, round(ratio ** i)) for i in range(n)} | {longest})
    while len(lengths) < n:
        lengths.append(lengths[-1] // 2 + len(lengths))
    return [[(7 * i + 13 * j) % (vocab - 100) + 100 for j in range(length)] for i, length in enumerate(lengths[:n])]


def _tiny_engine(layout: str, caching: bool = False, device: str = "cpu", eager: bool = False, max_num_seqs: int = 16,
                 **kw: Any) -> LLMEngine:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1100)
    model = LlamaForCausalLM(cfg, max_positions=1100)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return LLMEngine(model.eval().to(device), tiny_tokenizer(),
                     CacheConfig(kv_layout=layout, enable_prefix_caching=caching, **kw),
                     SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=max_num_seqs, max_model_len=1100),
                     eager=eager)


def _submit(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, prefix: str = "") -> list[str]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", p, params)
    return [f"{prefix}{i}" for i in range(len(prompts))]


def _step_all(engine: LLMEngine, after_step: Callable[[], None] = lambda: None) -> dict[str, list[int]]:
    """Step until idle (checking the bookkeeping, then calling `after_step`, every step): the
    tokens of every request that finished."""
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.scheduler.check_invariants()
        after_step()
    return done


def _finish(engine: LLMEngine, ids: list[str], after_step: Callable[[], None] = lambda: None) -> list[list[int]]:
    done = _step_all(engine, after_step)
    return [done[i] for i in ids]


def _drain(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return _finish(engine, _submit(engine, prompts, max_tokens))


def test_greedy_tokens_match_the_paged_layout_with_chunks_and_preemption() -> None:
    """32 prompts of 1..1000 tokens through a tiny random model, chunks of 128 tokens, a KV
    budget of 2,048 tokens for 16 running sequences: both layouts preempt, and every request
    gets the paged layout's tokens."""
    prompts = _prompts(vocab=512)
    paged_engine, virtual_engine = _tiny_engine("paged", num_kv_blocks=64, block_size=32), \
        _tiny_engine("virtual", num_kv_blocks=64, block_size=32)
    paged, virtual = _drain(paged_engine, prompts, 48), _drain(virtual_engine, prompts, 48)
    assert virtual == paged
    assert paged_engine.scheduler.num_preemptions > 0 and virtual_engine.scheduler.num_preemptions > 0
    assert virtual_engine.virtual_kv.block_size == 32  # 2 KV heads x 16 x 4 bytes x 32 tokens: one page
    assert virtual_engine.virtual_kv.num_committed == 0  # idle: every page given back
    assert virtual_engine.runner.virtual.resident_bytes() in (0, None)  # None: unreadable here (gVisor)


def test_a_shared_prefix_is_read_in_place_committed_once_and_changes_no_token() -> None:
    """16 requests behind one 300-token system prompt, then their next turns (their own history
    again): with prefix caching the virtual layout gives the paged layout's tokens, hits the cache
    like it, and holds the shared tiles once."""
    system = [(11 * j) % 400 + 100 for j in range(300)]
    first = [system + [(i * 31 + j) % 400 + 100 for j in range(20 + 7 * i)] for i in range(16)]
    runs = {}
    for layout in ("paged", "virtual"):
        engine = _tiny_engine(layout, caching=True, num_kv_blocks=200, block_size=32)
        answers = _drain(engine, first, 12)
        turns = _submit(engine, [p + a + [101, 102] for p, a in zip(first, answers)], 12, prefix="t")
        engine.step()  # the second turns are admitted: their tables name their tiles now
        if layout == "virtual":
            kv = engine.virtual_kv
            memory = engine.runner.virtual
            assert memory.resident_bytes() in (kv.num_committed * memory.bytes_per_tile, None)
            assert kv.num_used_tiles < sum(len(kv.get_block_ids(t)[0]) for t in turns)  # shared, counted once
        runs[layout] = (answers, _finish(engine, turns), engine.scheduler.prefix_hit_rate)
    assert runs["virtual"][:2] == runs["paged"][:2]
    assert runs["virtual"][2] > 0.5 and runs["paged"][2] > 0.5
    no_cache = _tiny_engine("virtual", num_kv_blocks=200, block_size=32)
    assert _drain(no_cache, first, 12) == runs["virtual"][0]


def _run(layout: str, prompts: list[list[int]], caching: bool = False, **kw: Any) -> tuple[list[list[int]], LLM]:
    llm = LLM(MODEL, kv_layout=layout, enable_prefix_caching=caching, max_model_len=1024, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def test_the_default_model_gives_the_paged_layouts_tokens(gguf_path: Path) -> None:
    """The real model as stored, 8 prompts of 1..400 tokens and four more after the longest
    one's first 200 tokens, a budget that preempts, prefix caching on."""
    prompts = _prompts(8, 400)
    prompts += [prompts[-1][:200] + p for p in prompts[:4]]
    kw: dict[str, Any] = {"max_num_batched_tokens": 128, "num_kv_blocks": 40, "max_num_seqs": 8}
    paged, _ = _run("paged", prompts, caching=True, **kw)
    virtual, llm = _run("virtual", prompts, caching=True, **kw)
    assert virtual == paged and llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.prefix_hit_rate > 0


def _rss(buffers: list[Any]) -> int:
    """Resident bytes of the reservations, page by page from /proc/self/pagemap's present bits (the
    kernel's accounting, independent of brisk's mincore). Not smaps: it counts whole mappings, and
    a reservation placed just below another live one (mmap goes top-down) merges with it."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    with open("/proc/self/pagemap", "rb") as f:
        for b in buffers:
            f.seek(b.data_ptr() // page * 8)
            entries = np.frombuffer(f.read(-(-b.numel() // page) * 8), dtype=np.uint64)
            total += int((entries >> np.uint64(63)).sum()) * page
    return total


@needs_residency
def test_committed_memory_follows_the_tokens_and_falls_after_finish(gguf_path: Path) -> None:
    llm = LLM(MODEL, kv_layout="virtual", enable_prefix_caching=False, max_model_len=1024, max_num_seqs=4)
    engine, memory = llm.engine, llm.engine.runner.virtual
    # commits a tile ahead beside the forward, as on a CPU with a spare core (without one the manager
    # commits just in time: the next test)
    memory.ahead_thread = engine.virtual_kv.commit_ahead = True
    tile_bytes = memory.bytes_per_tile
    assert _rss(memory.buffers) == 0  # reserved, nothing committed yet
    engine.add_request("a", list(range(100, 400)), SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        memory.wait()
        if engine.has_unfinished_requests():
            committed = engine.virtual_kv.num_committed
            assert _rss(memory.buffers) == committed * tile_bytes == memory.resident_bytes()
            seen.append(committed)
    # 300 prompt tokens = 19 tiles of 16 (+1 ahead), growing to 360 tokens = 23 (+1)
    assert seen[0] == 20 and seen[-1] == 24 and seen == sorted(seen)
    assert _rss(memory.buffers) == 0 and engine.virtual_kv.num_committed == 0


_OWN_MEMORY = """
import json, sys
from brisk.engine.llm import LLM
from brisk.request import SamplingParams

def smaps_rss(spans):
    # Rss of the mappings inside the reservations (adjacent reservations merge into one mapping;
    # one reaching outside them would count other memory: reported, and the test fails)
    total, outside = 0, 0
    with open("/proc/self/smaps") as f:
        lo = hi = None
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
            elif head == "Rss:" and any(a < hi and lo < b for a, b in spans):
                if any(a <= lo and hi <= b for a, b in merged(spans)):
                    total += int(line.split()[1]) * 1024
                else:
                    outside += 1
    return total, outside

def merged(spans):
    out = []
    for a, b in sorted(spans):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out

def vm_rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

llm = LLM("smollm2-135m", kv_layout="virtual", enable_prefix_caching=False, max_model_len=1024, max_num_seqs=4)
engine, memory = llm.engine, llm.engine.runner.virtual
spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in memory.buffers]
rows = [{"committed": 0, "smaps": smaps_rss(spans), "rss": vm_rss()}]
engine.add_request("a", list(range(100, 700)), SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
while engine.has_unfinished_requests():
    engine.step()
    rows.append({"committed": engine.virtual_kv.num_committed * memory.bytes_per_tile, "smaps": smaps_rss(spans),
                 "rss": vm_rss()})
print(json.dumps(rows))
"""


def test_a_process_sees_its_own_memory_follow_the_tokens(gguf_path: Path) -> None:
    """In a process of its own (as the issue asks): /proc/self/smaps shows the reservations' resident
    memory equal to the tiles committed, growing with the tokens and back to nothing when the
    request finishes, and the process's RSS falls by what the KV held."""
    import json
    import subprocess
    import sys

    if not residency_readable():
        pytest.skip("this system reports reserved pages as resident (gVisor): smaps cannot tell them either")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _OWN_MEMORY], cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(r["smaps"][1] == 0 for r in rows), "a reservation's mapping reached outside the reservations"
    assert all(r["smaps"][0] == r["committed"] for r in rows), rows
    during = [r["smaps"][0] for r in rows[1:-1]]
    assert rows[0]["smaps"][0] == 0 and during == sorted(during) and during[-1] > during[0] > 0
    assert rows[-1]["smaps"][0] == 0  # finished, the engine idle: every page given back
    peak = max(rows[1:-1], key=lambda r: r["rss"])
    assert peak["rss"] - rows[-1]["rss"] >= 0.9 * during[-1]  # the process's own RSS gives the KV back


def test_without_a_spare_core_tiles_are_committed_just_in_time(gguf_path: Path) -> None:
    """Where no core is left for the commit-ahead thread, a tile ahead would be committed on the
    step's thread all the same, only earlier: the engine's manager commits the tiles a step writes,
    before its forward (no forward faults), and holds no tile past them."""
    llm = LLM(MODEL, kv_layout="virtual", enable_prefix_caching=False, max_model_len=1024, max_num_seqs=4)
    engine, memory = llm.engine, llm.engine.runner.virtual
    assert engine.virtual_kv.commit_ahead == memory.ahead_thread
    memory.ahead_thread = engine.virtual_kv.commit_ahead = False  # as on a 2-core machine running 2 threads
    engine.add_request("a", list(range(100, 400)), SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        request = engine.scheduler.get_request("a")
        if request is not None:
            seen.append((engine.virtual_kv.num_committed, -(-request.num_tokens // 16)))
    # 300 prompt tokens = 19 tiles of 16; each decode step's token lies in a committed tile, none past it
    assert seen[0] == (19, 19) and all(committed == tiles or committed == tiles - 1 for committed, tiles in seen)
    assert engine.virtual_kv.num_committed == 0


def test_bad_settings_are_clear_errors(gguf_path: Path) -> None:
    with pytest.raises(ValueError, match="kv_layout must be one of paged, virtual"):
        LLM(MODEL, kv_layout="contiguous")
    with pytest.raises(ValueError, match="single process"):
        LLM(MODEL, kv_layout="virtual", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="kv_huge_pages applies to kv_layout='virtual' only"):
        LLM(MODEL, kv_huge_pages=True)
    with pytest.raises(ValueError, match=r"TiB of address space .*brisk's cap.*\(--kv-layout paged\)"):
        LLM(MODEL, kv_layout="virtual", max_num_seqs=1 << 20, max_model_len=8192)


def test_bfloat16_tiles_grow_to_whole_pages(gguf_path: Path) -> None:
    """SmolLM2's 3 KV heads x 64 in bfloat16 are 384 bytes a token: 16 tokens are 1.5 pages, so
    the tile is 32 tokens, and generation matches the paged layout with blocks of 32 (with
    blocks of 16 the kernel sums in other groups: bfloat16 rounding may then flip a near-tie)."""
    prompts = _prompts(4, 200)
    paged, _ = _run("paged", prompts, dtype="bfloat16", block_size=32)
    virtual, llm = _run("virtual", prompts, dtype="bfloat16")
    assert llm.engine.virtual_kv.block_size == 32 and virtual == paged


@needs_residency
def test_where_mincore_cannot_tell_the_bench_counts_the_managers_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Here (Linux) a fresh reservation reads as not resident, so residency is measured; where the OS
    reports every reserved page resident (gVisor's mincore) residency reads None, and `bench kv`
    gives the manager's count of committed tiles instead of a figure that is not what is committed."""
    from brisk.bench.kv_bench import _committed_bytes
    from brisk.runtime import virtual_kv as vkv

    engine = _tiny_engine("virtual", num_kv_blocks=64, block_size=32)
    _submit(engine, [[(7 * j) % 400 + 100 for j in range(100)]], 40)
    engine.step()
    memory, kv = engine.runner.virtual, engine.virtual_kv
    assert memory is not None and kv is not None and kv.num_committed > 0
    measured = memory.resident_bytes()
    assert measured == _committed_bytes(engine) == kv.num_committed * memory.bytes_per_tile
    monkeypatch.setattr(vkv, "residency_readable", lambda: False)
    assert memory.resident_bytes() is None and _committed_bytes(engine) == measured
    _step_all(engine)


def test_a_platform_or_build_without_the_calls_names_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from brisk import kernels

    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(ValueError, match=r"this platform \(darwin\) lacks the Linux calls .*--kv-layout paged"):
        _tiny_engine("virtual", num_kv_blocks=64, block_size=32)
    monkeypatch.undo()
    import dataclasses

    monkeypatch.setattr(kernels, "CAPS", dataclasses.replace(kernels.CAPS, built=False, load_error="not found"))
    with pytest.raises(ValueError, match=r"C\+\+ extension is not built.*--kv-layout paged"):
        _tiny_engine("virtual", num_kv_blocks=64, block_size=32)


def test_a_failed_reservation_is_a_clear_error_and_leaves_nothing_mapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """mmap fails at the third reservation (the second layer's keys): the extension's error, which
    names the call and the fallback, and the two reservations made before it are unmapped."""
    import gc
    import weakref

    from brisk import kernels

    real, made = kernels.vmem_reserve, []

    def third_fails(nbytes: int, huge_pages: bool) -> torch.Tensor:
        if len(made) == 2:
            raise RuntimeError(f"virtual KV: reserving address space (mmap) of {nbytes} bytes failed: Cannot "
                               "allocate memory; use the paged layout instead (--kv-layout paged)")
        buf = real(nbytes, huge_pages)
        made.append(weakref.ref(buf))
        return buf

    monkeypatch.setattr(kernels, "vmem_reserve", third_fails)
    with pytest.raises(ValueError, match=r"reserving address space \(mmap\) .* failed: Cannot allocate memory; "
                                         r"use the paged layout instead \(--kv-layout paged\)") as caught:
        _tiny_engine("virtual", num_kv_blocks=64, block_size=32)
    # gone while the error (and its traceback, which holds the half-built object) is still held:
    # their tensors are freed, munmap ran
    assert len(made) == 2 and all(ref() is None for ref in made) and caught.value is not None
    del caught
    gc.collect()


_ULIMIT = """
import json, resource, sys
from tests.runtime.test_virtual_layout import _tiny_engine
from brisk.runtime.virtual_kv import _mapped_bytes

_tiny_engine("paged", num_kv_blocks=64, block_size=32)  # everything but the reservations loaded first
limit = _mapped_bytes() + (256 << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
try:
    _tiny_engine("virtual", num_kv_blocks=64, block_size=32, max_num_seqs=4096)
    print(json.dumps({"error": None}))
except ValueError as e:
    print(json.dumps({"error": str(e)}))
"""


def test_an_address_space_limit_is_checked_before_reserving() -> None:
    """Under `ulimit -v` the reservations must fit what the limit leaves: refused up front with
    what bounds it, instead of an mmap failing half-way (a subprocess: the limit is per process)."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _ULIMIT], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    error = json.loads(done.stdout.strip().splitlines()[-1])["error"]
    assert error is not None and "what this process's address-space limit (ulimit -v) leaves" in error
    assert "--kv-layout paged" in error


def test_a_failed_commit_on_the_cpu_ends_only_the_requests_that_needed_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """MADV_POPULATE_WRITE fails once mid-run (out of memory): the requests naming those tiles end
    with a clear error, the others get the paged layout's tokens, and nothing stays committed."""
    from brisk import kernels

    prompts = _prompts(12, 400, vocab=512)
    paged = _drain(_tiny_engine("paged", num_kv_blocks=64, block_size=32), prompts, 24)
    engine = _tiny_engine("virtual", num_kv_blocks=64, block_size=32)
    ids = _submit(engine, prompts, 24)
    for _ in range(4):
        engine.step()
    real, calls = kernels.vmem_populate, []

    def fails_once(buf: torch.Tensor, offset: int, nbytes: int) -> None:
        calls.append(1)
        if len(calls) == 2:  # the second tensor of a commit: the first one's pages were committed
            raise RuntimeError("virtual KV: committing pages (madvise MADV_POPULATE_WRITE) of 4096 bytes failed: "
                               "Cannot allocate memory; use the paged layout instead (--kv-layout paged)")
        real(buf, offset, nbytes)

    monkeypatch.setattr(kernels, "vmem_populate", fails_once)
    done = _step_all(engine)
    failed = engine.take_failures()
    assert failed and all("Cannot allocate memory" in str(e) for e in failed.values())
    assert set(failed) | set(done) == set(ids) and not set(failed) & set(done)
    assert all(done[i] == paged[int(i)] for i in done)
    assert engine.virtual_kv.num_committed == 0 and engine.runner.virtual.resident_bytes() in (0, None)


def test_a_refused_release_warns_and_loses_no_request(monkeypatch: pytest.MonkeyPatch) -> None:
    from brisk import kernels

    prompts = _prompts(16, 700, vocab=512)
    paged = _drain(_tiny_engine("paged", num_kv_blocks=64, block_size=32), prompts, 24)
    engine = _tiny_engine("virtual", num_kv_blocks=64, block_size=32)

    def refuses(buf: torch.Tensor, offset: int, nbytes: int) -> None:
        raise RuntimeError("virtual KV: giving pages back (madvise MADV_DONTNEED) of 4096 bytes failed: Invalid argument")

    monkeypatch.setattr(kernels, "vmem_release", refuses)
    with pytest.warns(RuntimeWarning, match="giving pages back failed .*they stay committed, requests go on"):
        assert _drain(engine, prompts, 24) == paged
    assert engine.runner.virtual.release_errors > 0 and engine.scheduler.num_preemptions > 0


def test_an_aborted_request_gives_its_memory_to_the_waiting_ones() -> None:
    """A request aborted mid-decode while others wait for memory: its tiles are named by no table
    at once, a waiting request is admitted into that memory at the next step (not only once the
    engine goes idle), and every other request gets the paged layout's tokens."""
    prompts = [[(5 * i + 3 * j) % 400 + 100 for j in range(600)] for i in range(3)]
    paged = _drain(_tiny_engine("paged", num_kv_blocks=24, block_size=32), prompts, 40)
    engine = _tiny_engine("virtual", num_kv_blocks=24, block_size=32)
    kv, scheduler = engine.virtual_kv, engine.scheduler
    ids = _submit(engine, prompts, 40)  # 640 tokens each: 20 of the budget's 24 tiles, one at a time
    decoding: list[Any] = []
    while not (decoding and scheduler.waiting):
        engine.step()
        decoding = [r for r in scheduler.running if r.num_computed_tokens > r.num_prompt_tokens]
    victim = decoding[0].request_id
    waiting = {r.request_id for r in scheduler.waiting}
    named = len(kv.get_block_ids(victim)[0])
    assert named >= 19 and kv.num_used_tiles == sum(len(kv.get_block_ids(r.request_id)[0]) for r in scheduler.running)
    assert engine.abort_request(victim)
    assert kv.num_used_tiles == sum(len(kv.get_block_ids(r.request_id)[0]) for r in scheduler.running)
    engine.step()
    assert waiting & {r.request_id for r in scheduler.running}  # admitted into the aborted request's memory
    assert kv.num_committed <= kv.budget
    done = _step_all(engine)
    assert {i: done[i] for i in ids if i != victim} == {i: paged[int(i)] for i in ids if i != victim}
    assert victim not in done and kv.num_committed == 0
