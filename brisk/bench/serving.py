"""`brisk bench serve`: load any OpenAI-compatible server the way users do, and time it.

Requests arrive as a Poisson process at `rate` per second (`inf`: all at once), each a streamed
`/v1/completions` call. The prompts are the seeded token-id workload of `brisk bench throughput`
(same seed and count: the same prompts and output lengths), so the served figure can be put beside
the offline one; every request asks for exactly its output length (`ignore_eos`). Measured per
request: time to first token, the gaps between streamed chunks (ITL), time per output token after
the first (TPOT) and end-to-end latency.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from brisk.bench.throughput import Workload, _pct


@dataclass
class RequestTiming:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def _one(client: httpx.AsyncClient, url: str, model: str | None, prompt: list[int], max_tokens: int,
               headers: dict[str, str]) -> RequestTiming:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    start = time.perf_counter()
    last = start
    timing = RequestTiming(ok=False)
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                return RequestTiming(ok=False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    timing.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if timing.ttft == 0.0:
                        timing.ttft = now - start
                    else:
                        timing.itl.append(now - last)
                    last = now
    except httpx.HTTPError as e:
        return RequestTiming(ok=False, error=f"{type(e).__name__}: {e}")
    timing.e2e = time.perf_counter() - start
    timing.ok = timing.ttft > 0.0
    return timing


async def _run(url: str, model: str | None, work: Workload, rate: float, seed: int,
               api_key: str | None) -> tuple[list[RequestTiming], float]:
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(work.prompts) + 4, max_keepalive_connections=len(work.prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for prompt, n_out in zip(work.prompts, work.output_lens):
            tasks.append(asyncio.create_task(_one(client, url, model, prompt, n_out, headers)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        timings = await asyncio.gather(*tasks)
        return timings, time.perf_counter() - start


def _summary(name: str, values: list[float]) -> dict[str, float]:
    return {f"{name}_p{q}_ms": round(_pct(values, q) * 1000, 1) for q in (50, 90, 99)}


def bench_serve(url: str, model: str | None, work: Workload, rate: float, seed: int, api_key: str | None,
                plot: Path | None) -> dict[str, Any]:
    timings, elapsed = asyncio.run(_run(url.rstrip("/"), model, work, rate, seed, api_key))
    ok = [t for t in timings if t.ok]
    tpot = [(t.e2e - t.ttft) / (t.output_tokens - 1) for t in ok if t.output_tokens > 1]
    itl = [g for t in ok for g in t.itl]
    out_tokens = sum(t.output_tokens for t in ok)
    result: dict[str, Any] = {
        "bench": "serve", "url": url, "request_rate": rate, "num_requests": len(timings), "completed": len(ok),
        "failed": len(timings) - len(ok), "errors": sorted({t.error for t in timings if t.error})[:3],
        "duration_s": round(elapsed, 2), "output_tokens": out_tokens, "requests_per_s": round(len(ok) / elapsed, 3),
        "output_tokens_per_s": round(out_tokens / elapsed, 2),
        "total_tokens_per_s": round((out_tokens + sum(len(p) for p in work.prompts)) / elapsed, 2),
        **_summary("ttft", [t.ttft for t in ok]), **_summary("tpot", tpot), **_summary("itl", itl),
        **_summary("e2e", [t.e2e for t in ok]),
    }
    if plot is not None:
        result["plot"] = _plot(plot, ok, tpot, itl)
    return result


def _plot(path: Path, ok: list[RequestTiming], tpot: list[float], itl: list[float]) -> str:
    """A PNG of the four latency distributions; needs matplotlib (`pip install matplotlib`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "not written: matplotlib is not installed (pip install matplotlib)"
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    for ax, (name, values) in zip(axes, [("TTFT", [t.ttft for t in ok]), ("TPOT", tpot), ("ITL", itl),
                                         ("end-to-end", [t.e2e for t in ok])]):
        ax.hist([v * 1000 for v in values], bins=40)
        ax.set_title(f"{name} (ms)")
        ax.set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
