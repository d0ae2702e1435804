"""Paged attention: exact attention over a KV cache made of fixed-size blocks.

Cache, per layer: keys `[num_blocks, num_kv_heads, head_dim, block_size]` (transposed, so the
kernel scores a whole block with broadcast FMAs) and values `[num_blocks, num_kv_heads,
block_size, head_dim]`. A sequence's tokens live in the blocks of its block table, in order.
The runner lays the flat batch out as

    [ kernel spans: decodes and short chunks | long prefill chunks ]

With several KV groups (core/kv_groups.py) each group has its own block tables and slots: a
layer reads and writes through its group's (`layer_group`); the layout of the batch is shared.

Kernel spans (up to `KERNEL_MAX_QUERY` new tokens each) go to one call of brisk's C++ kernel,
which reads keys and values straight from their blocks. Long chunks are compute-bound: their
blocks are gathered once into a contiguous copy and go through SDPA's flash path, where a GEMM
beats a row-at-a-time kernel. On CUDA the short spans go through one padded SDPA call instead of
the CPU kernel (`PaddedSpans`): a handful of launches per layer whatever the batch size, where a
loop over sequences would be launch-bound. Without the extension on CPU every span takes the
gather path: the same numbers, fewer tokens/s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from brisk.kernels import CAPS, kv_store, kv_store_supported, paged_attention
from brisk.model.attention import KVCache, window_keys, window_mask

KERNEL_MAX_QUERY = 16  # spans with at most this many new tokens use the paged kernel
HAVE_PAGED_KERNEL = CAPS.has("paged_attention")  # every ISA level: AVX-512 blocks, portable C++ otherwise


@dataclass(frozen=True)
class GatherSpan:
    """A span attended through gather + SDPA."""

    query_start: int
    num_tokens: int
    kv_len: int  # cached + new tokens
    block_ids: list[torch.Tensor]  # per KV group: [ceil(kv_len / block_size)] long (empty with first_block)
    mask: torch.Tensor | None  # [num_tokens, kv_len] bool, None when SDPA's own causal mask fits
    # set: the blocks are first_block, first_block + 1, ... (a virtual layout's row): read as one
    # slice, no gather (one group only)
    first_block: int | None = None


@dataclass(frozen=True)
class PaddedSpans:
    """The short spans as one padded batch: `[num_spans, max_query]` queries over
    `[num_spans, max_blocks * block_size]` keys, built once per step."""

    block_tables: list[torch.Tensor]  # per KV group: [S, max_blocks] long, padded with its first block (masked out)
    rows: torch.Tensor  # [num_short_tokens] long: flat token -> span * max_query + offset
    max_query: int
    mask: torch.Tensor  # [S, 1, max_query, max_blocks * block_size] bool
    query_pos: torch.Tensor  # [S, 1, max_query, 1] long: each query's position (padding: its span's last)
    key_pos: torch.Tensor  # [1, 1, 1, max_blocks * block_size] long

    def windowed(self, window: int) -> torch.Tensor:
        """`mask` limited to each query's last `window` positions."""
        return self.mask & (self.key_pos > self.query_pos - window)


def padded_spans(block_tables: list[list[list[int]]], query_lens: list[int], kv_lens: list[int], block_size: int,
                 device: torch.device) -> PaddedSpans:
    """`block_tables`: per KV group, one padded table per span."""
    max_q = max(query_lens)
    rows = [s * max_q + i for s, n in enumerate(query_lens) for i in range(n)]
    kv = torch.tensor(kv_lens, device=device)[:, None, None]  # [S, 1, 1]
    start = kv - torch.tensor(query_lens, device=device)[:, None, None]
    key_pos = torch.arange(len(block_tables[0][0]) * block_size, device=device)[None, None, :]
    query_off = torch.arange(max_q, device=device)[None, :, None]
    # causal within the span and nothing past the sequence; a padding query row (offset >= its
    # span's length) sees every valid key, so it never softmaxes an empty row into NaN
    mask = (key_pos < kv) & (key_pos <= start + query_off)  # [S, max_q, keys]
    query_pos = torch.minimum(start + query_off, kv - 1)  # [S, max_q, 1]
    return PaddedSpans([torch.tensor(t, dtype=torch.long, device=device) for t in block_tables],
                       torch.tensor(rows, dtype=torch.long, device=device), max_q, mask.unsqueeze(1),
                       query_pos.unsqueeze(1), key_pos.unsqueeze(1))


