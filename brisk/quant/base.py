"""What every quantized Linear shares."""

from __future__ import annotations

import torch
from torch import nn

from brisk.kernels.plan_ops import LinearOp


def _follow(fn, dtype: torch.dtype) -> torch.dtype:  # type: ignore[no-untyped-def]
    """The dtype a floating tensor of `dtype` gets from a `_apply` function (.to, .half, .cuda)."""
    return fn(torch.zeros(0, dtype=dtype)).dtype


class QuantizedLinear(nn.Module):
    """Base of the quantized Linears: `.to(dtype)` / `.half()` change the activation dtype
    (`self.dtype`), never the stored integers, scales and offsets, whose dtypes the kernels rely on
    (float16 scales stay float16 when the model moves to bfloat16)."""

    dtype: torch.dtype

    def plan_op(self) -> LinearOp | None:
        """The decode plan's op for this module (kernels/plan_ops.py); None: it runs module by module."""
        return None

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
    (the default model's int8 weights, cold: 8.1 -> 4.9 ms a token). Per-group buffers may be tiled
    alongside (`tiled_buffers`: a group's 4 scales in one load). The first CPU kernel call tiles them
    in place (`_tile`); everything else sees them row-major: `state_dict()` (checkpoints),
    `qweight_rows()` / `rows()`, and `.to(...)`, which restores the row-major layout before moving."""

    qweight: torch.Tensor
    tile_width: int  # columns of qweight per tile row
    tiled: bool = False
    dtype: torch.dtype

    def tiled_buffers(self) -> dict[str, int]:
        """Buffers held tiled, each with its tile width in columns (qweight and, in subclasses, more)."""
        return {"qweight": self.tile_width}

    def rows(self, name: str, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Buffer `name` row-major: all of it (a copy when tiled) or rows `ids`."""
        t = self._buffers[name]
        assert t is not None
        if not self.tiled or name not in self.tiled_buffers():
            return t if ids is None else t[ids]
        width = self.tiled_buffers()[name]
        if ids is None:
            return untile_rows(t, width)
        out, cols = t.shape
        tiles = t.view(out // TILE_ROWS, cols // width, TILE_ROWS, width)
        return tiles[ids // TILE_ROWS, :, ids % TILE_ROWS].reshape(len(ids), cols)

    def qweight_rows(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The weight row-major: all of it (a copy when tiled) or rows `ids`."""
        return self.rows("qweight", ids)

    def _tile(self, kernel_tiles: bool) -> bool:
        """Hold the weight tiled when the kernel reads tiles (`kernel_tiles`) and the shape is whole
        tiles; True when it is tiled."""
        if self.tiled or not kernel_tiles:
            return self.tiled
        shapes = {name: self._buffers[name] for name in self.tiled_buffers() if self._buffers[name] is not None}
        if all(t.shape[0] % TILE_ROWS == 0 and t.shape[1] % self.tiled_buffers()[n] == 0 for n, t in shapes.items()):
            for name, t in shapes.items():
                self._buffers[name] = tile_rows(t, self.tiled_buffers()[name])
            self.tiled = True
        return self.tiled

    def _shaped(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """A kernel's float32 [rows, out] as this module's output: x's leading dims, its dtype."""
        if y.dtype != self.dtype:
            y = y.to(self.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])

    def _untile(self) -> None:
        if self.tiled:
            for name in self.tiled_buffers():
                if self._buffers[name] is not None:
                    self._buffers[name] = self.rows(name)
            self.tiled = False

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.tiled:  # checkpoints hold the row-major buffers, whatever the kernel did in memory
            for name in self.tiled_buffers():
                if self._buffers[name] is not None:
                    destination[prefix + name] = self.rows(name)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._untile()  # the incoming weight is row-major
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self._untile()  # other devices and kernels read row-major
        return super()._apply(fn, recurse)
