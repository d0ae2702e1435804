"""Speculative decoding inside the step loop: plan draft lengths, fill drafts, verify, count.

    plan()   before schedule(): draft tokens wanted per request, from the length controller
    fill()   after schedule(): ask the proposer for drafts into the reserved slots; the runner
             then scores [t_last, d1..dk] of those requests in the same forward as everything else
    observe_verified() after the runner's step verified the drafts (runtime/step.py): acceptance
             counted per method, the length controller told what was kept
    observe_hidden() proposers that read the target's hidden rows (Medusa, streaming) get them
    release() a request finished, was aborted or preempted: the proposer drops its state

Lossless by construction: the verifier emits what the target would have; drafts only decide how
many tokens one forward yields.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from brisk.config import CacheConfig, SpecConfig
from brisk.core.kv_cache_manager import KVCacheManager
from brisk.core.outputs import ScheduledRequest, SchedulerOutput
from brisk.errors import UserError
from brisk.model.base import CausalLM
from brisk.request import Request
from brisk.runtime.paged_runner import PagedModelRunner
from brisk.runtime.parallel_runner import ParallelRunner
from brisk.runtime.step import RunnerOutput
from brisk.sample.structured import Constraint
from brisk.speculative.base import Draft, DraftRequest, Proposer
from brisk.speculative.length import DraftLength
from brisk.speculative.ngram import LookupFirst
from brisk.speculative.registry import method as proposer_method

# Cost of verifying one more token in a decode step, as a fraction of the step, when nothing was
# measured (tests); the engine measures the real curve at start-up (measure_verify_costs).
VERIFY_COST = 0.06
# Forced tokens a constrained request verifies in one step (jump-forward). A JSON schema's forced
# runs (`", "field_07": `, closing brackets) are a few tokens; longer literals continue next step.
MAX_FORCED = 16


@dataclass
class SpecStats:
    """Counters since start-up (engine stats, /metrics, bench)."""

    num_verify_steps: int = 0  # request-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_per_step(self) -> float:
        """Drafts kept per verify step (the bonus token not counted)."""
        return self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else 0.0

    def add(self, drafted: int, accepted: int) -> None:
        self.num_verify_steps += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted


class _Ema:
    """Exponential moving average of a timing (None before the first sample)."""

    def __init__(self, weight: float = 0.1) -> None:
        self.weight = weight
        self.value: float | None = None

    def update(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.weight * (x - self.value)


class Speculator:
    """Drafts for the next step and their verification. Requests under a grammar draft the tokens
    it forces (jump-forward) whether or not a proposer is configured; the others draft with the
    proposer, if any."""

    def __init__(self, config: SpecConfig | None, proposer: Proposer | None, verify_costs: list[float] | None = None,
                 seed: int = 0, measure_costs: bool = True) -> None:
        """`config`, `proposer`: the speculative method (both None: only forced drafts, the engine's
        default). `verify_costs[k]`: measured extra cost of verifying k drafts (None: VERIFY_COST * k).
        `measure_costs`: refine the draft cost from timings (False: keep the proposer's estimate,
        for reproducible draft lengths in tests)."""
        assert (config is None) == (proposer is None), "a speculative method needs its proposer"
        self.config = config
        self.proposer = proposer
        self.length: DraftLength | None = None  # the proposer's draft lengths
        if config is not None and proposer is not None:
            cap = proposer.max_drafts  # Medusa: one per head; ngram: its lookup's longest
            max_k = config.max_tokens if cap is None else min(config.max_tokens, cap)
            self.verify_costs = verify_costs or [VERIFY_COST * k for k in range(config.max_tokens + 1)]
            self.length = DraftLength(config, proposer.draft_cost, self.verify_costs, seed, max_k=max_k,
                                      free_classes=proposer.free_classes)
        self.stats = SpecStats()  # every draft, forced ones included
        self._draft_seconds = _Ema()  # one draft pass over the batch
        self._plain_seconds = _Ema()  # one target forward, less the verified drafts' share
        self._seen: set[str] = set()  # requests that have had a proposal since (re)admission
        self._classes: dict[str, int] = {}  # request id -> the draft class its length was planned for
        self._forced: set[str] = set()  # this step's requests whose drafts are their grammar's forced tokens
        self.measure_costs = measure_costs

    @property
    def method(self) -> str | None:
        """The configured speculative method (None: forced drafts only)."""
        return None if self.config is None else self.config.method

    def plan(self, running: list[Request], constraints: dict[str, Constraint] | None = None) -> dict[str, int]:
        """Draft lengths for the requests that will decode next step, by request id (what
        `Scheduler.schedule` makes room for): a constrained request's is the number of tokens its
        grammar forces from here (`constraints`: grammars by request id)."""
        grammars = constraints or {}
        wanted: dict[str, int] = {}
        for req in running:
            grammar = grammars.get(req.request_id)
            wanted[req.request_id] = len(grammar.forced_tokens(MAX_FORCED)) if grammar is not None else self._wanted(req)
        return wanted

    def _wanted(self, req: Request) -> int:
        """The proposer's draft length for an unconstrained request (0 without a proposer)."""
        if self.length is None:
            return 0
        assert self.proposer is not None, "a length controller has its proposer"
        found = self.proposer.draft_class(req.request_id, req.all_token_ids)
        if found is None:
            return self.length.wanted(req.request_id)
        cls, available = found
        k = self.length.wanted(req.request_id, cls, cap=available) if available else 0
        if not k and cls in self.proposer.free_classes:  # a lookup not worth verifying: the method may be
            other = self.proposer.fallback_class(req.request_id, req.all_token_ids)
            if other is not None:
                cls, available = other
                k = self.length.wanted(req.request_id, cls, cap=available) if available else 0
        self._classes[req.request_id] = cls
        return k

    def fill(self, sched: SchedulerOutput, requests: dict[str, Request],
             generators: dict[str, torch.Generator | None],
             constraints: dict[str, Constraint | None] | None = None,
             ) -> tuple[list[ScheduledRequest], dict[str, Draft]]:
        """The steps the runner computes (drafts appended to their requests' token ids) and the
        non-empty drafts by request id.

        A request under a grammar drafts only the tokens the grammar forces next (jump-forward:
        keys, `": `, closing brackets), never the proposer's: measured on SmolLM2 under an 8-field
        schema, ngram guesses were accepted 12% of the time and made constrained decoding
        0.72-0.80x plain, forced tokens 100% and 1.10-1.18x (BENCHMARKS.md). Forced drafts are
        verified like any other: the grammar forces bytes, not their split into tokens, so the
        target's own choice of tokens is what counts (greedy: it agreed every time measured)."""
        asks = [s for s in sched.scheduled if s.num_spec_slots > 0]
        self._forced = set()
        if not asks:
            return sched.scheduled, {}
        grammars = constraints or {}
        drafts: dict[str, Draft] = {}
        for ask in asks:
            grammar = grammars.get(ask.request_id)
            if grammar is not None and (forced := grammar.forced_tokens(ask.num_spec_slots)):
                drafts[ask.request_id] = Draft(forced)  # a point mass the masked target agrees with
                self._forced.add(ask.request_id)
        free = [s for s in asks if grammars.get(s.request_id) is None]
        if free and self.proposer is not None:
            self._propose(free, requests, generators, drafts)
        steps = [dataclasses.replace(s, token_ids=s.token_ids + drafts[s.request_id].token_ids)
                 if s.request_id in drafts else s for s in sched.scheduled]
        return steps, drafts

    def _propose(self, asks: list[ScheduledRequest], requests: dict[str, Request],
                 generators: dict[str, torch.Generator | None], drafts: dict[str, Draft]) -> None:
        """The proposer's drafts for `asks`, the non-empty ones into `drafts`."""
        batch = [DraftRequest(s.request_id, requests[s.request_id].all_token_ids, s.num_spec_slots, s.block_ids,
                              requests[s.request_id].sampling_params, generators[s.request_id]) for s in asks]
        started = time.perf_counter()
        proposed = self.proposer.propose(batch)
        # A request's first proposal may include its whole prompt (a draft model's prefill): not
        # a draft pass worth timing.
        # Only the proposer's own passes are timed: lookups (free classes) cost nothing and would
        # dilute the per-draft time if their slots counted.
        free = self.proposer.free_classes
        timed = [s for s in asks if self._classes.get(s.request_id) not in free]
        new = [s.request_id for s in timed if s.request_id not in self._seen]
        if timed and not new:
            self._draft_seconds.update((time.perf_counter() - started) / max(s.num_spec_slots for s in timed))
        self._seen.update(new)
        for ask, draft in zip(asks, proposed):
            assert len(draft.token_ids) <= ask.num_spec_slots, f"{self.proposer.name} proposed too many tokens"
            if draft.token_ids:
                drafts[ask.request_id] = draft

    def observe_forward(self, seconds: float, drafts: dict[str, Draft]) -> None:
        """The target's forward took `seconds`: refresh the draft cost the length controller uses
        (one draft pass over one plain decode step, both measured on this machine and batch)."""
        if self.length is None or self._forced:  # a step that also verified forced runs times more than the proposer's drafts
            return
        longest = max((len(d.token_ids) for d in drafts.values()), default=0)
        self._plain_seconds.update(seconds / (1.0 + self.verify_costs[longest]))
        if self.measure_costs and self._draft_seconds.value is not None and self._plain_seconds.value:
            self.length.draft_cost = self._draft_seconds.value / self._plain_seconds.value

    def observe_verified(self, drafts: dict[str, Draft], num_accepted: dict[str, int]) -> None:
        """The step's verification (runtime/step.py): acceptance statistics and the draft-length
        controller learn from each verified request's kept drafts."""
        for rid, accepted in num_accepted.items():
            self.stats.add(len(drafts[rid].token_ids), accepted)
            if self.length is not None and rid not in self._forced:  # forced drafts teach nothing of the proposer
                self.length.observe(rid, len(drafts[rid].token_ids), accepted, self._classes.get(rid))

    def observe_hidden(self, out: RunnerOutput, steps: list[ScheduledRequest]) -> None:
        """Proposers that read the target's hidden state get, per request, the row that produced
        its newest token and that row's position: its final hidden state (Medusa), or the
        residual stream the runner captured (Speculative Streaming: `capture_layer`)."""
        logits = out.logits
        if self.proposer is None or not self.proposer.observes_hidden or logits is None or not logits.sample_ids:
            return  # prompt chunks alone sample nothing
        source = logits.hidden if logits.captured is None else logits.captured  # what its proposer reads
        computed = {s.request_id: (s.start_pos, len(s.token_ids)) for s in steps}
        for rid in logits.sample_ids:
            first, count = logits.rows[rid]
            offset = out.num_accepted.get(rid, count - 1)
            start, n = computed[rid]
            # a copy: a view would keep the whole step's tensor alive as long as the request runs
            self.proposer.observe(rid, source[first + offset].clone(), start + n - count + offset)  # rows: the step's last `count`

    def release(self, request_id: str, finished: bool) -> None:
        if self.proposer is not None:
            self.proposer.release(request_id)
        self._seen.discard(request_id)
        self._classes.pop(request_id, None)
        if finished and self.length is not None:
            self.length.forget(request_id)

    def info(self) -> dict[str, float]:
        """Counters for the engine's stats: every draft, the grammars' forced ones included
        (nothing without a speculative method until a constrained request has drafted)."""
        s = self.stats
        if self.config is None and not s.num_verify_steps:
            return {}
        return {"spec_verify_steps": s.num_verify_steps, "spec_draft_tokens": s.num_draft_tokens,
                "spec_accepted_tokens": s.num_accepted_tokens, "spec_acceptance_rate": s.acceptance_rate,
                "spec_mean_accepted_per_step": s.mean_accepted_per_step}


