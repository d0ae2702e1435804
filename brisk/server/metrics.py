"""Prometheus metrics for /metrics: engine gauges read at scrape time, latency histograms and
token counters fed by the handlers as outputs arrive. One registry per server, so tests can
run several servers in one process."""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from brisk.engine.async_engine import AsyncEngine
from brisk.engine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


_SPEC_GAUGES = {
    "spec_verify_steps": "request-steps that verified draft tokens",
    "spec_draft_tokens": "draft tokens verified",
    "spec_accepted_tokens": "draft tokens accepted",
    "spec_acceptance_rate": "accepted / drafted tokens",
    "spec_mean_accepted_per_step": "draft tokens accepted per verify step (the bonus token not counted)",
}


class ServerMetrics:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        r = self.registry = CollectorRegistry()
        self.running = Gauge("brisk_requests_running", "sequences being computed", registry=r)
        self.waiting = Gauge("brisk_requests_waiting", "sequences waiting for a slot", registry=r)
        self.kv_used = Gauge("brisk_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_total = Gauge("brisk_kv_blocks_total", "KV cache blocks in the pool", registry=r)
        self.kv_usage = Gauge("brisk_kv_cache_usage", "fraction of KV blocks in use", registry=r)
        self.hit_rate = Gauge("brisk_prefix_cache_hit_rate", "prompt tokens served from the prefix cache", registry=r)
        self.requests = Counter("brisk_requests", "requests accepted", registry=r)
        self.prompt_tokens = Counter("brisk_prompt_tokens", "prompt tokens accepted", registry=r)
        self.generation_tokens = Counter("brisk_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("brisk_time_to_first_token_seconds", "arrival to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("brisk_inter_token_latency_seconds", "time between outputs of a request", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("brisk_e2e_request_latency_seconds", "arrival to finish", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self._seen: dict[str, tuple[int, float]] = {}  # request id -> (tokens counted, time of last output)
        # Speculative decoding (engine counters since start-up; absent without speculation).
        method = engine.engine.spec.method
        self.spec_method = method
        if method is not None:
            labels = {"method": method}
            self.spec = {key: Gauge(f"brisk_{key}", text, registry=r, labelnames=["method"]).labels(**labels)
                         for key, text in _SPEC_GAUGES.items()}

        # Tensor / pipeline parallelism (absent in one process).
        self.parallel = "tensor_parallel_size" in engine.engine.stats()
        if self.parallel:
            self.tp = Gauge("brisk_tensor_parallel_size", "processes sharing every layer", registry=r)
            self.pp = Gauge("brisk_pipeline_parallel_size", "pipeline stages", registry=r)
            self.comm = Gauge("brisk_parallel_rank0_comm_bytes", "bytes rank 0 has handed to collectives",
                              registry=r)

    def on_request(self, prompt_tokens: int) -> None:
        self.requests.inc()
        self.prompt_tokens.inc(prompt_tokens)

    def on_output(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        tokens = sum(len(c.token_ids) for c in out.outputs)
        counted, last = self._seen.get(out.request_id, (0, 0.0))
        if tokens > counted:
            self.generation_tokens.inc(tokens - counted)
            if counted == 0 and out.metrics.ttft is not None:
                self.ttft.observe(out.metrics.ttft)
            elif counted > 0:
                self.itl.observe(now - last)
        self._seen[out.request_id] = (tokens, now)
        if out.finished:
            del self._seen[out.request_id]
            if out.metrics.finish_time is not None:
                self.e2e.observe(out.metrics.finish_time - out.metrics.arrival_time)

    def forget(self, request_id: str) -> None:
        """An aborted or failed request leaves no per-request state behind."""
        self._seen.pop(request_id, None)

    def render(self) -> tuple[bytes, str]:
        info = self.engine.info()
        self.running.set(info.get("running", 0))
        self.waiting.set(info.get("waiting", 0))
        total = info.get("num_kv_blocks", 0)
        self.kv_total.set(total)
        self.kv_usage.set(info.get("kv_usage", 0.0))
        self.kv_used.set(round(info.get("kv_usage", 0.0) * total))
        self.hit_rate.set(info.get("prefix_hit_rate", 0.0))
        if self.spec_method is not None:
            for key, gauge in self.spec.items():
                gauge.set(info.get(key, 0.0))
        if self.parallel:
            self.tp.set(info.get("tensor_parallel_size", 0))
            self.pp.set(info.get("pipeline_parallel_size", 0))
            self.comm.set(info.get("parallel_rank0_comm_bytes", 0))
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
