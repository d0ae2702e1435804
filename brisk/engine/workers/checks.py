"""Every error a rank would meet, found on rank 0 before any process starts."""

from __future__ import annotations

import torch

from brisk.config import ModelConfig, QuantConfig
from brisk.engine.workers.args import WorkerArgs, torchrun_rank
from brisk.errors import UserError
from brisk.loader.load import model_config_of
from brisk.loader.quantized import quantization_of
from brisk.loader.resolve import resolve_model
from brisk.parallel.pipeline import stage_layers
from brisk.parallel.tensor import check_tensor_parallel, even_ranges, head_split
from brisk.quant.methods import method


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
    if tp > 1 and quant is not None and method(quant).from_file_blocks:
        raise UserError("-q gguf keeps a GGUF file's whole blocks, which tensor parallelism cannot slice: use int8, "
                         "int4, w8a8 or ternary (each shard is quantized), or pipeline parallelism alone")
    if tp > 1 and quant is not None and quant.calibrated:
        raise UserError("calibrated quantization (GPTQ, SmoothQuant) runs on the whole model: quantize once with "
                         "`brisk quantize`, then run that checkpoint with pipeline parallelism, or give "
                         "--quant-config '{\"calibration\": \"none\"}' (round-to-nearest; int4 and w8a8 "
                         "calibrate on the model's own text by default)")


def _check_shard_widths(cfg: ModelConfig, tp: int, quant: QuantConfig) -> None:
    """Row-parallel layers see a slice of their input features; the method must take that width."""
    layers = range(cfg.num_hidden_layers)
    widths = {len(head_split(cfg, tp, r, i).q_heads) * cfg.head_dim for r in range(tp) for i in layers}
    widths |= {len(r) for i in layers for r in even_ranges(cfg.intermediate(i), tp)}
    need = method(quant).shard_multiple(quant)
    bad = sorted(w for w in widths if w % need)
    if bad:
        raise UserError(f"-q {quant.method} needs input widths divisible by {need}, but tensor_parallel_size {tp} "
                         f"leaves row-parallel layers {bad[0]} columns: choose another size or group_size")