@dataclass
class _Context:
    """speculative.registry.ProposerContext: the engine's pieces a proposer's builder may use."""

    config: SpecConfig
    target: CausalLM
    runner: PagedModelRunner | ParallelRunner
    draft_model: CausalLM | None
    cache: CacheConfig
    num_blocks: int
    pack_weights: bool
    eager: bool  # enforce_eager: the draft's runner too runs module by module

    def draft_runtime(self, model: CausalLM) -> tuple[PagedModelRunner, KVCacheManager]:
        # as many tokens of draft KV as the target has: every running request can draft
        runner = PagedModelRunner(model, self.num_blocks, self.cache.block_size, self.pack_weights, eager=self.eager)
        kv = KVCacheManager(self.num_blocks, self.cache.block_size, self.cache.enable_prefix_caching,
                            [g.window for g in runner.groups])
        return runner, kv


def build_speculator(config: SpecConfig, runner: PagedModelRunner | ParallelRunner, cache: CacheConfig,
                     num_blocks: int, draft_model: CausalLM | None, pack_weights: bool,
                     seed: int, eager: bool = False) -> Speculator:
    """The proposer `config.method` names (speculative.registry), wired to what it needs from the
    engine. Over parallel workers only methods that need nothing from other ranks draft."""
    method = proposer_method(config.method)
    if not method.parallel and not isinstance(runner, PagedModelRunner):
        raise UserError(f"speculative method {config.method!r} needs a single-process engine; use ngram")
    ctx = _Context(config, runner.model, runner, draft_model, cache, num_blocks, pack_weights, eager)
    proposer = method.build(ctx)
    if config.lookup_first:
        proposer = LookupFirst(proposer, config.prompt_lookup_min, config.prompt_lookup_max)
    return Speculator(config, proposer, measure_verify_costs(runner, config.max_tokens), seed=seed)


