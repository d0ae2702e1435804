"""This process's place in a tensor x pipeline grid, and every collective brisk runs through it.

    global rank = pipeline stage * T + tensor rank          T = tensor_parallel_size

    stage 0:  rank 0 (driver: scheduler, sampler)  rank 1  ...  rank T-1      embedding, layers 0..a, LM head
    stage 1:  rank T                               ...          rank 2T-1    layers a..b
    ...                                                                        last stage: final norm

Data (all-reduces inside a stage, activations between stages, logits to rank 0) go over the
default backend (gloo on CPU, NCCL on CUDA) with `timeout_s`: a worker that stops answering in a
step is called hung after that long. Step messages from rank 0 go over a gloo group on which only
rank 0 has that timeout, so an idle server's workers wait for work as long as it takes. Every byte that
enters a collective is counted in `stats` (bytes communicated per token, see bench).
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from brisk.config import ParallelConfig

# Waiting for the next step message: an idle server may get no request for days.
_CONTROL_TIMEOUT = datetime.timedelta(days=365)
# Spawned workers import torch and brisk before they join: seconds on a quiet machine, much longer on
# a loaded one. Rank 0 waits that long while they live (a worker that dies is reported at once).
JOIN_TIMEOUT_S = 600.0


class ParallelFailure(RuntimeError):
    """A worker died, hung or failed: the parallel engine cannot go on and stops."""

    fatal = True  # the async engine ends instead of retrying steps


@dataclass
class CommStats:
    """Bytes handed to collectives by this process (payload, not wire bytes: a ring all-reduce
    moves about 2 (T-1)/T times its payload)."""

    all_reduce: int = 0
    p2p: int = 0
    gather: int = 0
    control: int = 0
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        setattr(self, kind, getattr(self, kind) + nbytes)
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return {"all_reduce_bytes": self.all_reduce, "p2p_bytes": self.p2p, "gather_bytes": self.gather,
                "control_bytes": self.control, "calls": dict(self.counts)}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ParallelState:
    """Ranks, groups and counted collectives of one process in a T x P grid."""

    def __init__(self, cfg: ParallelConfig, rank: int, device: torch.device) -> None:
        self.config = cfg
        self.rank = rank
        self.world_size = cfg.world_size
        self.tp_size, self.pp_size = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
        self.tp_rank, self.pp_rank = rank % self.tp_size, rank // self.tp_size
        self.device = device
        self.stats = CommStats()
        # Every rank must create every group, in the same order (torch.distributed's rule).
        data_timeout = datetime.timedelta(seconds=cfg.timeout_s)
        self.tp_group: Any = None
        for stage in range(self.pp_size):
            group = dist.new_group(self.stage_ranks(stage), timeout=data_timeout) if self.tp_size > 1 else None
            if stage == self.pp_rank:
                self.tp_group = group
        # The last stage's rows go back to the first stage on a group of their own: NCCL runs all
        # point-to-point traffic of a rank pair on one stream, where sends both ways between the same
        # two ranks (activations forward, rows back, with two stages) could wait on each other.
        self.back_group: Any = None
        if self.pp_size > 1:
            for t in range(self.tp_size):
                pair = [t, (self.pp_size - 1) * self.tp_size + t]
                group = dist.new_group(pair, timeout=data_timeout)
                if rank in pair:
                    self.back_group = group
        # Timeouts are each process's own: rank 0 gives up on a silent worker after timeout_s, while
        # the workers wait for rank 0's next step as long as it takes.
        self.control = dist.new_group(backend="gloo", timeout=data_timeout if rank == 0 else _CONTROL_TIMEOUT)

    # ------------------------------------------------------------------ layout
    def stage_ranks(self, stage: int) -> list[int]:
        return [stage * self.tp_size + t for t in range(self.tp_size)]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_stage_leader(self) -> bool:
        """Tensor rank 0 of its stage: gathers the stage's vocabulary shards of the logits."""
        return self.tp_rank == 0

    def peer(self, stage: int) -> int:
        """The rank of `stage` with this rank's tensor rank (activations go rank to rank)."""
        return stage * self.tp_size + self.tp_rank

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the stage's tensor ranks, added in rank order so every rank holds the very same
        bits. On CPU, gloo's ring all-reduce costs 1.4 ms for a 2 KB decode row on this 2-core
        machine, gathering the parts costs 0.5 ms and a direct exchange between two ranks 0.35 ms
        (it is latency, not bandwidth): gather and add here; NCCL keeps its all-reduce."""
        if self.tp_size == 1:
            return t
        self.stats.add("all_reduce", _nbytes(t))
        if self.device.type != "cpu":
            dist.all_reduce(t, group=self.tp_group)
            return t
        t = t.contiguous()
        parts = self._exchange(t) if self.tp_size == 2 else self._gather_all(t)
        out = parts[0]
        for part in parts[1:]:
            out = out + part
        return out

    def _gather_all(self, t: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(self.tp_size)]
        dist.all_gather(parts, t, group=self.tp_group)
        return parts

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Two ranks: send mine, receive the other's; [rank 0's, rank 1's]."""
        other = self.stage_ranks(self.pp_rank)[1 - self.tp_rank]
        theirs = torch.empty_like(t)
        handle = dist.isend(t, other)
        dist.recv(theirs, other)
        handle.wait()
        return [t, theirs] if self.tp_rank == 0 else [theirs, t]

    def gather_columns(self, t: torch.Tensor) -> torch.Tensor | None:
        """Every tensor rank's [rows, cols] side by side on the stage leader: [rows, T * cols];
        None on the other ranks."""
        if self.tp_size == 1:
            return t
        self.stats.add("gather", _nbytes(t))
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.tp_size)] if self.is_stage_leader else None
        dist.gather(t, parts, dst=self.stage_ranks(self.pp_rank)[0], group=self.tp_group)
        return torch.cat(parts, dim=1) if parts is not None else None

    def isend(self, t: torch.Tensor, dst: int) -> Any:
        self.stats.add("p2p", _nbytes(t))
        return dist.isend(t.contiguous(), dst)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, back: bool = False) -> torch.Tensor:
        """`back`: on the last-stage-to-first-stage group (see back_group)."""
        t = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(t, src, group=self.back_group if back else None)
        return t

    def isend_back(self, t: torch.Tensor) -> Any:
        """Last stage -> its tensor rank's peer on the first stage."""
        self.stats.add("p2p", _nbytes(t))
        return dist.isend(t.contiguous(), self.peer(0), group=self.back_group)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (step messages, set-up values)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        if self.rank == 0:
            self.stats.add("control", len(repr(obj)))  # a cheap size estimate; pickles are similar
        return box[0]


    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj` on rank 0, by rank ([] elsewhere)."""
        out: list[Any] = [None] * self.world_size if self.rank == 0 else []
        dist.gather_object(obj, out if self.rank == 0 else None, dst=0, group=self.control)
        return out


def local_store(rank: int, world_size: int, port: int = 0) -> dist.TCPStore:
    """The rendezvous of rank 0 and the workers it spawned on this machine. Rank 0 serves it
    (`port` 0: any free one, read back from `.port`; give it to the workers) and later waits in
    `wait_for_workers`; a worker connects and says it is there."""
    timeout = datetime.timedelta(seconds=JOIN_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    if rank > 0:
        store.set(f"brisk/joined/{rank}", "1")
    return store


def wait_for_workers(store: dist.TCPStore, world_size: int, alive: Callable[[], bool]) -> None:
    """Rank 0: until every worker has joined, JOIN_TIMEOUT_S at most, checking `alive()` meanwhile
    (a step's timeout_s is no measure of how long a process takes to start)."""
    keys = [f"brisk/joined/{r}" for r in range(1, world_size)]
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not store.check(keys):
        if not alive():
            raise RuntimeError("a worker process ended before it joined")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the workers did not join within {JOIN_TIMEOUT_S:g} s")
        time.sleep(0.02)


def init_distributed(cfg: ParallelConfig, rank: int, device: str, init: str | dist.Store) -> ParallelState:
    """Join the process group (`init`: a store from `local_store`, or env:// under torchrun) and
    build the tensor and pipeline groups."""
    dev = torch.device(device)
    if dev.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl":
        # NCCL ops only make the stream wait; blocking waits turn a dead or hung peer into an error
        # (a ParallelFailure) after timeout_s instead of an abort by the NCCL watchdog.
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    try:
        if isinstance(init, str):
            dist.init_process_group(backend, init_method=init, rank=rank, world_size=cfg.world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, store=init, rank=rank, world_size=cfg.world_size, timeout=timeout)
    except BaseException:
        _forget_failed_init()
        raise
    return ParallelState(cfg, rank, dev)


def _forget_failed_init() -> None:
    """torch names the default group from a counter it bumps before joining and resets only in
    destroy_process_group: after a failed join this process would call its next group "1" while
    fresh workers say "0", and each side would wait for the other forever."""
    world = getattr(dist.distributed_c10d, "_world", None)  # private: a later torch may differ
    if not dist.is_initialized() and hasattr(world, "group_count"):
        world.group_count = 0


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _forget_failed_init()
