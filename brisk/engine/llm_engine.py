"""LLMEngine: the step loop joining scheduler, runner, sampler and detokenizer.

    add_request ──► Scheduler.schedule() ──► runner.execute_model(StepBatch) ──► RunnerOutput
                         ▲                  (forward, sample / verify:          (sampled ids,
                         │                   runtime/step.py)                    logprobs)  │
                         └──── update_from_output (append, stop checks) ◄───────────────────┘
                                    │
                                    └─► detokenize, stop strings ─► RequestOutput (deltas)

A user request with n > 1 becomes n sequences ("<id>#<i>"); the later ones wait for the first
to compute the prompt, then share its cached blocks (see core/scheduler.py).
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from brisk.config import CacheConfig, SchedulerConfig, SpecConfig
from brisk.core.kv_cache_manager import KVCacheManager
from brisk.core.kv_groups import KVGroup
from brisk.core.kv_manager import KVManager
from brisk.core.outputs import ScheduledRequest, SchedulerOutput
from brisk.core.scheduler import Scheduler
from brisk.core.virtual_kv import VirtualKVManager
from brisk.engine.detokenizer import IncrementalDetokenizer
from brisk.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from brisk.engine.speculative import Speculator, build_speculator
from brisk.errors import UserError
from brisk.loader.tokenizer import Tokenizer
from brisk.model.base import CausalLM
from brisk.request import FinishReason, Request, RequestStatus, SamplingParams
from brisk.runtime.paged_runner import PagedModelRunner, kv_block_bytes, model_kv_groups
from brisk.runtime.parallel_runner import ParallelRunner
from brisk.runtime.step import Runner, RunnerOutput, StepBatch
from brisk.runtime import virtual_kv
from brisk.runtime.virtual_kv import VirtualKV
from brisk.sample.logprobs import TokenLogprobs
from brisk.sample.structured import Constraint, GrammarCompiler
from brisk.speculative.base import Draft


@dataclass
class _Seq:
    """Engine-side state of one sequence."""

    request: Request
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    group: str
    index: int
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # prompt position -> logprob of that prompt token given the ones before it (params.prompt_logprobs)
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_pushed: int = 0  # output tokens handed to the detokenizer
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for this sequence
    num_accepted_tokens: int = 0  # of those, accepted
    constraint: Constraint | None = None  # params.structured's grammar state (each sibling its own)


@dataclass
class _Group:
    """One user request: its prompt and its n sequences."""

    prompt: str | None
    prompt_token_ids: list[int]
    seq_ids: list[str]
    arrival_time: float


def num_kv_blocks(cache: CacheConfig, block_bytes: int) -> int:
    """Blocks from an explicit count, or as many blocks of `block_bytes` as `kv_cache_memory_gib` holds."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    return max(1, int(cache.kv_cache_memory_gib * 2**30) // block_bytes)


def _virtual_layout(model: CausalLM, cache: CacheConfig, scheduler: SchedulerConfig,
                    pack_weights: bool, eager: bool) -> tuple[PagedModelRunner, VirtualKVManager]:
    """A row of `max_model_len` tokens per sequence slot, every layer its own (one KV group);
    tiles of `block_size` tokens, on the CPU doubled until a tile is whole pages (on CUDA's 2 MiB
    pages, rows are whole pages instead)."""
    backing = virtual_kv.default_backing(model.device)
    probe = VirtualKV.tile_for(model, cache.block_size, backing)
    rows, row_tiles = scheduler.max_num_seqs, VirtualKV.row_tiles_for(model, scheduler.max_model_len, probe, backing)
    tensors = VirtualKV(model, rows, row_tiles, probe, cache.kv_huge_pages, backing)
    budget = num_kv_blocks(cache, tensors.bytes_per_tile)
    pages = tensors.page_model()  # None where tiles are whole pages
    least = len(tensors.buffers) * tensors.backing.page  # a request's first page in every tensor
    if pages is not None and budget * tensors.bytes_per_tile < least:
        raise UserError(f"the virtual KV layout commits {tensors.backing.page >> 20} MiB pages: one request takes "
                         f"{least / 2**30:.2f} GiB ({len(tensors.buffers)} layer tensors x a page), more than the KV "
                         "budget; raise kv_cache_memory_gib or use kv_layout='paged'")
    groups = (KVGroup(0, tuple(range(model.config.num_hidden_layers))),)
    runner = PagedModelRunner(model, rows * row_tiles, probe, pack_weights, groups, virtual=tensors, eager=eager)
    # a tile ahead pays only where a spare core commits it beside the forward; elsewhere it would be
    # committed on the step's thread all the same, one tile earlier: just in time holds less
    return runner, VirtualKVManager(rows, row_tiles, probe, budget, cache.enable_prefix_caching,
                                    commit_ahead=tensors.ahead_thread, pages=pages)


