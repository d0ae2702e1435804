"""Rank 0 bootstraps a parallel engine: check, start or join the other ranks, build its share,
size the KV cache, and hand back the runner."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from brisk.config import CacheConfig
from brisk.engine.workers.args import WorkerArgs, torchrun_rank
from brisk.engine.workers.checks import check_parallel
from brisk.engine.workers.processes import WorkerSet, threads_per_rank
from brisk.engine.workers.rank import build_rank
from brisk.errors import UserError
from brisk.loader.load import LoadedModel
from brisk.parallel.groups import ParallelFailure, init_distributed, local_store, shutdown_distributed, wait_for_workers
from brisk.runtime.paged_runner import kv_block_bytes
from brisk.runtime.parallel_runner import ParallelRunner, StageRunner


@dataclass
class Cluster:
    """Rank 0's handle on a running parallel engine."""

    loaded: LoadedModel
    runner: ParallelRunner
    workers: WorkerSet | None  # None under torchrun, which watches its own processes
    threads: int  # rank 0's torch threads before it took its share of the cores (restored on close)

    def close(self) -> None:
        try:
            self.runner.close()
        finally:
            try:
                if self.workers is not None:
                    self.workers.stop()
            finally:
                shutdown_distributed()
                torch.set_num_threads(self.threads)


def start_cluster(args: WorkerArgs, cache: CacheConfig) -> Cluster:
    """Rank 0: check, spawn the workers (or join torchrun's), build its share, size the KV cache."""
    from brisk.engine.llm_engine import num_kv_blocks

    check_parallel(args)
    pcfg = args.parallel
    workers: WorkerSet | None = None
    init: str | torch.distributed.Store
    rank = torchrun_rank()
    if rank is not None:
        if int(os.environ["WORLD_SIZE"]) != pcfg.world_size or rank != 0:
            raise UserError(f"torchrun started {os.environ['WORLD_SIZE']} processes; tensor x pipeline parallel "
                             f"size is {pcfg.world_size}: they must match (and only rank 0 builds the LLM)")
        init = "env://"
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", pcfg.world_size))
    else:
        # the store listens first, on a port the OS picked: no window in which another process takes it
        init = local_store(0, pcfg.world_size)
        workers = WorkerSet(args, init.port)
        local_world = pcfg.world_size
    threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_rank(local_world))
    describe = workers.describe if workers is not None else \
        (lambda e: f"parallel engine stopped: a worker failed or hung ({e})")
    stop = (lambda: workers.stop(grace_s=0.0)) if workers is not None else (lambda: None)
    try:
        if workers is not None:
            assert isinstance(init, torch.distributed.TCPStore)
            wait_for_workers(init, pcfg.world_size, workers.alive)
        state = init_distributed(pcfg, 0, args.device, init)
        loaded, layers = build_rank(args, state)
        # the fullest rank (most layers or KV heads) sets the count: kv_cache_memory_gib is per process
        block_bytes = max(state.gather_objects(kv_block_bytes(loaded.model, args.block_size)))
        blocks = num_kv_blocks(cache, block_bytes)
        state.broadcast_object(blocks)
        stage = StageRunner(loaded.model, state, layers, blocks, args.block_size, args.pack_weights,
                            eager=args.enforce_eager)
    except (RuntimeError, OSError) as e:  # a worker failed while starting: say which and how
        message = describe(e)
        stop()
        shutdown_distributed()
        torch.set_num_threads(threads)
        raise ParallelFailure(message) from e
    except BaseException:
        stop()
        shutdown_distributed()
        torch.set_num_threads(threads)
        raise
    poll = workers.poll if workers is not None else (lambda: None)
    return Cluster(loaded, ParallelRunner(stage, describe, stop, poll), workers, threads)
