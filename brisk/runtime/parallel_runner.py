"""One engine step over a tensor x pipeline grid of processes.

    rank 0 (driver)                                   every other rank (worker)
    ───────────────                                   ─────────────────────────
    scheduler ─► ParallelRunner.execute(steps)
                   broadcast the step (plain ints) ──► serve_steps: receive it
                   StageRunner.run (its share) ◄────► StageRunner.run (its share)
                   LM head on the rows ◄───────────── last stage: their final hidden states
    sampler ◄──────┘

The scheduler runs once, on rank 0; each rank rebuilds the step's tensors from the same plain
message (`PagedModelRunner.prepare`), runs its layers on its shard, and only rank 0 gets logits.
Any failure of a collective (a worker died: its sockets close at once; or it hung past the
timeout) becomes a `ParallelFailure` that says which worker and how, and the runner refuses
further steps: the engine ends its requests instead of hanging.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from brisk.model.base import CausalLM
from brisk.parallel.groups import ParallelFailure, ParallelState
from brisk.parallel.pipeline import split_micro_batches
from brisk.runtime.model_runner import sdpa_context
from brisk.core.outputs import ScheduledRequest
from brisk.runtime.paged_runner import PagedModelRunner, StepInputs, StepLogits, pick_rows
from brisk.runtime.step import RunnerOutput, StepBatch, run_step

# Fewest tokens a pipeline micro-batch is cut to by default (see StageRunner.micro_batch_count).
MIN_MICRO_BATCH_TOKENS = 64


@dataclass
class _Part:
    """Rank 0's view of one micro-batch: which rows came back for which request."""

    sample_ids: list[str]
    rows: dict[str, tuple[int, int]]
    num_rows: int
    logits: torch.Tensor | None = None  # [num_rows, vocab]
    hidden: torch.Tensor | None = None  # [num_rows, hidden], when rank 0 also ran the last layers


