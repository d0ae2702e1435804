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


TILE_ROWS = 4  # rows per tile in the CPU kernels' tiled weight layout


def tile_rows(q: torch.Tensor, width: int) -> torch.Tensor:
    """Row-major [out, cols] -> the same shape holding tiles of TILE_ROWS rows x `width` columns:
    rows 4g..4g+3 of columns [c w, (c + 1) w) side by side, tiles in (g, c) order."""
    out, cols = q.shape
    return q.view(out // TILE_ROWS, TILE_ROWS, cols // width, width).transpose(1, 2).contiguous().view(out, cols)


def untile_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """`tile_rows` undone."""
    out, cols = t.shape
    return t.view(out // TILE_ROWS, cols // width, TILE_ROWS, width).transpose(1, 2).contiguous().view(out, cols)


class TiledLinear(QuantizedLinear):
    """A quantized Linear whose `qweight` [out, cols] the CPU kernel may hold in tiles of 4 rows x one
    run of `tile_width` columns (64 bytes of 4-bit, 128 of 8-bit... see the kernels): a thread then
    reads one sequential stream instead of four rows far apart, which the hardware prefetchers follow
    (the default model's int8 weights, cold: 8.1 -> 4.9 ms a token). The first CPU kernel call tiles
    the weight in place (`_tile`); everything else sees it row-major: `state_dict()` (checkpoints),
    `qweight_rows()`, and `.to(...)`, which restores the row-major weight before moving."""

    qweight: torch.Tensor
    tile_width: int  # columns of qweight per tile row
    tiled: bool = False
    dtype: torch.dtype

    def qweight_rows(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The weight row-major: all of it (a copy when tiled) or rows `ids`."""
        if not self.tiled:
            return self.qweight if ids is None else self.qweight[ids]
        if ids is None:
            return untile_rows(self.qweight, self.tile_width)
        out, cols = self.qweight.shape
        tiles = self.qweight.view(out // TILE_ROWS, cols // self.tile_width, TILE_ROWS, self.tile_width)
        return tiles[ids // TILE_ROWS, :, ids % TILE_ROWS].reshape(len(ids), cols)

    def _tile(self, kernel_tiles: bool) -> bool:
        """Hold the weight tiled when the kernel reads tiles (`kernel_tiles`) and the shape is whole
        tiles; True when it is tiled."""
        out, cols = self.qweight.shape
        if not self.tiled and kernel_tiles and out % TILE_ROWS == 0 and cols % self.tile_width == 0:
            self.qweight = tile_rows(self.qweight, self.tile_width)
            self.tiled = True
        return self.tiled

    def _shaped(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """A kernel's float32 [rows, out] as this module's output: x's leading dims, its dtype."""
        if y.dtype != self.dtype:
            y = y.to(self.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])

    def _untile(self) -> None:
        if self.tiled:
            self.qweight = untile_rows(self.qweight, self.tile_width)
            self.tiled = False

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.tiled:  # checkpoints hold the row-major weight, whatever the kernel did in memory
            destination[prefix + "qweight"] = self.qweight_rows()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._untile()  # the incoming weight is row-major
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self._untile()  # other devices and kernels read row-major
        return super()._apply(fn, recurse)
