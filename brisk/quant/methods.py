"""One object per quantization method: what brisk does for it, in one place (the house plan,
../shared/ARCHITECTURE.md: "a quantization format: one method object in quant/ and its kernels in
kernels/").

config.py says what a user may ask for (`QuantConfig`: names, options and their validation, the
one-line description); a `QuantMethod` says what the method does with a model: the module each
decoder Linear and the LM head become (`make`, `make_head`), what calibration text computes
(`calibrate`), which input widths tensor parallelism may give its row-parallel shards
(`shard_multiple`), whether its weights come from a file's blocks rather than from float weights
(`from_file_blocks`: gguf). Each quantized module describes its own decode-plan kernel op
(`plan_op`, kernels/plan_ops.py). The loader, `apply`, the tensor-parallel checks and `brisk
quantize` ask these objects instead of comparing method names.

To add a method: its module in quant/ (with `plan_op` if a C++ kernel runs it), one `QuantMethod`
in `METHODS` below, its name in config.py's QUANT_METHODS (and CALIBRATED_METHODS if calibration
applies).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from brisk.config import CALIBRATED_METHODS, QUANT_METHODS, QuantConfig
from brisk.errors import UserError
from brisk.model.layers import Linear
from brisk.quant.grouped import GroupLinear
from brisk.quant.int8 import Int8Linear
from brisk.quant.sparse24 import Sparse24Linear
from brisk.quant.ternary import TernaryLinear
from brisk.quant.w8a8 import W8A8Linear

# (Linear, config, X^T X / n of its calibration inputs or None) -> quantized module
Maker = Callable[[Linear, QuantConfig, "torch.Tensor | None"], nn.Module]
Calibrated = dict[Linear, tuple["torch.Tensor | None", "torch.Tensor | None"]]  # column scale, X^T X / n


def _gptq(model: nn.Module, ids: list[int]) -> Calibrated:
    from brisk.quant.calibrate import gptq_calibrate  # GPTQ's and SparseGPT's Hessians

    return gptq_calibrate(model, ids)  # type: ignore[arg-type, return-value]


def _smoothquant(model: nn.Module, ids: list[int]) -> Calibrated:
    from brisk.quant.w8a8 import smoothquant_calibrate  # SmoothQuant's outlier migration

    return smoothquant_calibrate(model, ids)  # type: ignore[arg-type]


def _one(cfg: QuantConfig) -> int:
    return 1


@dataclass(frozen=True)
class QuantMethod:
    name: str
    make: Maker | None  # a decoder Linear's module; None: the loader makes it from a file's blocks
    make_head: Maker | None  # the LM head's module; None: the head stays as it is
    calibrator: Callable[[nn.Module, list[int]], Calibrated] | None = None
    shard_multiple: Callable[[QuantConfig], int] = _one  # row-parallel input widths must divide by it
    group_sized: bool = False  # `group_size` is part of the format (a saved checkpoint must match it)

    @property
    def from_file_blocks(self) -> bool:
        """The weights are a GGUF file's own blocks, kept as stored: no float model to quantize, and
        whole blocks that tensor parallelism cannot slice."""
        return self.make is None

    def calibrate(self, model: nn.Module, ids: list[int]) -> Calibrated:
        """Per Linear, from calibration token ids: a column scale (SmoothQuant) and X^T X / n (GPTQ)."""
        if self.calibrator is None:
            raise UserError(f"quantization {self.name} takes no calibration text; calibration applies to "
                            f"{', '.join(CALIBRATED_METHODS)}")
        return self.calibrator(model, ids)


# int4's head is 8-bit in groups of 32 (GGUF's Q8_0, what llama.cpp's own Q4 files keep for
# token_embd): the head sees every logit, and 4 bits there cost more quality than the 14 MB they save.
# ternary's head stays 8-bit too, as BitNet keeps its embedding and head in high precision. 2:4's head
# is not made sparse: float32 keeps the model's own head, int8 gets int8's, so each compares with the
# dense model of the same dtype.
METHODS: dict[str, QuantMethod] = {m.name: m for m in (
    QuantMethod("int8", lambda lin, cfg, x: Int8Linear.from_linear(lin), lambda lin, cfg, x: Int8Linear.from_linear(lin)),
    QuantMethod("int4", lambda lin, cfg, x: GroupLinear.from_linear(lin, cfg.group, 4, calibration=x),
                lambda lin, cfg, x: GroupLinear.from_linear(lin, 32, 8), _gptq,
                shard_multiple=lambda cfg: cfg.group, group_sized=True),
    QuantMethod("w8a8", lambda lin, cfg, x: W8A8Linear.from_linear(lin), lambda lin, cfg, x: W8A8Linear.from_linear(lin),
                _smoothquant),
    QuantMethod("ternary", lambda lin, cfg, x: TernaryLinear.from_linear(lin),
                lambda lin, cfg, x: GroupLinear.from_linear(lin, 32, 8), shard_multiple=lambda cfg: 16),
    QuantMethod("gguf", None, None),  # quant/gguf.py `attach_blocks`, called by the loader
    QuantMethod("sparse24", lambda lin, cfg, x: Sparse24Linear.from_linear(lin, x), None, _gptq),
    QuantMethod("sparse24_int8", lambda lin, cfg, x: Sparse24Linear.from_linear(lin, x, int8=True),
                lambda lin, cfg, x: Int8Linear.from_linear(lin), _gptq),
)}
assert set(METHODS) == set(QUANT_METHODS)
assert {n for n, m in METHODS.items() if m.calibrator is not None} == set(CALIBRATED_METHODS)


def method(cfg: QuantConfig | str) -> QuantMethod:
    """The method object of `cfg` (a QuantConfig has already checked the name)."""
    name = cfg if isinstance(cfg, str) else cfg.method
    if name not in METHODS:
        raise UserError(f"unknown quantization method {name!r}; available: {', '.join(METHODS)}")
    return METHODS[name]
