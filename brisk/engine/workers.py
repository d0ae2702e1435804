"""Start, feed and watch the processes of a tensor x pipeline parallel engine.

One node: `LLM(..., tensor_parallel_size=T, pipeline_parallel_size=P)` spawns ranks 1..T*P-1 as
`python -m brisk.engine.workers '<json>'` and becomes rank 0 itself. Many nodes: torchrun starts
every rank with the same brisk command (RANK, WORLD_SIZE, MASTER_ADDR, ... in the environment);
rank 0 runs the engine and the server, the others `run_worker` (see cli.py and README).

Every rank builds its own model the same way (`build_rank`): load the float weights, keep its
tensor shard, quantize the shard if asked, drop the other stages' layers. Rank 0 sizes the KV cache
and broadcasts the block count, so every rank's blocks line up with the one scheduler's ids.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from brisk.config import CacheConfig, ModelConfig, ParallelConfig, QuantConfig
from brisk.errors import UserError
from brisk.loader.load import LoadedModel, load_model, model_config_of
from brisk.loader.quantized import quantization_of
from brisk.loader.resolve import resolve_model
from brisk.model.base import CausalLM
from brisk.parallel.groups import (
    ParallelFailure,
    ParallelState,
    init_distributed,
    local_store,
    shutdown_distributed,
    wait_for_workers,
)
from brisk.parallel.pipeline import keep_stage, stage_layers
from brisk.parallel.tensor import (
    check_tensor_parallel,
    even_ranges,
    head_split,
    shard_model,
    tie_vocab_parallel_head,
)
from brisk.runtime.paged_runner import kv_block_bytes
from brisk.runtime.parallel_runner import ParallelRunner, StageRunner, serve_steps


@dataclass(frozen=True)
class WorkerArgs:
    """What every rank needs to build its share of the engine (JSON on a worker's command line)."""

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None
    quantization: str | None = None
    quantization_config: dict[str, Any] | str | None = None  # as given: QuantConfig.parse reads both
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    timeout_s: float = 120.0
    micro_batches: int | None = None
    block_size: int = 16
    pack_weights: bool = True
    dequantize: bool = False  # a quantized .gguf as floats (tensor parallelism always: it slices floats)

    @classmethod
    def of_llm(cls, model: str, options: dict[str, Any]) -> WorkerArgs:
        """A rank's arguments from `LLM(model, **options)`'s keywords (missing ones: LLM's
        defaults): rank 0 (engine/llm.py) and torchrun's other ranks (cli.py) read the same names, so
        no option reaches one rank and not the others."""
        return cls(model, **{f: options[name] for f, name in _LLM_NAMES.items() if options.get(name) is not None})

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size, self.timeout_s,
                              self.micro_batches)

    @property
    def quant(self) -> QuantConfig | None:
        return None if self.quantization is None else QuantConfig.parse(self.quantization, self.quantization_config)


# WorkerArgs field -> LLM(...) keyword
_LLM_NAMES = {"dtype": "dtype", "device": "device", "max_model_len": "max_model_len", "quantization": "quantization",
              "quantization_config": "quantization_config", "tensor_parallel_size": "tensor_parallel_size",
              "pipeline_parallel_size": "pipeline_parallel_size", "timeout_s": "parallel_timeout_s",
              "micro_batches": "pipeline_micro_batches", "block_size": "block_size", "pack_weights": "pack_weights",
              "dequantize": "dequantize"}


