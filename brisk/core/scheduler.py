"""The scheduler: one token budget per step, no prefill or decode phases (vLLM v1 style).

Every request has `num_computed_tokens`; a step lets it catch up by as many tokens as it is given
(a whole prompt, a chunk of one, or one decode token plus slots for the drafts that speculative
decoding verifies in the same step). Running requests are served first, so a
long prompt arriving never stalls the decodes (stall-free batching); waiting requests are then
admitted first-come first-served. The KV layout is the manager the scheduler is handed
(core/kv_manager.py): it only asks it for room. When KV blocks run out, the newest running request is
preempted by recompute: its blocks are freed and it starts over from the front of the queue
(often finding its own blocks still in the prefix cache).

Liveness: a sequence never grows past what the whole pool holds (`max_seq_len` below), so the
oldest running request can always get its blocks by preempting the others, and always advances.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping

from brisk.config import SchedulerConfig
from brisk.core.kv_cache_manager import request_tokens
from brisk.core.kv_manager import KVManager
from brisk.core.outputs import ScheduledRequest, SchedulerOutput
from brisk.core.step_cost import StepCostModel
from brisk.errors import UserError
from brisk.request import FinishReason, Request, RequestStatus

_STATUS_OF = {FinishReason.STOP: RequestStatus.FINISHED_STOPPED, FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
              FinishReason.GRAMMAR: RequestStatus.FINISHED_STOPPED}


class Scheduler:
    """Decides, each step, which requests advance by how many tokens. Ints and lists only."""

    def __init__(self, scheduler_config: SchedulerConfig, kv: KVManager) -> None:
        """`kv`: the KV layout's manager (core/kv_manager.py), built by the engine."""
        self.config = scheduler_config
        self.kv = kv
        self.block_size = kv.block_size
        # The KV cache is a second context limit: a sequence ends (LENGTH) once its next token
        # could not be computed even with the whole cache. This bound is what makes preemption live.
        self.max_seq_len = self._pool_length_limit()
        self.waiting: deque[Request] = deque()  # FCFS; preempted requests re-enter at the front
        self.running: list[Request] = []  # admission order: the last one is the newest
        self._requests: dict[str, Request] = {}  # unfinished requests by id
        self._finished_ids: list[str] = []  # since the last schedule()
        self.num_preemptions = 0
        self.step_cost = StepCostModel()
        self._prompt_cap: int | None = None  # prompt tokens left this step under max_decode_slowdown

    def _pool_length_limit(self) -> int:
        """The longest sequence the whole pool serves alone (its last token's KV is never written)."""
        chunk, lo, hi = self.config.max_num_batched_tokens, 0, self.config.max_model_len
        while lo < hi:  # the most tokens whose blocks fit: blocks_needed grows with the length
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.kv.fits_alone(mid, chunk) else (lo, mid - 1)
        return min(self.config.max_model_len, lo + 1)

    # ----------------------------------------------------------------------------- requests in

    def add_request(self, request: Request) -> None:
        """Queue a request; a prompt that could never be served is a ValueError."""
        n, max_len = request.num_prompt_tokens, self.config.max_model_len
        if n == 0:
            raise UserError(f"request {request.request_id!r}: the prompt is empty; give at least one token")
        if request.request_id in self._requests:
            raise UserError(f"request id {request.request_id!r} is already in use")
        if n + 1 > max_len:
            raise UserError(
                f"prompt has {n} tokens; max_model_len is {max_len}, which leaves no room to generate a "
                f"token; shorten the prompt to at most {max_len - 1} tokens or raise max_model_len")
        if not self.kv.fits_alone(n, self.config.max_num_batched_tokens):
            raise UserError(self.kv.capacity_error(n, self.config.max_num_batched_tokens))
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self.waiting.append(request)

    # ----------------------------------------------------------------------------- schedule

    def schedule(self, drafts_wanted: Mapping[str, int] | None = None) -> SchedulerOutput:
        """Plan one step within `max_num_batched_tokens`; advances num_computed_tokens now.
        `drafts_wanted`: speculative decoding's draft tokens per running request id, which this
        step's decodes make room for where budget and blocks allow (the engine's length
        controller decides them before each step; the scheduler may grant fewer)."""
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        self._prompt_cap = self._prompt_token_cap()
        budget = self._schedule_running(self.config.max_num_batched_tokens, scheduled, preempted)
        # After a preemption the pool is short: admitting would only thrash (and could re-admit
        # the request just preempted).
        if not preempted:
            budget = self._schedule_waiting(budget, scheduled)
            budget = self._schedule_drafts(budget, scheduled, drafts_wanted or {})
        out = SchedulerOutput(scheduled, self.config.max_num_batched_tokens - budget, preempted, self._finished_ids)
        self._finished_ids = []
        return out

    def _schedule_running(self, budget: int, scheduled: list[ScheduledRequest], preempted: list[str]) -> int:
        """Phase 1: every running request in order, preempting the newest when blocks run out."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:  # does not fit the budget unchunked, or has nothing to compute
                i += 1
                continue
            block_ids = self.kv.allocate_slots(request, num_new)
            while block_ids is None:
                victim = self.running.pop()  # the newest; never one already scheduled this step
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
                block_ids = self.kv.allocate_slots(request, num_new)
            if block_ids is None:
                break  # the request preempted itself: it was the last one
            scheduled.append(self._advance(request, num_new, block_ids))
            budget -= num_new
            i += 1
        return budget

    def _schedule_drafts(self, budget: int, scheduled: list[ScheduledRequest], wanted: Mapping[str, int]) -> int:
        """Phase 3: speculative draft slots for this step's decodes, from what the running and
        waiting requests left: drafts are optional, so they never take a token of the budget or a
        KV block that a decode or a prompt could use, and never cause a preemption."""
        for i, item in enumerate(scheduled):
            request = self._requests[item.request_id]
            num_spec = self._num_spec_slots(request, item, budget, wanted.get(item.request_id, 0))
            if num_spec == 0:
                continue
            block_ids = self.kv.allocate_slots(request, num_spec)  # after the decode token's slot
            if block_ids is None:
                continue
            scheduled[i] = dataclasses.replace(item, block_ids=block_ids, num_spec_slots=num_spec)
            budget -= num_spec
        return budget

    def _num_spec_slots(self, request: Request, item: ScheduledRequest, budget: int, wanted: int) -> int:
        """Draft slots for a decode step: what the engine asked for, within the step's budget, the
        request's max_tokens and the context (all drafts accepted plus the bonus token must fit)."""
        if wanted <= 0 or item.num_tokens != 1 or not item.sample:
            return 0
        params = request.sampling_params
        room = min(params.max_tokens - request.num_output_tokens, self.max_seq_len - request.num_tokens) - 1
        return max(0, min(wanted, budget, room))

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        """Phase 2: admit waiting requests first-come first-served while budget and seats last."""
        held_back: list[Request] = []  # n > 1 children waiting for their parent, order kept
        while budget > 0 and len(self.running) < self.config.max_num_seqs and self.waiting:
            request = self.waiting[0]
            if self._waits_for_parent(request):
                held_back.append(self.waiting.popleft())
                continue
            # Prompt logprobs need the logits of every prompt position: no prefix-cache hit for those.
            wants_all_rows = request.sampling_params.prompt_logprobs is not None and request.parent_id is None
            hit_ids, num_hit = ([], 0) if wants_all_rows else self.kv.get_computed_blocks(request)
            num_new = self._num_new_tokens(request.num_tokens - num_hit, budget)
            if num_new <= 0:
                break  # the whole prompt does not fit this step (no chunking): FCFS stops here
            block_ids = self.kv.allocate_slots(request, num_new, hit_ids)
            if block_ids is None:
                break
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            self.running.append(request)
            scheduled.append(self._advance(request, num_new, block_ids))
            budget -= num_new
        self.waiting.extendleft(reversed(held_back))
        return budget

    def _num_new_tokens(self, remaining: int, budget: int) -> int:
        """Tokens to schedule for `remaining` uncomputed ones: clamped to the budget (and prompt
        work to the step's prompt cap) when chunked prefill is on; otherwise all of them or none."""
        if not self.config.enable_chunked_prefill:
            return remaining if remaining <= budget else 0
        if remaining > 1 and self._prompt_cap is not None:
            budget = min(budget, self._prompt_cap)
        return min(remaining, budget)

    def _prompt_token_cap(self) -> int | None:
        """Under max_decode_slowdown: prompt tokens this step may carry beside the running decodes."""
        slowdown = self.config.max_decode_slowdown
        decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        if slowdown is None or decodes == 0:
            return None
        return self.step_cost.prompt_token_cap(decodes, slowdown, floor=self.block_size)

    def observe_step(self, sched_out: SchedulerOutput, seconds: float) -> None:
        """The engine reports how long the step took: the cost model behind max_decode_slowdown."""
        decodes = sum(1 for s in sched_out.scheduled if len(s.token_ids) == 1)
        prompt_tokens = sum(len(s.token_ids) for s in sched_out.scheduled if len(s.token_ids) > 1)
        self.step_cost.observe(decodes, prompt_tokens, seconds)

    def _waits_for_parent(self, request: Request) -> bool:
        # n > 1 siblings start once the parent's whole prompt is scheduled, so they hit its blocks.
        parent = self._requests.get(request.parent_id) if request.parent_id is not None else None
        return parent is not None and parent.num_computed_tokens < parent.num_prompt_tokens

    def _advance(self, request: Request, num_new: int, block_ids: list[list[int]]) -> ScheduledRequest:
        start = request.num_computed_tokens
        request.num_computed_tokens = start + num_new  # advanced at schedule time, as in vLLM v1
        if self._prompt_cap is not None and num_new > 1:
            self._prompt_cap -= num_new
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request_tokens(request, start, start + num_new),
            start_pos=start,
            block_ids=block_ids,
            sample=start + num_new == request.num_tokens,
        )

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: forget the KV, go to the front of the queue."""
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ----------------------------------------------------------------------------- results in

    def update_from_output(self, sched_out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Append the runner's sampled tokens and apply stop checks.

        Returns the requests that got new tokens (finished ones included, status set). Requests
        finished or aborted between schedule() and now are skipped.
        """
        updated: list[Request] = []
        finished: set[str] = set()
        for item in sched_out.scheduled:
            tokens = sampled.get(item.request_id)
            request = self._requests.get(item.request_id)
            if not tokens or request is None:
                continue
            assert item.sample, f"runner sampled for {item.request_id!r}, a mid-prompt chunk"
            assert len(tokens) <= 1 + item.num_spec_slots, f"{len(tokens)} tokens for {item.request_id!r}"
            for token in tokens:
                request.output_token_ids.append(token)
                reason = self._stop_reason(request, token)
                if reason is not None:
                    self._finish(request, reason, _STATUS_OF[reason])
                    finished.add(request.request_id)
                    break
            else:
                # Accepted drafts had their KV written this step; the last token never has (it is
                # the next step's input). Rejected drafts' slots get overwritten, never read.
                request.num_computed_tokens = request.num_tokens - 1
            updated.append(request)
        if finished:
            self.running = [r for r in self.running if r.request_id not in finished]
        return updated

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        """Why the request ends after `token`, or None. Stop strings are the engine's job."""
        params = request.sampling_params
        # min_tokens: at least that many outputs come before an EOS / stop token may end it.
        may_stop = request.num_output_tokens > params.min_tokens
        if may_stop and ((token in request.eos_token_ids and not params.ignore_eos)
                         or token in params.stop_token_ids):
            return FinishReason.STOP
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_seq_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason | None, status: RequestStatus) -> None:
        """Mark finished and free the blocks (cached full ones stay reusable). The caller unlinks
        the request from `running` / `waiting`."""
        request.status = status
        request.finish_reason = reason
        self.kv.free(request)
        del self._requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def abort_step(self, sched_out: SchedulerOutput) -> list[str]:
        """Undo a step whose forward pass failed: abort its requests and withdraw every block it
        touched from the prefix cache, since blocks published at schedule time hold no valid KV."""
        aborted = [s.request_id for s in sched_out.scheduled if self.abort_request(s.request_id)]
        self.kv.uncache({b for s in sched_out.scheduled for table in s.block_ids for b in table})
        return aborted

    def finish_request(self, request_id: str, reason: FinishReason) -> bool:
        """End a waiting or running request (e.g. the engine saw a stop string). False if unknown."""
        return self._end(request_id, reason, _STATUS_OF[reason])

    def abort_request(self, request_id: str) -> bool:
        """Drop a waiting or running request (client went away). False if unknown."""
        return self._end(request_id, None, RequestStatus.FINISHED_ABORTED)

    def _end(self, request_id: str, reason: FinishReason | None, status: RequestStatus) -> bool:
        request = self._requests.get(request_id)
        if request is None:
            return False
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, reason, status)
        return True

    # ----------------------------------------------------------------------------- queries

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request by id (finished ones are forgotten)."""
        return self._requests.get(request_id)

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

    @property
    def prefix_hit_rate(self) -> float:
        return self.kv.hit_rate

    def check_invariants(self) -> None:
        """Assert queue/state consistency, then the KV bookkeeping (tests: after every step)."""
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        assert len(set(running_ids)) == len(running_ids), "a request is running twice"
        assert not set(running_ids) & set(waiting_ids), "a request is both running and waiting"
        assert set(running_ids) | set(waiting_ids) == set(self._requests), "lost or leaked request"
        assert len(self.running) <= self.config.max_num_seqs
        for r in self.running:
            assert r.status == RequestStatus.RUNNING, f"{r.request_id} running with status {r.status}"
            assert 0 < r.num_computed_tokens <= r.num_tokens < self.max_seq_len
            assert len(self.kv.get_block_ids(r.request_id)[0]) * self.block_size >= r.num_computed_tokens
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), f"{r.request_id}: {r.status}"
            assert r.num_computed_tokens == 0
        self.kv.check_invariants(running_ids)