class LLMEngine:
    def __init__(self, model: CausalLM, tokenizer: Tokenizer, cache: CacheConfig,
                 scheduler: SchedulerConfig, seed: int = 0, pack_weights: bool = True,
                 speculative: SpecConfig | None = None, draft_model: CausalLM | None = None,
                 runner: ParallelRunner | None = None, eager: bool = False) -> None:
        """`speculative`: speculative decoding (spec/); `draft_model` is the loaded draft for method
        "draft" (the caller loads it: the engine never reads files). `runner`: a parallel runner
        over worker processes (engine/workers/) instead of this process's own. `eager`
        (`enforce_eager`): the runners run every step module by module (no C++ decode plan, no
        CUDA graphs)."""
        self.model = model
        self.eager = eager
        self.tokenizer = tokenizer
        self.cache_config = cache
        self.scheduler_config = scheduler
        self.runner: Runner  # runtime/step.py's protocol: this process's runner or a parallel one
        self.virtual_kv: VirtualKVManager | None = None  # kv_layout "virtual": rows committed on demand
        kv: KVManager
        if runner is not None:
            cache.check_multi_process()
            self.num_blocks, self.runner = runner.num_blocks, runner
        elif cache.kv_layout == "virtual":
            self.runner, self.virtual_kv = _virtual_layout(model, cache, scheduler, pack_weights, eager)
            self.num_blocks = self.virtual_kv.budget
        else:
            groups = model_kv_groups(model, scheduler.max_model_len)  # which layers share a block table
            self.num_blocks = num_kv_blocks(cache, kv_block_bytes(model, cache.block_size, groups))
            self.runner = PagedModelRunner(model, self.num_blocks, cache.block_size, pack_weights, groups, eager=eager)
        kv = self.virtual_kv or KVCacheManager(self.num_blocks, cache.block_size, cache.enable_prefix_caching,
                                               [g.window for g in self.runner.groups])
        self.scheduler = Scheduler(scheduler, kv)
        # without a speculative method, constrained requests still draft what their grammar forces
        self.spec = Speculator(None, None) if speculative is None else build_speculator(
            speculative, self.runner, cache, self.num_blocks, draft_model, pack_weights, seed, eager)
        if self.virtual_kv is not None:
            self._memory().release_all()  # the speculator's start-up measurement wrote scratch KV into row 0
        self._seeds = random.Random(seed)  # seeds for sampled requests that bring none
        self._seqs: dict[str, _Seq] = {}
        self._groups: dict[str, _Group] = {}
        self.peak_kv_usage = 0.0
        self._grammars: GrammarCompiler | None = None  # built on the first structured request
        self._grammars_lock = threading.Lock()
        self._masks: ThreadPoolExecutor | None = None  # fills grammar masks while the forward runs
        # ...only where a core is left over: on 2 cores with torch on both, the thread slowed the
        # forward more than it saved (BENCHMARKS.md, structured outputs), so masks fill inline
        self._mask_thread = (os.cpu_count() or 1) > torch.get_num_threads()
        self.failures: dict[str, Exception] = {}  # request id -> the error that ended it (take_failures)

    def _memory(self) -> VirtualKV:
        assert isinstance(self.runner, PagedModelRunner) and self.runner.virtual is not None
        return self.runner.virtual

    def _sync_memory(self) -> set[str]:
        """Carry out the virtual layout's page commits and releases (nothing for the paged one);
        once idle, give back the pages warm free rows kept. A commit that failed (out of memory)
        ends the requests whose tables name its tiles, with the error (`take_failures`), and
        un-counts the tiles; returns those requests' sequence ids."""
        if self.virtual_kv is None:
            return set()
        if not self.scheduler.has_unfinished():
            self.virtual_kv.reclaim()
        memory = self._memory()
        memory.apply(self.virtual_kv.take_memory_ops())
        tiles, error = memory.take_unbacked()
        if not tiles:
            return set()
        self.virtual_kv.uncommit(tiles)
        ended = set(self.virtual_kv.requests_naming(tiles))
        failure = UserError(f"the virtual KV layout could not commit memory for this request ({error}); other "
                            "requests went on: lower kv_cache_memory_gib or max_num_seqs so the budget fits the "
                            "device's free memory, or use kv_layout='paged' (its pool is allocated at start-up)")
        for sid in sorted(ended):
            seq = self._seqs.get(sid)
            if seq is not None and self.abort_request(seq.group):
                self.failures[seq.group] = failure
        return ended

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None) -> None:
        """Queue a request; bad input is a ValueError and leaves the engine untouched."""
        seq_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        taken = [sid for sid in [request_id, *seq_ids] if sid in self._groups or sid in self._seqs]
        if taken:
            raise UserError(f"request id {request_id!r} collides with a request in flight ({taken[0]!r}); use a new id")
        params.check_vocab(self.model.config.vocab_size)
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise UserError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        # compiled before anything is queued: a bad schema or regex is this request's ValueError
        constraints = [self.grammars().constraint(params.structured) if params.structured else None
                       for _ in seq_ids]
        requests = [
            Request(sid, list(prompt_token_ids), params, arrival, self.tokenizer.eos_token_ids,
                    parent_id=None if i == 0 else seq_ids[0])
            for i, sid in enumerate(seq_ids)
        ]
        added: list[str] = []
        try:
            for i, req in enumerate(requests):
                self.scheduler.add_request(req)  # validates length against max_model_len and the pool
                added.append(req.request_id)
                self._seqs[req.request_id] = _Seq(req, IncrementalDetokenizer(
                    self.tokenizer, params.stop, params.skip_special_tokens), self._generator(params, i),
                    request_id, i, constraint=constraints[i])
        except ValueError:
            for sid in added:
                self.scheduler.abort_request(sid)
                self._seqs.pop(sid, None)
            raise
        self._groups[request_id] = _Group(prompt, list(prompt_token_ids), seq_ids, arrival)

    def grammars(self) -> GrammarCompiler:
        """The grammar compiler over this engine's tokenizer (structured outputs), built once."""
        with self._grammars_lock:  # the server's request threads check grammars beside the engine
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer.backend_json(), self.model.config.vocab_size,
                                                 sorted(self.tokenizer.eos_token_ids))
        return self._grammars

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.greedy:
            return None
        seed = params.seed + index if params.seed is not None else self._seeds.getrandbits(63)
        return torch.Generator(device=self.runner.device).manual_seed(seed)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request (all its sequences) and give its KV blocks back."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for sid in group.seq_ids:
            self.scheduler.abort_request(sid)
            self._seqs.pop(sid, None)
            self.spec.release(sid, finished=True)
        self._sync_memory()
        return True

    def check(self) -> None:
        """Raise if the engine can no longer run a step (a parallel worker has ended); cheap, for
        idle loops."""
        self.runner.check()

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._groups)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return an output for every request that made progress."""
        sched = self.scheduler.schedule(self.spec.plan(self.scheduler.running, self._constraints()))
        ended = self._sync_memory()  # this step's tiles committed before the forward writes them
        if ended:  # their pages could not be committed: they ended with the error, the step runs without them
            sched.scheduled = [s for s in sched.scheduled if s.request_id not in ended]
            sched.num_batched_tokens = sum(s.num_tokens for s in sched.scheduled)
        for rid in sched.preempted_ids:
            self.spec.release(rid, finished=False)
        if sched.is_empty:
            assert ended or not self.scheduler.has_unfinished(), "scheduler made no progress with requests queued"
            return []
        self.peak_kv_usage = max(self.peak_kv_usage, self.scheduler.kv_usage)
        started = time.perf_counter()
        try:
            out = self._compute(sched)
        except BaseException as e:
            self._abort_failed_step(sched)
            if getattr(e, "fatal", False):  # a parallel worker is gone: nothing can run any more
                for group in list(self._groups):
                    self.abort_request(group)
            raise
        self._end_failed(out.failed)
        self.scheduler.observe_step(sched, time.perf_counter() - started)
        touched: set[str] = set()
        for req in self.scheduler.update_from_output(sched, out.token_ids):
            self._on_tokens(self._seqs[req.request_id])
            touched.add(self._seqs[req.request_id].group)
            if req.is_finished():
                self.spec.release(req.request_id, finished=True)
        self._sync_memory()  # may end requests (a failed commit ahead): their failures say why
        touched &= self._groups.keys()
        return [self._output(g) for g in sorted(touched, key=lambda g: self._groups[g].arrival_time)]

    def _compute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Drafts (if speculating), then the runner's step (forward, sampling, verification): the
        new tokens of every request that reached the end of its known tokens, recorded here with
        their logprobs, and the rows that failed alone."""
        steps, drafts = sched.scheduled, {}
        if any(s.num_spec_slots for s in sched.scheduled):
            steps, drafts = self.spec.fill(sched, self._requests(), self._generators(), self._constraints())
        prompt_rows = frozenset(s.request_id for s in sched.scheduled
                                if self._wants_prompt_logprobs(s.request_id, s.start_pos))
        masks = self._masks_ahead(steps, drafts)
        out = self.runner.execute_model(StepBatch(steps, self._seqs, drafts, prompt_rows,
                                                  None if masks is None else masks.result))
        if all(s.num_tokens == 1 for s in sched.scheduled):  # decode-only steps
            self.spec.observe_forward(out.forward_seconds, drafts)
        self.spec.observe_verified(drafts, out.num_accepted)
        self.spec.observe_hidden(out, steps)
        for sid, tokens in out.prompt_logprobs.items():
            self._seqs[sid].prompt_logprobs.update(tokens)  # a recompute after preemption rewrites the same
        for sid, lps in out.logprobs.items():
            self._seqs[sid].logprobs.extend(lps)
        for sid, accepted in out.num_accepted.items():
            seq = self._seqs[sid]
            seq.num_draft_tokens += len(drafts[sid].token_ids)
            seq.num_accepted_tokens += accepted
        return out

    def _masks_ahead(self, steps: list[ScheduledRequest], drafts: dict[str, Draft]) -> Future[None] | None:
        """Start filling the next masks of this step's constrained rows (with drafts: their
        verification masks) on the mask thread, so they are ready when the forward ends; the
        forward's kernels release the GIL, llguidance's mask computation does too. None: no
        constrained row, or no spare core (the sampler fills the masks itself)."""
        todo = [(c, drafts[s.request_id].token_ids if s.request_id in drafts else None)
                for s in steps if (c := self._seqs[s.request_id].constraint) is not None]
        if not todo or not self._mask_thread:
            return None
        if self._masks is None:
            self._masks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="brisk-masks")

        def fill() -> None:
            for constraint, draft in todo:
                constraint.prefetch(draft)

        return self._masks.submit(fill)

    def _end_failed(self, failed: dict[str, Exception]) -> None:
        """End the requests whose rows failed this step (sequence id -> its error); their errors
        wait in `failures`."""
        for sid, error in failed.items():
            seq = self._seqs.get(sid)
            if seq is not None and self.abort_request(seq.group):
                self.failures[seq.group] = error

    def take_failures(self) -> dict[str, Exception]:
        """Requests ended by an error of their own since the last call (request id -> the error);
        every other request of those steps went on."""
        failures, self.failures = self.failures, {}
        return failures

    def _requests(self) -> dict[str, Request]:
        return {sid: seq.request for sid, seq in self._seqs.items()}

    def _generators(self) -> dict[str, torch.Generator | None]:
        return {sid: seq.generator for sid, seq in self._seqs.items()}

    def _constraints(self) -> dict[str, Constraint]:
        """The grammars of the constrained sequences by id."""
        return {sid: seq.constraint for sid, seq in self._seqs.items() if seq.constraint is not None}

    def _abort_failed_step(self, sched: SchedulerOutput) -> None:
        """The forward or the sampler raised (a kernel error, Ctrl-C): the step's KV was not
        written, so its requests end and its blocks leave the prefix cache; the rest carry on."""
        for seq_id in self.scheduler.abort_step(sched):
            seq = self._seqs.get(seq_id)
            if seq is not None:
                self.abort_request(seq.group)

    def _wants_prompt_logprobs(self, seq_id: str, start_pos: int) -> bool:
        seq = self._seqs[seq_id]
        return (seq.index == 0 and seq.request.sampling_params.prompt_logprobs is not None
                and start_pos < seq.request.num_prompt_tokens - 1)

    def _on_tokens(self, seq: _Seq) -> None:
        """Detokenize the tokens appended this step (one, or several after speculation), in order.
        A stop string ends the sequence at its token: tokens verified after it are dropped, as if
        they had never been generated."""
        req = seq.request
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
        new = req.output_token_ids[seq.num_pushed:]
        for i, token in enumerate(new):
            stopped_by_token = i == len(new) - 1 and req.finish_reason == FinishReason.STOP and (
                token in req.sampling_params.stop_token_ids or token in req.eos_token_ids)
            if seq.constraint is not None and not self._advance_grammar(seq, token):
                break
            seq.num_pushed += 1
            if stopped_by_token:  # the stop token's text never reaches the output
                break
            seq.detok.push(token)
            if seq.detok.stopped:
                del req.output_token_ids[seq.num_pushed:]
                if req.is_finished():  # the scheduler ended it by length on this very token
                    req.finish_reason, req.status = FinishReason.STOP, RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish_request(req.request_id, FinishReason.STOP)
                break
            if seq.constraint is not None and seq.constraint.done:
                break  # the grammar's last token: verified tokens after it were dropped
        del seq.logprobs[req.num_output_tokens:]  # verified tokens past a stop carry no logprobs
        if req.is_finished():
            seq.detok.flush()  # a trailing partial character is shown, not dropped (no-op after a stop string)
            seq.finish_time = now

    def _advance_grammar(self, seq: _Seq, token: int) -> bool:
        """Feed a sampled token to the sequence's grammar; a complete grammar ends the sequence
        (STOP) with that token. False: the grammar refused it (the request ends with that error)."""
        assert seq.constraint is not None
        req = seq.request
        try:
            seq.constraint.advance(token)
        except ValueError as e:
            if seq.constraint.allows_nothing():  # a dead end of the grammar: the request ends, with its text
                del req.output_token_ids[seq.num_pushed:]
                if req.is_finished():
                    req.finish_reason, req.status = FinishReason.GRAMMAR, RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish_request(req.request_id, FinishReason.GRAMMAR)
                return False
            self.failures[seq.group] = e
            self.abort_request(seq.group)
            return False
        if seq.constraint.done:
            # nothing after the grammar's last token (verified drafts, an EOS, the token max_tokens
            # ended on): the sequence ends here, as non-speculative decoding ends it
            del req.output_token_ids[seq.num_pushed + 1:]
            if req.is_finished():
                req.finish_reason, req.status = FinishReason.STOP, RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_request(req.request_id, FinishReason.STOP)
        return True

    def _output(self, group_id: str) -> RequestOutput:
        group = self._groups[group_id]
        seqs = [self._seqs[sid] for sid in group.seq_ids]
        finished = all(s.request.is_finished() for s in seqs)
        completions = [
            CompletionOutput(s.index, "", list(s.request.output_token_ids), s.request.finish_reason,
                             s.detok.stream_delta(s.request.is_finished()), list(s.logprobs) or None)
            for s in seqs
        ]
        for c, s in zip(completions, seqs):
            c.text = s.detok.text[:s.detok.emitted]  # text that may still become a stop string stays hidden
        firsts = [s.first_token_time for s in seqs if s.first_token_time is not None]
        metrics = RequestMetrics(group.arrival_time, min(firsts) if firsts else None,
                                 max(s.finish_time or 0.0 for s in seqs) if finished else None,
                                 sum(s.num_draft_tokens for s in seqs), sum(s.num_accepted_tokens for s in seqs))
        out = RequestOutput(group_id, group.prompt, group.prompt_token_ids, completions, finished, metrics,
                            num_cached_tokens=max(0, seqs[0].request.num_cached_tokens),
                            prompt_logprobs=self._prompt_logprobs_of(seqs[0]))
        if finished:
            del self._groups[group_id]
            for sid in group.seq_ids:
                del self._seqs[sid]
        return out

    @staticmethod
    def _prompt_logprobs_of(seq: _Seq) -> list[TokenLogprobs | None] | None:
        """One entry per prompt token (None for the first, which has no context), as vLLM returns."""
        if seq.request.sampling_params.prompt_logprobs is None:
            return None
        return [None] + [seq.prompt_logprobs.get(p) for p in range(1, seq.request.num_prompt_tokens)]

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, float]:
        s = self.scheduler
        return {"running": s.num_running, "waiting": s.num_waiting, "kv_usage": s.kv_usage,
                "prefix_hit_rate": s.prefix_hit_rate, "num_preemptions": s.num_preemptions,
                "num_kv_blocks": self.num_blocks, "peak_kv_usage": self.peak_kv_usage,
                **self.spec.info(),
                **self.runner.info()}

    def reset_peak_stats(self) -> None:
        self.peak_kv_usage = self.scheduler.kv_usage

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt block (vLLM's `reset_prefix_cache`): the next requests compute
        their prompts whole, as on a fresh engine. Running requests keep their KV."""
        self.scheduler.kv.reset_prefix_cache()
