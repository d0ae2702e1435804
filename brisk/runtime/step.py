"""One engine step in the runtime: a forward, then the one place where its logits become tokens.

    StepBatch (scheduled requests, their drafts, their sampling state)
        └─► runner.execute (logits of the rows that sample) ─► sample() / verify() ─► RunnerOutput

A runner's `execute_model(batch)` returns the sampled ids (with drafts: the accepted ones and the
next), their logprobs and the prompt logprobs the step computed; the engine appends them through
the scheduler and detokenizes. Sampling (sample/) and verification (speculative/verify.py) run
here for every runner alike (this process's or rank 0 of a parallel one).

A row whose own parameters break the batch fails alone: the batch is sampled again one row at a
time, the failing rows land in `RunnerOutput.failed` and every other row keeps its tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from brisk.core.kv_groups import KVGroup
from brisk.core.outputs import ScheduledRequest
from brisk.model.base import CausalLM
from brisk.request import Request
from brisk.sample.logprobs import TokenLogprobs, prompt_logprobs
from brisk.sample.sampler import SamplingBatch, sample
from brisk.sample.structured import Constraint
from brisk.speculative.base import Draft
from brisk.speculative.verify import VerifyOutput, verify

if TYPE_CHECKING:  # the runners import this module for execute_model
    from brisk.runtime.paged_runner import StepLogits

_T = TypeVar("_T")


class SeqState(Protocol):
    """What turns one sequence's logits into its tokens (the engine's per-sequence record)."""

    request: Request
    generator: torch.Generator | None
    constraint: Constraint | None  # structured outputs: the grammar state, None when free


@dataclass
class StepBatch:
    """One step as a runner takes it: the scheduled requests (drafts already appended to their
    token lists), each sequence's sampling state, the drafts to verify and the sequences whose
    prompt logprobs this step computes (every row of theirs is projected)."""

    steps: list[ScheduledRequest]
    seqs: Mapping[str, SeqState]
    drafts: dict[str, Draft] = field(default_factory=dict)
    prompt_rows: frozenset[str] = frozenset()
    # called once the forward is done or failed, before any row is sampled: the engine's mask
    # thread hands the grammar matchers back (an error it raised surfaces here)
    after_forward: Callable[[], None] | None = None

    @property
    def all_rows(self) -> frozenset[str]:
        """Sequences whose every computed row gets logits: prompt logprobs and verification."""
        return self.prompt_rows | frozenset(self.drafts)


@dataclass
class RunnerOutput:
    """What a step produced: each sampling sequence's new tokens and what was recorded with them."""

    token_ids: dict[str, list[int]] = field(default_factory=dict)  # sampled; with drafts: accepted + next
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # per new token, when asked
    prompt_logprobs: dict[str, dict[int, TokenLogprobs]] = field(default_factory=dict)  # position -> its logprob
    num_accepted: dict[str, int] = field(default_factory=dict)  # drafts kept, per drafted sequence
    failed: dict[str, Exception] = field(default_factory=dict)  # rows whose own sampling raised
    forward_seconds: float = 0.0  # the forward alone, without sampling (draft-length control reads it)
    logits: StepLogits | None = None  # the rows sampled from, with their hidden states (proposers observe)


class Runner(Protocol):
    """The runner protocol the engine speaks: this process's `PagedModelRunner` or rank 0's
    `ParallelRunner` over worker processes."""

    model: CausalLM
    device: torch.device
    block_size: int
    num_blocks: int
    groups: tuple[KVGroup, ...]  # the scheduler's KV groups: one block table each

    def execute_model(self, batch: StepBatch) -> RunnerOutput:
        """One engine step: the forward, then each sampling sequence's new tokens."""
        ...

    def execute(self, steps: Sequence[ScheduledRequest], all_rows_for: frozenset[str] = frozenset()) -> StepLogits:
        """The forward alone: logits of each sampled row, and every row of `all_rows_for`."""
        ...

    def check(self) -> None:
        """Raise if no step can run any more (a parallel worker has ended); cheap, for idle loops."""
        ...

    def info(self) -> dict[str, float]:
        """Figures for the engine's stats (a parallel runner's communication counts)."""
        ...


def run_step(runner: Runner, batch: StepBatch) -> RunnerOutput:
    """The forward over `batch.steps`, then sampling and verification: a runner's `execute_model`."""
    started = time.perf_counter()
    try:
        logits = runner.execute(batch.steps, batch.all_rows)
    finally:
        if batch.after_forward is not None:
            batch.after_forward()
    out = RunnerOutput(forward_seconds=time.perf_counter() - started, logits=logits)
    sample_step(logits, batch, out)
    return out