class StageRunner:
    """This rank's share of a step: its layers, its shard of their weights, its KV."""

    def __init__(self, model: CausalLM, state: ParallelState, layers: range, num_blocks: int,
                 block_size: int, pack_weights: bool = True, eager: bool = False) -> None:
        # no CUDA graphs: a tensor-parallel step's collectives would have to be captured with it
        self.local = PagedModelRunner(model, num_blocks, block_size, pack_weights, graphs=False, eager=eager)
        self.model = model
        self.state = state
        self.layers = layers
        self.micro_batches = state.config.micro_batches  # None: micro_batch_count decides per step

    def micro_batch_count(self, num_tokens: int) -> int:
        """Pieces to cut a step of `num_tokens` into. Every piece reads the stage's weights again,
        so pieces are only worth it where compute, not weight reads, bounds a step: at least
        MIN_MICRO_BATCH_TOKENS each (on this CPU a decode batch of 8 runs 0.51x one process whole
        and 0.43x in two pieces; prompt chunks gain from the overlap)."""
        if self.state.pp_size == 1:
            return 1
        if self.micro_batches is not None:
            return self.micro_batches
        return max(1, min(self.state.pp_size, num_tokens // MIN_MICRO_BATCH_TOKENS))

    @torch.inference_mode()
    def run(self, steps: Sequence[ScheduledRequest], all_rows_for: frozenset[str]) -> StepLogits | None:
        """Run this rank's part of the step; rank 0 returns the logits, the others None.

        The LM head lives with the embedding on the first stage (tied models share the table): the
        last stage sends back only the final hidden state of the rows to project, [rows, hidden],
        not [rows, vocab] logits (2.3 KB instead of 197 KB a row for SmolLM2)."""
        sizes = [len(s.token_ids) for s in steps]
        parts = split_micro_batches(steps, sizes, self.micro_batch_count(sum(sizes)))
        state = self.state
        pending: list[Any] = []  # sends in flight (their tensors must live until waited on)
        mine: list[_Part] = []
        for part in parts:
            inputs = self.local.prepare(part, all_rows_for)
            index, rows = inputs.logit_rows()
            mine.append(_Part(inputs.sample_ids, rows, len(index)))
            h, residual = self._layers(inputs)
            if not state.is_last_stage:
                pending.append(state.isend(torch.stack([h, residual]), state.peer(state.pp_rank + 1)))
            elif index:
                picked = self._picked(h, residual, index)
                if state.is_first_stage:
                    mine[-1].hidden, mine[-1].logits = picked, self._logits(picked)
                else:
                    pending.append(state.isend_back(picked))
        if state.is_first_stage and not state.is_last_stage:  # the head, as the last stage's rows come back
            hidden = self.model.config.hidden_size
            for p in mine:
                if p.num_rows:
                    picked = state.recv((p.num_rows, hidden), self.model.dtype, state.peer(state.pp_size - 1),
                                        back=True)
                    p.logits = self._logits(picked)
        for handle in pending:
            handle.wait()
        return _assemble(mine, self.model) if state.rank == 0 else None

    def _layers(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Embed (first stage) or receive (h, residual) from the stage before; run this stage's layers."""
        state, model = self.state, self.model
        n = inputs.input_ids.shape[0]
        residual: torch.Tensor | None = None
        if state.is_first_stage:
            h = model.embed(inputs.input_ids)  # [n, hidden]
        else:
            both = state.recv((2, n, model.config.hidden_size), model.dtype, state.peer(state.pp_rank - 1))
            h, residual = both[0], both[1]
        with sdpa_context(self.local.device):
            h, residual = self.local.plans.run_layers(h, residual, inputs.positions, inputs.attn,
                                                      self.layers.start, self.layers.stop)
        assert residual is not None, "every stage runs at least one layer"
        return h, residual

    def _picked(self, h: torch.Tensor, residual: torch.Tensor, index: list[int]) -> torch.Tensor:
        """The final-normed hidden state of the rows to project: [len(index), hidden]."""
        return pick_rows(self.model.final_norm(h, residual), index)

    def _logits(self, picked: torch.Tensor) -> torch.Tensor | None:
        """The vocabulary shards of the LM head, gathered on the stage leader: [rows, vocab]
        there, None on the other tensor ranks."""
        full = self.state.gather_columns(self.model.compute_logits(picked))  # [rows, vocab (padded)]
        return None if full is None else full[:, :self.model.config.vocab_size].contiguous()


def _assemble(parts: list[_Part], model: CausalLM) -> StepLogits:
    """One StepLogits from the micro-batches' pieces, rows renumbered in part order."""
    rows: dict[str, tuple[int, int]] = {}
    sample_ids: list[str] = []
    offset = 0
    for p in parts:
        rows.update({rid: (first + offset, n) for rid, (first, n) in p.rows.items()})
        sample_ids.extend(p.sample_ids)
        offset += p.num_rows
    full = [p.logits for p in parts if p.logits is not None]
    cfg = model.config
    logits = torch.cat(full) if full else torch.empty((0, cfg.vocab_size), device=model.device)
    hidden = [p.hidden for p in parts if p.hidden is not None]
    # Hidden states stay on the last stage under pipeline parallelism; rank 0 has none to give.
    picked = torch.cat(hidden) if len(hidden) == len(full) and full else logits.new_empty((logits.shape[0], 0))
    return StepLogits(logits, rows, sample_ids, picked)


class ParallelRunner:
    """Rank 0's runner, with PagedModelRunner's interface: tells the workers each step, runs its own
    share, returns the logits. `describe_failure` turns a collective's error into a sentence about
    the worker behind it (the launcher knows the processes)."""

    def __init__(self, stage: StageRunner, describe_failure: Callable[[BaseException], str],
                 stop_workers: Callable[[], None], poll_workers: Callable[[], str | None]) -> None:
        self.stage = stage
        self.model = stage.model
        self.device = stage.local.device
        self.num_blocks = stage.local.num_blocks
        self.block_size = stage.local.block_size
        self.groups = stage.local.groups
        self.packed_weight_bytes = stage.local.packed_weight_bytes
        self.state = stage.state
        self._describe = describe_failure
        self._stop_workers = stop_workers
        self._poll_workers = poll_workers
        self.failure: str | None = None

    def check(self) -> None:
        """Between steps (an idle server): raise ParallelFailure if a worker has ended, so the
        engine stops and /health says so before any request finds out."""
        if self.failure is None:
            self.failure = self._poll_workers()
        if self.failure is not None:
            raise ParallelFailure(self.failure)

    def execute_model(self, batch: StepBatch) -> RunnerOutput:
        """One engine step on every rank; rank 0 samples (runtime/step.py)."""
        return run_step(self, batch)

    def execute(self, steps: Sequence[ScheduledRequest], all_rows_for: frozenset[str] = frozenset()) -> StepLogits:
        if self.failure is not None:
            raise ParallelFailure(self.failure)
        # plain copies travel to the workers (draft slots are the engine's business, not theirs)
        plain = [ScheduledRequest(s.request_id, list(s.token_ids), s.start_pos, [list(t) for t in s.block_ids], s.sample)
                 for s in steps]
        try:
            self.state.broadcast_object(("step", plain, all_rows_for))
            out = self.stage.run(plain, all_rows_for)
        except (RuntimeError, OSError) as e:
            self.failure = self._describe(e)
            raise ParallelFailure(self.failure) from e
        except BaseException as e:
            # Interrupted mid-step (Ctrl-C, a bug on this side): the workers are somewhere inside the
            # step and cannot be brought back in line, so they stop and so does the engine.
            self.failure = f"parallel engine stopped: a step was interrupted on rank 0 ({type(e).__name__})"
            self._stop_workers()
            raise
        assert out is not None
        return out

    def info(self) -> dict[str, float]:
        """Engine stats: the grid and the bytes rank 0 has handed to collectives (no collective run)."""
        st = self.state.stats
        return {"tensor_parallel_size": self.state.tp_size, "pipeline_parallel_size": self.state.pp_size,
                "parallel_rank0_comm_bytes": st.all_reduce + st.p2p + st.gather + st.control}

    def comm_stats(self) -> list[dict[str, Any]]:
        """Every rank's CommStats, by rank: what a parallel step costs in bytes."""
        if self.failure is not None:
            raise ParallelFailure(self.failure)
        self.state.broadcast_object(("stats",))
        return self.state.gather_objects(self.state.stats.as_dict())

    def close(self) -> None:
        """Tell the workers to leave their loop (nothing to tell after a failure)."""
        if self.failure is None:
            with contextlib.suppress(Exception):  # a worker already gone: the launcher reaps it
                self.state.broadcast_object(("stop",))
        self.failure = self.failure or "the parallel engine was closed"


def serve_steps(stage: StageRunner) -> None:
    """A worker's life: run every step rank 0 broadcasts until it says stop."""
    while True:
        msg = stage.state.broadcast_object()
        if msg[0] == "stop":
            return
        if msg[0] == "stats":
            stage.state.gather_objects(stage.state.stats.as_dict())
            continue
        _, steps, all_rows_for = msg
        stage.run(steps, all_rows_for)
