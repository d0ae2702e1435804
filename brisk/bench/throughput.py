"""`brisk bench throughput`: offline batched generation on a seeded synthetic workload.

Request lengths are drawn like chat traffic (log-normal, long tail, clipped to the given ranges)
unless fixed lengths are asked for. Every request generates exactly its output length (EOS
ignored), so brisk and a peer do the same work. With `--compare hf`, HF transformers' batched
`generate()` runs the same prompt ids in the same process afterwards; with `--compare vllm`,
vLLM runs them in its own Python environment (`--vllm-python`, see bench/vllm_peer.py).
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from brisk.engine.llm import LLM
from brisk.errors import UserError
from brisk.loader.load import torch_dtype
from brisk.request import SamplingParams


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


def _lognormal_len(rng: random.Random, lo: int, hi: int, median: float) -> int:
    """Log-normal around `median` with a long right tail, clipped to [lo, hi]."""
    return max(lo, min(hi, int(rng.lognormvariate(math.log(median), 0.7))))


def make_workload(num_prompts: int, vocab_size: int, seed: int, input_len: int | None, output_len: int | None,
                  input_range: tuple[int, int] = (50, 1000), output_range: tuple[int, int] = (20, 400),
                  shared_prefix: int = 0) -> Workload:
    """Random token prompts (ids 1000.. to avoid special tokens), optionally with a common prefix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1000, vocab_size) for _ in range(shared_prefix)]
    prompts, outs = [], []
    for _ in range(num_prompts):
        n_in = input_len or _lognormal_len(rng, *input_range, median=250)
        n_out = output_len or _lognormal_len(rng, *output_range, median=120)
        body = [rng.randrange(1000, vocab_size) for _ in range(max(1, n_in - len(prefix)))]
        prompts.append(prefix + body)
        outs.append(n_out)
    return Workload(prompts, outs)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def run_brisk(llm: LLM, work: Workload) -> dict[str, Any]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens]
    llm.engine.reset_peak_stats()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in work.prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ttft = [o.metrics.first_token_time - start for o in outs if o.metrics.first_token_time]
    tpot = []
    for o in outs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        if n > 1 and m.finish_time and m.first_token_time:
            tpot.append((m.finish_time - m.first_token_time) / (n - 1))
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p in work.prompts)
    stats = llm.engine.stats()
    return {
        "elapsed_s": round(elapsed, 2),
        "requests_per_s": round(len(outs) / elapsed, 3),
        "output_tokens_per_s": round(generated / elapsed, 2),
        "total_tokens_per_s": round((generated + prompt_tokens) / elapsed, 2),
        "ttft_p50_s": round(_pct(ttft, 50), 3), "ttft_p99_s": round(_pct(ttft, 99), 3),
        "tpot_p50_ms": round(_pct(tpot, 50) * 1000, 2), "tpot_p99_ms": round(_pct(tpot, 99) * 1000, 2),
        "peak_kv_usage": round(stats["peak_kv_usage"], 4),
        "prefix_hit_rate": round(stats["prefix_hit_rate"], 4),
        "num_preemptions": stats["num_preemptions"],
    }


def run_hf(model_ref: str, dtype: str, work: Workload, batch_size: int) -> dict[str, Any]:
    """HF batched generate(): each batch runs to its longest requested output; only requested
    tokens count as output (the rest is HF's padding waste, which is the point of comparison)."""
    from brisk.bench.peers import HFPeer
    from brisk.loader.resolve import resolve_model

    peer = HFPeer(resolve_model(model_ref), torch_dtype(dtype))
    start = time.perf_counter()
    for i in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[i:i + batch_size]
        peer.generate(prompts, max(work.output_lens[i:i + batch_size]))
    elapsed = time.perf_counter() - start
    generated = sum(work.output_lens)
    prompt_tokens = sum(len(p) for p in work.prompts)
    return {"elapsed_s": round(elapsed, 2), "requests_per_s": round(len(work.prompts) / elapsed, 3),
            "output_tokens_per_s": round(generated / elapsed, 2),
            "total_tokens_per_s": round((generated + prompt_tokens) / elapsed, 2), "batch_size": batch_size}


