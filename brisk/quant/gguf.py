"""GGUF files run from their blocks: every block-quantized Linear (and a quantized LM head and
token embedding) keeps the file's bytes and is multiplied by brisk's kernels, as llama.cpp does.

Two module kinds, chosen per Linear by `attach_blocks`:

- `GroupLinear` for Linears whose parts are all Q4_1 or all Q8_0 (`_as_group` says why): a GGUF
  Q4_1 block is 32 columns, fp16 d, fp16 m, 16 bytes of nibbles (low nibble = column j, high =
  column j + 16), w = q d + m; Q4_0 has no m and w = (q - 8) d; Q8_0 is fp16 d and 32 int8,
  w = q d. That is GroupLinear's layout with group 32 (scale d, zero m or -8 d), so the nibbles are
  used where they lie and float activations meet exactly the weights the dequantizing loader
  makes (q d is exact in float32, and the kernel's one fma rounds q d + m once, as ggml does).
- `BlockLinear` for every other type with a block kernel (K-quants, Q4_0, Q5_0/Q5_1, IQ4_NL/IQ4_XS) and
  for stacked Linears that mix types (Q4_K_M's q|k|v): the blocks as stored (Q4_0, Q4_1, Q5_0, Q5_1,
  IQ4_NL, IQ4_XS and Q2_K to Q6_K repacked into four-row tiles), int8 activations in 32-column
  blocks
  (kernels/cpu_blocks.cpp).

A Linear with a part in a float type, or in a type no kernel runs (the lattice i-quants), is left
to the float loader (dequantized once).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from brisk.errors import UserError
from brisk.kernels import (
    TILED,
    bf16_tiles_supported,
    block_dequantize,
    block_dequantize_bf16,
    block_dequantize_supported,
    block_gemm,
    block_kgemm,
    block_kgemm_supported,
    block_kernel_supported,
    block_tile,
    block_tile_supported,
    block_types,
    block_untile,
    float_prompt_tiles,
    group_kernel_tiles,
    pad_rows,
)
from brisk.kernels.plan_ops import KIND_BLOCKS, LinearOp
from brisk.loader.dequant import dequantize
from brisk.model.layers import WHOLE, trains
from brisk.quant.base import TILE_ROWS as KERNEL_TILE_ROWS
from brisk.quant.base import QuantizedLinear, tile_rows
from brisk.quant.grouped import GroupLinear, quantize_act_blocks

GROUP = 32
# Past this many rows (prompt chunks; decode batches stay below max_num_seqs' 64) a BlockLinear
# leaves the decode kernels, whose one float scale-and-add per 32 products and row costs more at
# hundreds of rows than a float GEMM (Q4_K 576x1536, 512 rows: 9.8 ms int8, 4.6 ms float plus the
# tiles' dequantization). K-quant tiles then run block_kgemm (x in int8 per 128 columns, summed as
# integers: 1.25-1.35x the float GEMM on an AVX2 CPU); the other types a float32 GEMM, the weight
# made float TILE_ROWS rows at a time (~1.2 MB, L2). On Intel CPUs torch's float GEMM is at least as
# fast as block_kgemm (~135 against ~85 GMAC/s on a Xeon's two cores at AVX-512, even at AVX2), so
# K-quants take it too (kernels.float_prompt_tiles), with no int8 rounding of x. Elsewhere the MLP's
# down projection keeps float x all the same (FLOAT_X_LINEARS, `BlockLinear.float_x`): its inputs, the
# gated activations, carry the massive outliers that int8 per 128 columns rounds the small values
# beside away. Window-512 perplexity with the integer path forced (BRISK_FLOAT_PROMPT_TILES=0): the
# default model's Q3_K_M mix +0.38% -> exact (its down projections are its only K-quant layers),
# Gemma 3 270M's KL to the dequantized file 0.0061 -> 0.0015; on the AVX2 EPYC, where MKL ran 0.82x
# block_kgemm, that costs a 1.5B-shaped prompt ~6% (down is ~30% of its products).
FLOAT_X_LINEARS = frozenset({"down_proj"})
# Rows up to it keep the decode kernels' numbers.
BLOCK_KERNEL_MAX_ROWS = 64
TILE_ROWS = 512
# Where AMX-BF16 is usable (kernels.bf16_tiles_supported) every type's batched work instead runs
# torch's bf16 GEMM (oneDNN on the AMX tiles) on the weight made bfloat16 a tile of rows at a time,
# up to BF16_TILE_BYTES (`_bf16_tiles`): 1.5B-shaped Q4_K layers at 512 rows ran 390-480 GMAC/s
# against block_kgemm's 90-100 on two cores (the GEMM alone runs ~1,000-1,400), and closer to the
# dequantized file (bf16 x keeps 8 bits of every value where int8 per 128 columns loses the small
# ones beside a large one: Q6_K +0.01% perplexity against +0.24%, window 512). Big tiles pay:
# oneDNN repacks each for the AMX tiles (256-row tiles ran ~30% slower). oneDNN picks its kernel
# and blocking by the number of rows, so a row's numbers would change with the batch around it
# (seen for most row counts below 1024): x goes through in chunks of a fixed BF16_ROW_CHUNK rows,
# the last padded with zeros, and a row's numbers are then the same in any batch and at any place
# in it (tests; 128 costs ~10% against whole 512-row prompts).
BF16_TILE_BYTES = 32 << 20
BF16_TILE_MAX_ROWS = 4096
BF16_ROW_CHUNK = 128
# type -> (block bytes, has m, 4-bit)
NATIVE = {GGMLQuantizationType.Q4_0: (18, False, True), GGMLQuantizationType.Q4_1: (20, True, True),
          GGMLQuantizationType.Q8_0: (34, False, False)}

Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]  # q, scale, zero, bits
Blocks = dict[str, tuple[int, torch.Tensor]]  # HF name -> (GGML type, uint8 [rows, row bytes])
# A loader's hook: rows of a file tensor were copied, the map's pages under them may go
# (loader/gguf_file.py `release_bytes`; a no-op for rows that are not the map's)
ReleaseRows = Callable[[torch.Tensor], None]
# A module that keeps a copy of a file tensor (a repacked GroupLinear, tiled blocks) makes it this many
# bytes of the file's rows at a time and lets their pages go after each, so the copy and the pages it
# was read from never count in full together: the peak of a load was the largest tensor twice
# (Gemma 3 270M's 178 MB Q8_0 head: a 511-token prompt's run peaked at 827 MiB, 666 since).
COPY_CHUNK_BYTES = 1 << 20


def _chunks(rows: torch.Tensor) -> list[tuple[int, int]]:
    """[r0, r1) ranges of about COPY_CHUNK_BYTES of `rows`, on whole tiles of the kernels' 4 rows."""
    n, four = rows.shape[0], KERNEL_TILE_ROWS
    step = max(four, COPY_CHUNK_BYTES // max(1, rows.shape[1] * rows.element_size()) // four * four)
    return [(r0, min(n, r0 + step)) for r0 in range(0, n, step)]


def is_native(ggml_type: int) -> bool:
    return ggml_type in NATIVE


def to_group(ggml_type: int, raw: torch.Tensor, tiled: bool = False, release_rows: ReleaseRows | None = None) -> Parts:
    """uint8 [rows, blocks * block bytes] -> GroupLinear's (q, scale, zero, bits), group 32: row-major,
    or in the kernels' 4-row tiles (`tiled`, rows a multiple of 4: quant/base.tile_rows), made
    COPY_CHUNK_BYTES of `raw` at a time, `release_rows` told of each chunk once copied."""
    size, has_m, four_bit = NATIVE[GGMLQuantizationType(ggml_type)]
    rows, n_blocks = raw.shape[0], raw.shape[1] // size
    start = 4 if has_m else 2
    width = GroupLinear.run_bytes(4 if four_bit else 8)  # its tile_width; scale and zero tile 1 wide
    qs = torch.empty(rows, n_blocks * (size - start), dtype=torch.uint8, device=raw.device)
    d = torch.empty(rows, n_blocks, dtype=torch.float16, device=raw.device)
    m = torch.empty(rows, n_blocks, dtype=torch.float16, device=raw.device) if has_m else None
    for r0, r1 in _chunks(raw):
        blocks = raw[r0:r1].reshape(r1 - r0, n_blocks, size)
        parts = [(qs, blocks[..., start:].reshape(r1 - r0, -1), width),
                 (d, blocks[..., 0:2].contiguous().view(torch.float16).reshape(r1 - r0, -1), 1)]
        if m is not None:
            parts.append((m, blocks[..., 2:4].contiguous().view(torch.float16).reshape(r1 - r0, -1), 1))
        for out, part, w in parts:
            out[r0:r1] = tile_rows(part.contiguous(), w) if tiled else part
        if release_rows is not None:
            release_rows(raw[r0:r1])
    if not four_bit:
        return qs.view(torch.int8), d, None, 8
    return qs, d, m if m is not None else -8 * d, 4  # Q4_0's zero point, exact (elementwise: tiled alike)


def _group_linear(parts: list[Parts], output_sizes: tuple[int, ...], bias: torch.Tensor | None,
                  dtype: torch.dtype, tiled: bool = False) -> GroupLinear:
    """The parts' rows stacked into one GroupLinear (one part is used as it is: no second copy);
    `tiled`: the parts are in 4-row tiles, whole tiles each, so stacked they are the whole's tiles."""
    def stack(ts: list[torch.Tensor]) -> torch.Tensor:
        return ts[0].contiguous() if len(ts) == 1 else torch.cat(ts)

    q = stack([p[0] for p in parts])
    scale = stack([p[1] for p in parts])
    zero = None if parts[0][2] is None else stack([p[2] for p in parts])  # type: ignore[misc]
    module = GroupLinear(q, scale, zero, GROUP, parts[0][3], bias, output_sizes, dtype)
    assert not tiled or module.tiled_buffers() == {"qweight": module.tile_width, "scale": 1, "zero": 1}, \
        "to_group tiles the buffers GroupLinear tiles, at their widths"
    module.tiled = tiled
    return module


def _as_group(types: list[int]) -> bool:
    """GroupLinear serves these parts: all Q4_1, or all Q8_0, with float (or int16) activations.
    - Q8_0 as a BlockLinear decodes faster (SmolLM2's Q8_0 LM head: 1.67 -> 1.15 ms a token; a Q6_K
      file of Q8_0 layers: 99-103 -> 112-119 tokens/s), but its int8 activations then are the larger
      rounding: that file's perplexity went +0.56% over its float twin (window 64), against +0.008%
      for Q4_K_M's Q5_0 layers. Exactness first: 8-bit weights keep float activations.
    - Q4_1 (the default model): the GroupLinear's int16 kernel decoded 133-171 tokens/s, blocks 123-132.
    - Q4_0 runs as blocks: as fast or faster (Q3_K_M, 120 Q4_0 tensors: 166-179 against 161-168) and
      read in place, where a GroupLinear is a repacked copy (that file's peak memory was 1.33x)."""
    kinds = {GGMLQuantizationType(t) for t in types}
    return kinds in ({GGMLQuantizationType.Q4_1}, {GGMLQuantizationType.Q8_0})


def native_module(segments: list[tuple[int, torch.Tensor]], in_features: int, bias: torch.Tensor | None,
                  output_sizes: tuple[int, ...], dtype: torch.dtype,
                  release_rows: ReleaseRows | None = None) -> nn.Module | None:
    """The module that runs these blocks as stored, or None when some part has no kernel. A copy it
    keeps is made a chunk of rows at a time, `release_rows` told of each (COPY_CHUNK_BYTES); a
    GroupLinear is made in the kernels' tiles at once where they read tiles (the layout its first
    kernel call would switch to, through a second whole copy)."""
    types = [t for t, _ in segments]
    if _as_group(types):
        tiled = group_kernel_tiles() and all(rows.shape[0] % KERNEL_TILE_ROWS == 0 for _, rows in segments)
        return _group_linear([to_group(t, rows, tiled, release_rows) for t, rows in segments], output_sizes, bias,
                             dtype, tiled)
    if all(t in block_types() for t in types):
        return BlockLinear(segments, in_features, bias, output_sizes, dtype, release_rows=release_rows)
    return None


def _check_shape(name: str, ggml_type: int, rows: torch.Tensor, out_features: int, in_features: int) -> None:
    """The file's tensor has the shape the model's config gives its layer (ValueError naming it)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    kind = GGMLQuantizationType(ggml_type).name
    if in_features % block or rows.shape != (out_features, in_features // block * size):
        cols = rows.shape[1] // size * block if rows.dim() == 2 else "?"
        raise UserError(f"GGUF tensor {name!r} ({kind}) holds {rows.shape[0]} x {cols} values, but the file's "
                         f"metadata makes that layer {out_features} x {in_features}: the file is inconsistent; "
                         "convert or download it again")


def attach_blocks(model: nn.Module, blocks: Blocks, bias_of: Callable[[str], torch.Tensor | None],
                  release: Callable[[str], None] = lambda name: None,
                  release_rows: ReleaseRows | None = None) -> set[str]:
    """Swap in native modules for every Linear whose parts are all in `blocks` with a kernel, and
    for a quantized LM head and token embedding; `bias_of(HF weight name)` reads a part's bias,
    `release(HF name)` lets go of a tensor's file pages once a module copied them (a GroupLinear, a
    tiled BlockLinear part), `release_rows(rows)` of a chunk's pages as the copy goes.
    Returns the HF names now served (weights and their biases), which the float loader skips."""
    from brisk.quant import modules_changed, quantizable, tie_head

    modules_changed(model)
    parts: dict[str, dict[int, str]] = {}
    for name in blocks:
        target = model.linear_part(name)  # type: ignore[operator]
        if target is not None:
            parts.setdefault(target[0], {})[target[1]] = name
    consumed: set[str] = set()
    names = {id(m): n for n, m in model.named_modules()}
    for parent, attr, linear in quantizable(model):
        got = parts.get(names[id(linear)], {})
        if WHOLE in got:  # one fused tensor (Phi-3's qkv_proj) fills every part
            part_names, part_rows = [got[WHOLE]], [linear.out_features]
        elif len(got) == len(linear.output_sizes):
            part_names, part_rows = [got[i] for i in range(len(linear.output_sizes))], list(linear.output_sizes)
        else:
            continue
        for name, rows_expected in zip(part_names, part_rows):
            _check_shape(name, *blocks[name], rows_expected, linear.in_features)
        biases = [bias_of(n) for n in part_names] if linear.bias is not None else []
        if any(b is None for b in biases):
            continue  # a part without its bias: the float loader reports what is missing
        bias = torch.cat(biases).float() if biases else None  # type: ignore[arg-type]
        module = native_module([blocks[n] for n in part_names], linear.in_features, bias, linear.output_sizes,
                               linear.weight.dtype, release_rows)
        if module is not None:
            if isinstance(module, BlockLinear):
                module.float_x = attr in FLOAT_X_LINEARS
            setattr(parent, attr, module)
            for name, copied in zip(part_names, _copied_parts(module)):
                if copied:
                    release(name)
            consumed.update(part_names)
            consumed.update(n.removesuffix(".weight") + ".bias" for n in part_names if bias is not None)
    embed_name = "model.embed_tokens.weight" if "model.embed_tokens.weight" in blocks else "embed_tokens.weight"
    if embed_name in blocks:
        ggml_type, rows = blocks[embed_name]
        _check_shape(embed_name, ggml_type, rows, model.config.vocab_size, model.config.hidden_size)  # type: ignore[union-attr]
        dtype = model.embed_tokens.weight.dtype  # type: ignore[union-attr]
        if getattr(model, "lm_head", "absent") is None:  # tied: the head's blocks serve the lookups too
            head = native_module([(ggml_type, rows)], model.config.hidden_size, None, (rows.shape[0],),  # type: ignore[union-attr]
                                 dtype, release_rows)
            if head is not None:
                tie_head(model, head)
                if _copied_parts(head)[0]:
                    release(embed_name)
                consumed.add(embed_name)
        elif ggml_type in block_types() or is_native(ggml_type):
            model.embed_tokens = BlockEmbedding(ggml_type, rows, model.config.hidden_size, dtype)  # type: ignore[union-attr,assignment]
            consumed.add(embed_name)
    return consumed


def _copied_parts(module: nn.Module) -> list[bool]:
    """Per part: the module holds a copy of it (a GroupLinear, a tiled BlockLinear segment), so the
    file's pages of that tensor can be let go."""
    return module.tiled_parts if isinstance(module, BlockLinear) else [True] * len(module.output_sizes)


