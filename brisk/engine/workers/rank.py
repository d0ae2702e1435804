"""One rank's share of the engine: its model (built the same way on every rank) and, on ranks
1..W-1, its whole life serving steps."""

from __future__ import annotations

import torch

from brisk.engine.workers.args import WorkerArgs
from brisk.loader.load import LoadedModel, load_model
from brisk.model.base import CausalLM
from brisk.parallel.groups import ParallelState, init_distributed, shutdown_distributed
from brisk.parallel.pipeline import keep_stage, stage_layers
from brisk.parallel.tensor import shard_model, tie_vocab_parallel_head
from brisk.runtime.paged_runner import kv_block_bytes
from brisk.runtime.parallel_runner import StageRunner, serve_steps


def build_rank(args: WorkerArgs, state: ParallelState) -> tuple[LoadedModel, range]:
    """This rank's model: float weights, its tensor shard and its stage's layers, then quantized
    (only what this rank keeps is quantized). Calibrated quantization runs the whole model, so
    there the other stages' layers are dropped after it."""
    quant = args.quant
    calibrated = quant is not None and quant.calibrated

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


def run_worker(args: WorkerArgs, rank: int, init: str | torch.distributed.Store) -> None:
    """A worker's whole life: join, build its share, serve steps until rank 0 says stop."""
    state = init_distributed(args.parallel, rank, args.device, init)
    try:
        loaded, layers = build_rank(args, state)
        state.gather_objects(kv_block_bytes(loaded.model, args.block_size))
        blocks = state.broadcast_object()
        serve_steps(StageRunner(loaded.model, state, layers, blocks, args.block_size, args.pack_weights,
                                eager=args.enforce_eager))
    finally:
        shutdown_distributed()