def run_vllm(model_ref: str, dtype: str, work: Workload, python: str, max_model_len: int,
             prefix_caching: bool) -> dict[str, Any]:
    """vLLM's offline `LLM.generate` on the same prompt ids, in the interpreter `python` (a venv
    with vLLM installed). A GGUF model is first written as an HF directory, which vLLM loads."""
    from brisk.loader.convert import convert
    from brisk.loader.resolve import resolve_model

    if not Path(python).is_file():
        raise UserError(f"--vllm-python {python!r} is not a file; point it at the python of a venv with vllm installed")
    source = resolve_model(model_ref)
    env = dict(os.environ)
    # vLLM-CPU's own guidance for using every core of a small machine
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    with tempfile.TemporaryDirectory(prefix="brisk-vllm-") as tmp:
        model_dir = source.path if source.kind == "hf" else convert(model_ref, Path(tmp) / "model", "float32")
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"model": str(model_dir), "dtype": dtype, "max_model_len": max_model_len,
                                   "enable_prefix_caching": prefix_caching,
                                   "prompts": work.prompts, "output_lens": work.output_lens}))
        script = Path(__file__).with_name("vllm_peer.py")
        proc = subprocess.run([python, str(script), str(job)], capture_output=True, text=True, env=env, cwd=tmp,
                              check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        raise RuntimeError(f"the vLLM run failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1])


def open_llamacpp(model_ref: str, work: Workload, python: str | None) -> Any:
    """A llama-cpp-python peer (bench/llamacpp_peer.py) on the same .gguf, its context long enough
    for every request of `work`, warmed up."""
    from brisk.bench.latency import LlamaCppPeer
    from brisk.loader.resolve import resolve_model

    if not python:
        raise UserError("--compare llamacpp needs --llamacpp-python VENV/bin/python (env BRISK_LLAMACPP_PYTHON)")
    path = str(resolve_model(model_ref).path)
    if not path.endswith(".gguf"):
        raise UserError(f"--compare llamacpp runs a .gguf file; {model_ref} is not one")
    max_len = max(len(p) + n for p, n in zip(work.prompts, work.output_lens))
    peer = LlamaCppPeer(python, path, torch.get_num_threads(), max(2048, max_len + 8))
    try:
        peer.ask({"op": "latency", "ids": work.prompts[0][:16], "new_tokens": 4})  # warm-up
    except BaseException:
        peer.close()
        raise
    return peer


def run_llamacpp(peer: Any, work: Workload) -> dict[str, Any]:
    """The same prompt ids and output lengths through the peer: its binding runs one sequence at
    a time, so the figure is sequential (`mode`)."""
    out = peer.ask({"op": "throughput", "prompts": work.prompts, "output_lens": work.output_lens})
    out.pop("first_output_token_ids", None)
    out["version"] = peer.version
    return out


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median output tokens/s (the lower middle of an even count), with every run's
    figure beside it when there were several."""
    ranked = sorted(runs, key=lambda r: r["output_tokens_per_s"])
    out = dict(ranked[(len(ranked) - 1) // 2])
    if len(runs) > 1:
        out["output_tokens_per_s_rounds"] = [r["output_tokens_per_s"] for r in runs]
    return out


def bench_throughput(model: str, dtype: str, num_prompts: int, input_len: int | None, output_len: int | None,
                     seed: int, shared_prefix: int, compare: list[str], hf_batch_size: int | None,
                     engine_kwargs: dict[str, Any], vllm_python: str | None = None,
                     llamacpp_python: str | None = None, rounds: int = 1) -> dict[str, Any]:
    """brisk on the workload, then the peers in `compare`. With `rounds` > 1, brisk and the
    llama.cpp peer alternate that many times on the same workload (brisk's prefix cache emptied
    before each round, so no round reads another's prompts): this machine's pace swings between
    runs a minute apart, and only ratios within a round are fair. The figures are then the median
    round's, the speedup the median of the rounds' ratios."""
    if rounds < 1:
        raise UserError("--rounds must be >= 1")
    llm = LLM(model, dtype=dtype, **engine_kwargs)
    work = make_workload(num_prompts, llm.model_config.vocab_size, seed, input_len, output_len,
                         shared_prefix=shared_prefix)
    warm = make_workload(2, llm.model_config.vocab_size, seed + 1, 16, 4)
    run_brisk(llm, warm)  # warm-up: allocator, thread pool
    result: dict[str, Any] = {
        "bench": "throughput", "model": model, "dtype": dtype, "num_prompts": num_prompts, "seed": seed,
        "prompt_tokens": sum(len(p) for p in work.prompts), "output_tokens": sum(work.output_lens),
        "input_len_median": statistics.median(len(p) for p in work.prompts),
        "output_len_median": statistics.median(work.output_lens),
        "engine": {k: v for k, v in engine_kwargs.items() if v is not None},
        "threads": torch.get_num_threads(), "machine": platform.machine(), "rounds": rounds,
    }
    peer = open_llamacpp(model, work, llamacpp_python) if "llamacpp" in compare else None
    runs: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    try:
        for _ in range(rounds):
            llm.engine.reset_prefix_cache()
            runs.append((run_brisk(llm, work), None if peer is None else run_llamacpp(peer, work)))
    finally:
        if peer is not None:
            peer.close()
    result["brisk"] = median_run([b for b, _ in runs])
    if peer is not None:
        result["llamacpp"] = median_run([p for _, p in runs if p is not None])
        ratios = [round(b["output_tokens_per_s"] / p["output_tokens_per_s"], 3) for b, p in runs if p is not None]
        result["output_speedup_vs_llamacpp"] = round(statistics.median(ratios), 3)
        if rounds > 1:
            result["round_speedups_vs_llamacpp"] = ratios
    if "vllm" in compare:
        if vllm_python is None:
            raise UserError("--compare vllm needs --vllm-python (the python of a venv with vllm installed)")
        first_ids = [o.outputs[0].token_ids[:8] for o in llm.generate(
            [{"prompt_token_ids": p} for p in work.prompts[:4]], SamplingParams(max_tokens=8, temperature=0.0),
            use_tqdm=False)]
        max_len = max(len(p) + n for p, n in zip(work.prompts, work.output_lens))
        peer = run_vllm(model, dtype, work, vllm_python, max(2048, max_len), llm.engine.cache_config.enable_prefix_caching)
        # greedy float32 on both: the first tokens should agree (a sanity check that the work is the same)
        peer["first_tokens_match_brisk"] = peer.pop("first_output_token_ids") == first_ids
        result["vllm"] = peer
        result["output_speedup_vs_vllm"] = round(
            result["brisk"]["output_tokens_per_s"] / peer["output_tokens_per_s"], 3)
    if "hf" in compare:
        del llm
        result["hf"] = run_hf(model, dtype, work, hf_batch_size or num_prompts)
        result["output_speedup_vs_hf"] = round(
            result["brisk"]["output_tokens_per_s"] / result["hf"]["output_tokens_per_s"], 3)
    return result