@torch.inference_mode()
def measure_verify_costs(runner: PagedModelRunner | ParallelRunner, max_k: int, repeats: int = 4) -> list[float]:
    """Extra cost of scoring k more tokens in one sequence's decode step, k = 0..max_k, relative
    to a one-token step: measured on this machine at start-up (~0.6 s) at k = 1, 2, 4, 8, ...
    (each shape warmed up first, the fastest of `repeats`), interpolated between, made
    non-decreasing. It writes scratch KV into the first blocks, which hold no request yet."""
    default = [VERIFY_COST * k for k in range(max_k + 1)]
    context = min(64, runner.model.max_positions - max_k - 2)
    per_group = -(-(context + max_k + 1) // runner.block_size)
    # every group's table its own scratch blocks (the first ones: no request holds any yet)
    blocks = [list(range(g * per_group, (g + 1) * per_group)) for g in range(len(runner.groups))]
    if runner.device.type != "cpu" or context < 1 or len(runner.groups) * per_group > runner.num_blocks:
        return default  # accelerators (launch-bound, flat) and tiny caches keep the default

    def seconds(n: int) -> float:
        step = _scratch([0] * n, context, blocks)
        runner.execute([step], frozenset({step.request_id}))  # warm-up of this shape
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            runner.execute([step], frozenset({step.request_id}))
            times.append(time.perf_counter() - started)
        return min(times)  # interference only ever adds time

    runner.execute([_scratch([0] * context, 0, blocks)])  # a context to attend over
    base = seconds(1)
    points = sorted({k for k in (1, 2, 4, 8, max_k) if k <= max_k})
    measured = {0: 0.0, **{k: max(0.0, seconds(1 + k) / base - 1.0) for k in points}}
    costs = [0.0]
    for k in range(1, max_k + 1):
        lo = max(p for p in measured if p <= k)
        hi = min(p for p in measured if p >= k)
        cost = measured[lo] if hi == lo else measured[lo] + (k - lo) / (hi - lo) * (measured[hi] - measured[lo])
        costs.append(max(costs[-1], cost))
    return costs


def _scratch(token_ids: list[int], start_pos: int, block_ids: list[list[int]]) -> ScheduledRequest:
    """A made-up request over scratch blocks (measure_verify_costs)."""
    return ScheduledRequest("scratch", token_ids, start_pos, block_ids, sample=True)
