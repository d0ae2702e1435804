"""What every rank is told (`WorkerArgs`, JSON on a worker's command line) and the one reading of
torchrun's environment."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from brisk.config import ParallelConfig, QuantConfig


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
    enforce_eager: bool = False  # no C++ decode plan (module by module), on every rank

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
              "dequantize": "dequantize", "enforce_eager": "enforce_eager"}


def torchrun_rank() -> int | None:
    """This process's rank when torchrun started several (RANK and WORLD_SIZE > 1 in the
    environment), else None: the one reading of torchrun's environment."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        return int(os.environ["RANK"])
    return None
