"""The Linear ops the C++ decode plan runs (kernels/cpu_decode_plan.cpp `LinearOp::Kind`).

Each Linear module describes its own op (`plan_op()`: model/layers.py's float Linear and quant/'s
quantized ones), so the plan builder (runtime/decode_plan.py) asks the module instead of knowing
every format, and a new format adds its kernel op where its module lives.
"""

from __future__ import annotations

from typing import Any

import torch

# the C++ enum's values, in its order
(KIND_FLOAT, KIND_GROUP, KIND_GROUP_INT8_ACTS, KIND_INT8, KIND_INT8_TILED, KIND_GROUP_INT16_ACTS, KIND_BLOCKS,
 KIND_SPARSE24) = range(8)
# GroupLinear.activations -> the kind that multiplies them
GROUP_KINDS = {"float": KIND_GROUP, "int8": KIND_GROUP_INT8_ACTS, "int16": KIND_GROUP_INT16_ACTS}

# (kind, weight, scale, zero, bias, group, bits, tiled): what `DecodePlan.add_layer` takes per Linear.
# A module's `plan_op()` returns one for the call its forward makes on up to the plan's rows of
# float32 CPU activations, or None where that is no single C++ kernel call (the module path runs).
LinearOp = tuple[int, Any, Any, Any, "torch.Tensor | None", int, int, bool]