@dataclass
class PagedAttention:
    """Attention metadata for one step over a paged cache (see module docstring)."""

    kv_caches: list[KVCache | None]  # per layer; None: a layer another pipeline stage holds
    slot_blocks: list[torch.Tensor]  # per KV group: [num_tokens] long, the block of each new token
    slot_offsets: torch.Tensor  # [num_tokens] long: its offset inside the block
    num_kernel_tokens: int  # the first tokens of the batch, served by the kernel
    block_tables: list[torch.Tensor]  # per KV group: [num_kernel_seqs, max_blocks] int32
    query_start: torch.Tensor  # [num_kernel_seqs + 1] int32
    kv_lens: torch.Tensor  # [num_kernel_seqs] int32
    gather_spans: list[GatherSpan]
    scale: float
    layer_group: list[int] | None = None  # per layer, its KV group; None: one group
    padded: PaddedSpans | None = None  # set: the short spans take the padded SDPA path, not the kernel
    # masks of sliding layers, built on the first such layer of the step: (span or -1, window) -> mask
    _window_masks: dict[tuple[int, int], torch.Tensor | None] = field(default_factory=dict)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer]  # [blocks, n_kv, hd, bs], [blocks, n_kv, bs, hd]
        g = 0 if self.layer_group is None else self.layer_group[layer]
        slot_blocks = self.slot_blocks[g]
        if kv_store_supported(k_cache) and k.stride(-1) == 1 and v.stride(-1) == 1:
            kv_store(k_cache, v_cache, k, v, slot_blocks, self.slot_offsets)
        else:
            k_cache[slot_blocks, :, :, self.slot_offsets] = k  # [num_tokens, n_kv, head_dim]
            v_cache[slot_blocks, :, self.slot_offsets] = v
        out = torch.empty_like(q)  # [num_tokens, heads, head_dim]
        nk = self.num_kernel_tokens
        if nk and self.padded is not None:
            mask = self.padded.mask if not window else self._mask(-1, window, lambda: self.padded.windowed(window))
            out[:nk] = _padded_attend(q[:nk], k_cache, v_cache, self.padded, g, mask, self.scale)
        elif nk:
            paged_attention(out[:nk], q[:nk].contiguous(), k_cache, v_cache, self.block_tables[g],
                            self.query_start, self.kv_lens, self.scale, window)
        for i, span in enumerate(self.gather_spans):
            rows = slice(span.query_start, span.query_start + span.num_tokens)
            first = window_keys(span.kv_len, span.num_tokens, window)
            mask = span.mask if span.num_tokens > 1 else None  # one query: every key it is given
            windowed = self._mask(i, window, lambda s=span: window_mask(s.kv_len, s.num_tokens, window, q.device)) \
                if window else None
            mask = mask if windowed is None else windowed
            blocks = span.block_ids[g] if span.first_block is None else span.first_block
            out[rows] = _gather_attend(q[rows], k_cache, v_cache, blocks, span.kv_len, first, mask, self.scale)
        return out

    def _mask(self, key: int, window: int, build: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        """A sliding layer's mask, built once per step and window."""
        if (key, window) not in self._window_masks:
            self._window_masks[(key, window)] = build()
        return self._window_masks[(key, window)]


def _padded_attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: PaddedSpans, group: int,
                   mask: torch.Tensor, scale: float) -> torch.Tensor:
    tables = p.block_tables[group]
    num_spans, width = tables.shape
    num_kv, block_size, head_dim = v_cache.shape[1:]
    num_heads = q.shape[1]
    num_keys = width * block_size
    keys = k_cache[tables].permute(0, 2, 1, 4, 3).reshape(num_spans, num_kv, num_keys, head_dim)
    values = v_cache[tables].transpose(1, 2).reshape(num_spans, num_kv, num_keys, head_dim)
    qp = q.new_zeros(num_spans * p.max_query, num_heads, head_dim)
    qp[p.rows] = q
    qp = qp.view(num_spans, p.max_query, num_heads, head_dim).transpose(1, 2)  # [S, heads, max_q, head_dim]
    out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=num_kv != num_heads)  # [S, heads, max_q, head_dim]
    return out.transpose(1, 2).reshape(num_spans * p.max_query, num_heads, head_dim)[p.rows]


def _gather_attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor | int,
                   kv_len: int, first: int, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The span's keys first..kv_len-1 (0.. unless a sliding window starts later) gathered from
    their blocks (an int: the first of consecutive blocks, sliced instead), through SDPA."""
    num_kv, block_size, head_dim = v_cache.shape[1:]
    n, num_heads, _ = q.shape
    skip = first - first // block_size * block_size
    if isinstance(block_ids, int):
        run = slice(block_ids + first // block_size, block_ids + -(-kv_len // block_size))
        k_rows, v_rows = k_cache[run], v_cache[run]  # views: the row is contiguous
    else:
        ids = block_ids[first // block_size:]  # blocks wholly before the window are not read (or held)
        k_rows, v_rows = k_cache.index_select(0, ids), v_cache.index_select(0, ids)
    k_blocks = k_rows.permute(1, 0, 3, 2)  # [n_kv, nb, bs, head_dim]
    v_blocks = v_rows.transpose(0, 1)  # [n_kv, nb, bs, head_dim]
    count = kv_len - first
    keys = k_blocks.reshape(1, num_kv, -1, head_dim)[:, :, skip:skip + count]  # [1, n_kv, count, head_dim]
    values = v_blocks.reshape(1, num_kv, -1, head_dim)[:, :, skip:skip + count]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
    out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, is_causal=mask is None and n > 1,
                                         enable_gqa=num_kv != num_heads, scale=scale)
    return out[0].transpose(0, 1)  # [n, heads, head_dim]


def causal_mask(num_tokens: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
    """Queries are the last `num_tokens` of `kv_len` positions; None when SDPA's is_causal is exact."""
    if num_tokens == kv_len:
        return None
    q_pos = torch.arange(kv_len - num_tokens, kv_len, device=device)
    return torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]  # [num_tokens, kv_len]