def torchrun_rank() -> int | None:
    """This process's rank when torchrun started several (RANK and WORLD_SIZE > 1 in the
    environment), else None: the one reading of torchrun's environment."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        return int(os.environ["RANK"])
    return None


def check_parallel(args: WorkerArgs) -> None:
    """Every ValueError a rank would meet, raised on rank 0 before any process is spawned."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise UserError("this process already runs a parallel engine (one process group per process): close() "
                         "that LLM first")
    cfg, quant, tp = model_config_of(args.model), args.quant, args.tensor_parallel_size
    check_tensor_parallel(cfg, tp)
    stage_layers(cfg, args.pipeline_parallel_size)
    world = args.parallel.world_size
    if args.device.startswith("cuda") and torchrun_rank() is None and torch.cuda.device_count() < world:
        raise UserError(f"{world} ranks need {world} CUDA devices here (one each); {torch.cuda.device_count()} found")
    if tp > 1 and quant is not None:
        _check_shard_widths(cfg, tp, quant)
    source = resolve_model(args.model)
    saved = quantization_of(source.path) if source.kind == "hf" else None
    if tp > 1 and saved is not None:
        raise UserError(f"{args.model} is a quantized checkpoint ({saved.describe()}); tensor parallelism slices "
                         "float weights and quantizes each slice: load the original model with "
                         f"--quantization {saved.method}, or use pipeline parallelism alone")
    if tp > 1 and quant is not None and quant.method == "gguf":
        raise UserError("-q gguf keeps a GGUF file's whole blocks, which tensor parallelism cannot slice: use int8, "
                         "int4, w8a8 or ternary (each shard is quantized), or pipeline parallelism alone")
    if tp > 1 and quant is not None and quant.calibration is not None:
        raise UserError("calibrated quantization (GPTQ, SmoothQuant) runs on the whole model: quantize once with "
                         "`brisk quantize`, then run that checkpoint with pipeline parallelism, or drop calibration")


def _check_shard_widths(cfg: ModelConfig, tp: int, quant: QuantConfig) -> None:
    """Row-parallel layers see a slice of their input features; the method must take that width."""
    layers = range(cfg.num_hidden_layers)
    widths = {len(head_split(cfg, tp, r, i).q_heads) * cfg.head_dim for r in range(tp) for i in layers}
    widths |= {len(r) for i in layers for r in even_ranges(cfg.intermediate(i), tp)}
    need = quant.group_size if quant.method == "int4" else 16 if quant.method == "ternary" else 1
    bad = sorted(w for w in widths if w % need)
    if bad:
        raise UserError(f"-q {quant.method} needs input widths divisible by {need}, but tensor_parallel_size {tp} "
                         f"leaves row-parallel layers {bad[0]} columns: choose another size or group_size")


def build_rank(args: WorkerArgs, state: ParallelState) -> tuple[LoadedModel, range]:
    """This rank's model: float weights, its tensor shard and its stage's layers, then quantized
    (only what this rank keeps is quantized). Calibrated quantization runs the whole model, so
    there the other stages' layers are dropped after it."""
    quant = args.quant
    calibrated = quant is not None and quant.calibration is not None

    def reshape(model: CausalLM) -> None:
        if state.tp_size > 1:
            shard_model(model, state)
        if not calibrated:
            keep_stage(model, stage_layers(model.config, state.pp_size)[state.pp_rank], state.is_first_stage)

    loaded = load_model(args.model, args.dtype, str(state.device), args.max_model_len, quant, before_quant=reshape,
                        dequantize=args.dequantize or state.tp_size > 1)
    layers = stage_layers(loaded.config, state.pp_size)[state.pp_rank]
    if calibrated:
        keep_stage(loaded.model, layers, state.is_first_stage)
    tie_vocab_parallel_head(loaded.model)
    return loaded, layers


# A worker's exit code when another rank went away first (rank 0 blames that one, not this one).
LOST_GROUP = 3


def _stopped(proc: subprocess.Popen[bytes]) -> bool:
    """True for a live process the kernel holds stopped (Linux /proc; False where unknown)."""
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
    except OSError:
        return False
    return proc.poll() is None and stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