class BlockLinear(QuantizedLinear):
    """A Linear whose weight stays in a GGUF file's blocks, multiplied by the block kernels
    (brisk/kernels/cpu_blocks.cpp) on int8-quantized activations, as llama.cpp does.

    A stacked Linear (q|k|v, gate|up) holds one segment per part, each in its own GGML type
    (Q4_K_M files store v in Q6_K beside q and k in Q4_K). The blocks are the file's bytes: a view
    of its memory map where no row permutation was needed, so the weight costs no memory of its own
    beyond the page cache. The exceptions are the types with tiles (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL,
    IQ4_XS, Q2_K to Q6_K; rows in fours): repacked once into the tile layout (kernels.block_tile,
    the same bytes, IQ4_XS / Q3_K / Q4_K / Q5_K's scales unpacked: +1.5-3.6%; type kernels.TILED | type),
    which the kernels run ~1.7x (Q5_0) to ~2.2x (Q5_1, 32 rows), ~1.3-2.5x (the K-quants) faster;
    `tile=False` keeps the file's layout. Without the kernels (another device, no extension) the
    forward is the same arithmetic in torch: the activations rounded the kernels' way, the weight
    dequantized.
    """

    def __init__(self, segments: list[tuple[int, torch.Tensor]], in_features: int, bias: torch.Tensor | None,
                 output_sizes: tuple[int, ...], dtype: torch.dtype, tile: bool = True,
                 release_rows: ReleaseRows | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = output_sizes
        self.out_features = sum(rows.shape[0] for _, rows in segments)
        if self.out_features != sum(output_sizes):
            raise ValueError(f"BlockLinear: segments hold {self.out_features} rows, the layer has {sum(output_sizes)}")
        self.types: list[int] = []
        self.tile = tile
        for i, (t, rows) in enumerate(segments):
            t, rows = self._held(int(t), rows, release_rows)
            self.types.append(t)
            self.register_buffer(f"blocks{i}", rows, persistent=False)
        self.register_buffer("bias", bias)
        self.dtype = dtype
        self.float_x = False  # prompt work keeps x in float32 where block_kgemm would round it (FLOAT_X_LINEARS)

    @property
    def blocks(self) -> list[torch.Tensor]:
        return [self._buffers[f"blocks{i}"] for i in range(len(self.types))]  # type: ignore[misc]

    def _held(self, t: int, rows: torch.Tensor, release_rows: ReleaseRows | None = None) -> tuple[int, torch.Tensor]:
        """(type, rows) in the layout this module keeps a part in where `rows` are: tiled on the CPU
        (`tile`, where the type has tiles and the rows come in fours), the file's layout elsewhere
        (the tiles serve only the CPU kernels; untiling them at every forward on a GPU would be a
        round trip through the host). Tiles are made a chunk of rows at a time, `release_rows` told
        of each (COPY_CHUNK_BYTES; a tile's bytes depend on its own four rows only)."""
        if t & TILED:
            return (t, rows) if rows.is_cpu else block_untile(rows, t)
        if not (self.tile and block_tile_supported(t, rows)):
            return t, rows
        held, four = block_tile(rows[:KERNEL_TILE_ROWS], t)  # one tile tells the tiled width
        out = torch.empty(rows.shape[0], four.shape[1], dtype=four.dtype, device=four.device)
        for r0, r1 in _chunks(rows):
            block_tile(rows[r0:r1], t, out[r0:r1])
            if release_rows is not None:
                release_rows(rows[r0:r1])
        return held, out

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """Moved (.to), each part is re-laid for its new device once (`_held`)."""
        out = super()._apply(fn, recurse)
        for i, (t, rows) in enumerate(zip(self.types, self.blocks)):
            self.types[i], self._buffers[f"blocks{i}"] = self._held(t, rows)
        return out

    @property
    def tiled_parts(self) -> list[bool]:
        return [t & TILED != 0 for t in self.types]

    def file_blocks(self) -> list[tuple[int, torch.Tensor]]:
        """(GGML type, rows as the file stores them) per segment: tiled ones untiled."""
        return [block_untile(rows, t) if t & TILED else (t, rows) for t, rows in zip(self.types, self.blocks)]

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: the weight the blocks stand for (loader/dequant.py, bit-exact)."""
        return torch.cat([dequantize(rows, t, (rows.shape[0], self.in_features)) for t, rows in self.file_blocks()])

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), in]: rows of the weight (token lookups of a tied head; one segment)."""
        if len(self.types) != 1:
            raise ValueError("BlockLinear.dequantize_rows: only a one-segment weight (an LM head) has token rows")
        t, blocks = self.types[0], self.blocks[0]
        flat = ids.reshape(-1).to(blocks.device)
        if t & TILED:  # the ids' tiles, untiled, then each id's row of its tile
            width = blocks.shape[1]
            t, four = block_untile(blocks.view(-1, 4 * width).index_select(0, flat // 4).reshape(-1, width), t)
            rows = four.view(-1, 4, width)[torch.arange(len(flat), device=blocks.device), flat % 4]
        else:
            rows = blocks.index_select(0, flat)
        return dequantize(rows, t, (rows.shape[0], self.in_features)).to(ids.device)

    plan_rows = BLOCK_KERNEL_MAX_ROWS  # forward calls block_gemm up to this many rows (runtime/decode_plan.py)

    def plan_op(self) -> LinearOp | None:
        """block_gemm over the segments as they are held (tiles included)."""
        if self.dtype != torch.float32 or not block_kernel_supported(self.types) or not self.blocks[0].is_cpu:
            return None
        return (KIND_BLOCKS, self.blocks, self.types, None, self._buffers["bias"], self.in_features, 0, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        bias = self._buffers["bias"]
        if trains(flat):  # the kernels have no backward: torch's ops on the same weights (stream training)
            y = F.linear(flat.float(), self.dequantize().to(flat.device), bias)
        elif block_kernel_supported(self.types, flat) and self.blocks[0].is_cpu:
            if flat.shape[0] > BLOCK_KERNEL_MAX_ROWS and (
                    block_dequantize_supported() or all(block_kgemm_supported(t) for t in self.types)):
                y = self._batched(flat.float(), bias)
            else:
                y = block_gemm(flat, self.blocks, self.types, bias)
        else:
            y = F.linear(quantize_act_blocks(flat, "int8"), self.dequantize().to(flat.device), bias)
        if y.dtype != self.dtype:
            y = y.to(self.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])

    def _batched(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T (+ bias) for many rows of x: with AMX-BF16, bf16 tiles of W in torch's GEMM
        (`_bf16_tiles`); else K-quant tiles by integer dot products on x quantized per 128 columns
        (block_kgemm) unless float GEMMs are as fast here (kernels.float_prompt_tiles) or the layer's
        inputs carry outliers (`float_x`); the other types, and then every type, with W made float a
        tile of rows at a time (never the whole matrix)."""
        if bf16_tiles_supported():
            y = self._bf16_tiles(x)
            return y if bias is None else y.add_(bias)
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        integer = not (float_prompt_tiles() or (self.float_x and block_dequantize_supported()))
        first, kparts = 0, []
        for t, rows in zip(self.types, self.blocks):
            if integer and block_kgemm_supported(t):
                kparts.append((t, rows, first))
            else:
                for r0 in range(0, rows.shape[0], TILE_ROWS):
                    r1 = min(rows.shape[0], r0 + TILE_ROWS)
                    y[:, first + r0:first + r1] = x @ block_dequantize(rows, t, self.in_features, r0, r1).t()
            first += rows.shape[0]
        if kparts:
            block_kgemm(x, kparts, y)
        return y if bias is None else y.add_(bias)

    def _bf16_tiles(self, x: torch.Tensor) -> torch.Tensor:
        """float32 x @ W^T, x and each weight tile rounded to bfloat16, products summed in float32 and
        rounded to bfloat16 (oneDNN): every segment's rows dequantized straight to bf16 a tile at a
        time into one buffer (never the whole matrix), x in chunks of BF16_ROW_CHUNK rows."""
        m, inp = x.shape[0], self.in_features
        step = max(4, min(BF16_TILE_MAX_ROWS, BF16_TILE_BYTES // (2 * inp)) // 4 * 4)  # whole tiles of 4 rows
        xb = pad_rows(x, BF16_ROW_CHUNK, torch.bfloat16)
        y = torch.empty(xb.shape[0], self.out_features, dtype=torch.float32)
        buf = torch.empty(min(step, max(rows.shape[0] for rows in self.blocks)) * inp, dtype=torch.bfloat16)
        first = 0
        for t, rows in zip(self.types, self.blocks):
            for r0 in range(0, rows.shape[0], step):
                r1 = min(rows.shape[0], r0 + step)
                w = block_dequantize_bf16(rows, t, inp, r0, r1, buf[:(r1 - r0) * inp].view(r1 - r0, inp)).t()
                for c in range(0, xb.shape[0], BF16_ROW_CHUNK):
                    y[c:c + BF16_ROW_CHUNK, first + r0:first + r1] = xb[c:c + BF16_ROW_CHUNK] @ w
            first += rows.shape[0]
        return y[:m]

    def extra_repr(self) -> str:
        names = "+".join(GGMLQuantizationType(t & ~TILED).name + ("x4" if t & TILED else "") for t in self.types)
        return f"in={self.in_features}, out={self.output_sizes}, gguf {names}"


class BlockEmbedding(QuantizedLinear):
    """An untied token embedding kept in its GGUF blocks: a lookup dequantizes only its rows."""

    def __init__(self, ggml_type: int, rows: torch.Tensor, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.ggml_type, self.hidden = int(ggml_type), hidden
        self.register_buffer("blocks", rows, persistent=False)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.blocks.index_select(0, flat.to(self.blocks.device))
        out = dequantize(rows, self.ggml_type, (rows.shape[0], self.hidden)).to(device=ids.device, dtype=self.dtype)
        return out.reshape(*ids.shape, self.hidden)