def sample_step(logits: StepLogits, batch: StepBatch, out: RunnerOutput) -> None:
    """Turn a forward's logits into `out`: prompt logprobs, sampled rows, verified drafts."""
    for step in batch.steps:
        if step.request_id in batch.prompt_rows:
            _prompt_logprobs(batch.seqs[step.request_id].request, step.start_pos, logits.of(step.request_id), out)
    plain = [rid for rid in logits.sample_ids if rid not in batch.drafts]
    if plain:
        for sid, (tok, lp) in _isolating(lambda ids: _sample(logits, ids, batch.seqs), plain, out).items():
            out.token_ids[sid] = [tok]
            if lp is not None:
                out.logprobs[sid] = [lp]
    if batch.drafts:
        verified = _isolating(lambda ids: _verify(logits, ids, batch), list(batch.drafts), out)
        for sid, res in verified.items():
            out.token_ids[sid] = res.token_ids
            out.num_accepted[sid] = res.num_accepted
            if res.logprobs is not None:
                out.logprobs[sid] = res.logprobs


def _sample(logits: StepLogits, seq_ids: list[str], seqs: Mapping[str, SeqState]
            ) -> dict[str, tuple[int, TokenLogprobs | None]]:
    result = sample(logits.last_rows(seq_ids), sampling_batch([seqs[sid] for sid in seq_ids]))
    return dict(zip(seq_ids, zip(result.token_ids, result.logprobs)))


def _verify(logits: StepLogits, seq_ids: list[str], batch: StepBatch) -> dict[str, VerifyOutput]:
    seqs = [batch.seqs[sid] for sid in seq_ids]
    results = verify([logits.of(sid) for sid in seq_ids], [s.request for s in seqs],
                     [batch.drafts[sid] for sid in seq_ids], [s.generator for s in seqs], [s.constraint for s in seqs])
    return dict(zip(seq_ids, results))


def sampling_batch(seqs: list[SeqState]) -> SamplingBatch:
    """The sampler's per-row state of `seqs` (history only where a penalty reads it)."""
    banned = [s.request.banned_token_ids() for s in seqs]
    penalties = any(s.request.sampling_params.uses_history for s in seqs)
    return SamplingBatch(
        params=[s.request.sampling_params for s in seqs],
        generators=[s.generator for s in seqs],
        output_token_ids=[s.request.output_token_ids for s in seqs] if penalties else [],
        prompt_token_ids=[s.request.prompt_token_ids for s in seqs] if penalties else [],
        banned_token_ids=banned if any(banned) else [],
        constraints=[s.constraint for s in seqs] if any(s.constraint for s in seqs) else [],
    )


def _prompt_logprobs(request: Request, start: int, rows: torch.Tensor, out: RunnerOutput) -> None:
    """Rows of positions start.. predict prompt tokens start+1..; keep those inside the prompt."""
    prompt = request.prompt_token_ids
    count = min(rows.shape[0], len(prompt) - 1 - start)
    if count <= 0:
        return
    n = request.sampling_params.prompt_logprobs or 0
    kept = out.prompt_logprobs.setdefault(request.request_id, {})
    for offset, lp in enumerate(prompt_logprobs(rows[:count], prompt[start + 1:start + 1 + count], n)):
        kept[start + 1 + offset] = lp


def _isolating(run: Callable[[list[str]], dict[str, _T]], seq_ids: list[str], out: RunnerOutput) -> dict[str, _T]:
    """`run` over the step's rows at once; if it raises, over one row at a time, so a request whose
    parameters break the batch fails alone (kept in `out.failed`, ended by the engine after the
    step) and its neighbours keep their tokens. Each row depends only on its own logits and
    generator, so a greedy row gets exactly what the batch would have given it, and so does a
    sampled one when the batch failed before drawing (the sampler builds every tensor first); a
    verifier that failed part-way may have drawn for earlier rows, which then draw again: still
    exact samples, though a seeded row's can differ from an unfailed step's."""
    try:
        return run(seq_ids)
    except Exception as e:  # the culprit is found below; a fatal error is not retried
        if getattr(e, "fatal", False):
            raise
    results: dict[str, _T] = {}
    for sid in seq_ids:
        try:
            results.update(run([sid]))
        except Exception as e:  # this row's own failure, reported to its request only
            if getattr(e, "fatal", False):
                raise
            out.failed[sid] = e
    return results