def _threads_per_rank(local_world: int) -> int:
    return max(1, (os.cpu_count() or 1) // local_world)


class WorkerSet:
    """Ranks 1..W-1 as child processes on this machine; says how one ended when a step fails."""

    def __init__(self, args: WorkerArgs, port: int) -> None:
        """`port`: rank 0's store (see groups.local_store)."""
        world = args.parallel.world_size
        self.timeout_s = args.timeout_s
        env = {**os.environ, "OMP_NUM_THREADS": str(_threads_per_rank(world)), "LOCAL_WORLD_SIZE": str(world)}
        # Own sessions: a Ctrl-C in the terminal reaches rank 0 alone, which stops the workers in
        # order (they also exit if rank 0 disappears, see _exit_with_parent).
        self.procs = {
            rank: subprocess.Popen([sys.executable, "-m", "brisk.engine.workers",
                                    json.dumps({"rank": rank, "port": port, "args": asdict(args)})],
                                   env={**env, "LOCAL_RANK": str(rank)}, start_new_session=True)
            for rank in range(1, world)
        }

    def describe(self, error: BaseException) -> str:
        """Which worker failed and how; the others are stopped (they cannot go on without it).
        Workers that merely lost the group after another failed exit with LOST_GROUP and are not
        blamed."""
        deadline = time.monotonic() + 3.0  # a killed peer's exit status appears within moments
        while True:
            blamed = [self._ending(rank, p) for rank, p in self.procs.items()
                      if p.poll() is not None and p.returncode != LOST_GROUP]
            blamed += [f"worker rank {rank} (pid {p.pid}) is stopped (SIGSTOP or a debugger) and did not answer "
                       f"within {self.timeout_s:g} s" for rank, p in self.procs.items() if _stopped(p)]
            if blamed or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.stop(grace_s=1.0)
        if blamed:
            return f"parallel engine stopped: {'; '.join(blamed)} ({error})"
        return (f"parallel engine stopped: a worker did not answer within {self.timeout_s:g} s (hung, or the "
                f"machine is overloaded; raise timeout_s if steps are that slow): {error}")

    def poll(self) -> str | None:
        """Between steps: a sentence about a worker that has ended, or None while all run."""
        ended = [self._ending(rank, p) for rank, p in self.procs.items() if p.poll() is not None]
        if not ended:
            return None
        self.stop(grace_s=1.0)
        return f"parallel engine stopped: {'; '.join(ended)}"

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    @staticmethod
    def _ending(rank: int, proc: subprocess.Popen[bytes]) -> str:
        code = proc.returncode
        if code is not None and code < 0:
            return f"worker rank {rank} (pid {proc.pid}) was killed by {signal.Signals(-code).name}"
        return f"worker rank {rank} (pid {proc.pid}) exited with code {code} (its traceback is above)"

    def stop(self, grace_s: float = 5.0) -> None:
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


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
    torch.set_num_threads(_threads_per_rank(local_world))
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
        stage = StageRunner(loaded.model, state, layers, blocks, args.block_size, args.pack_weights)
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


def run_worker(args: WorkerArgs, rank: int, init: str | torch.distributed.Store) -> None:
    """A worker's whole life: join, build its share, serve steps until rank 0 says stop."""
    state = init_distributed(args.parallel, rank, args.device, init)
    try:
        loaded, layers = build_rank(args, state)
        state.gather_objects(kv_block_bytes(loaded.model, args.block_size))
        blocks = state.broadcast_object()
        serve_steps(StageRunner(loaded.model, state, layers, blocks, args.block_size, args.pack_weights))
    finally:
        shutdown_distributed()


def _exit_with_parent() -> None:
    """A worker whose rank 0 vanished (killed, crashed) must not linger: watch the parent."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    spec = json.loads(sys.argv[1])
    _exit_with_parent()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        args = WorkerArgs(**spec["args"])
        run_worker(args, spec["rank"], local_store(spec["rank"], args.parallel.world_size, spec["port"]))
    except (RuntimeError, OSError) as e:
        if "Connection" not in str(e) and "Timed out" not in str(e) and "timeout" not in str(e).lower():
            raise  # a real error of this worker: its traceback tells rank 0's user what happened
        # another rank went away (rank 0 reports which): one line, not a traceback per survivor
        print(f"brisk worker rank {spec['rank']}: lost the group, exiting ({str(e).splitlines()[0][:200]})",
              file=sys.stderr)
        sys.exit(LOST_GROUP)


if __name__ == "__main__":
    main()
