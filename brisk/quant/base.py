"""What every quantized Linear shares."""

from __future__ import annotations

import torch
from torch import nn


def _follow(fn, dtype: torch.dtype) -> torch.dtype:  # type: ignore[no-untyped-def]
    """The dtype a floating tensor of `dtype` gets from a `_apply` function (.to, .half, .cuda)."""
    return fn(torch.zeros(0, dtype=dtype)).dtype


class QuantizedLinear(nn.Module):
    """Base of the quantized Linears: `.to(dtype)` / `.half()` change the activation dtype
    (`self.dtype`), never the stored integers, scales and offsets, whose dtypes the kernels rely on
    (float16 scales stay float16 when the model moves to bfloat16)."""

    dtype: torch.dtype

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        kept = {name: b.dtype for name, b in self._buffers.items() if b is not None}
        super()._apply(fn, recurse)
        for name, dtype in kept.items():
            buf = self._buffers[name]
            if buf is not None and buf.dtype != dtype:
                self._buffers[name] = buf.to(dtype)
        self.dtype = _follow(fn, self.dtype)
        return self


class FollowDtype(nn.Module):
    """A module without tensors that still tracks the model's dtype through `.to(...)`."""

    dtype: torch.dtype

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self.dtype = _follow(fn, self.dtype)
        return super()._apply(fn, recurse)
