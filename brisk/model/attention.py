"""Attention backends: exact softmax attention over a KV cache the runtime owns.

The model never holds a cache (habit 3). Each forward receives an `AttentionMetadata` that knows
where this step's keys and values go and which cached ones each query may see; the attention layer
calls `attn_metadata.attend(layer, q, k, v)`. A backend is a metadata class plus the cache layout
it expects; the runner picks one at start-up.

`ContiguousAttention` (this file) keeps each sequence's KV contiguous in a slot of a
`[max_seqs, num_kv_heads, max_len, head_dim]` tensor, the vAttention layout: attention reads a
plain strided view, no gather. The engine uses the paged backend (model/paged_attention.py);
this one is the simple alternative behind runtime/model_runner.py and the reference in tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

KVCache = tuple[torch.Tensor, torch.Tensor]  # (keys, values), one pair per layer


class AttentionMetadata(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0) -> torch.Tensor:
        """Store `k`, `v` for this step and return attention output shaped like `q`.

        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].
        `window` > 0 (a sliding layer): the query at position p sees keys p - window + 1 .. p.
        """
        ...


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's share of the flat token batch.

    ```
    cache slot `slot`:  [ 0 .......... start-1 | start ... start+num_tokens-1 | free ]
                          already computed        written this step
    flat batch:         [ ... | query_start ... query_start+num_tokens-1 | ... ]
    ```
    """

    slot: int
    start: int
    num_tokens: int
    query_start: int


def _causal_mask(start: int, num_tokens: int, device: torch.device) -> torch.Tensor | None:
    """Mask for queries at positions start.. over keys 0..start+num_tokens-1; None when not needed."""
    if num_tokens == 1 or start == 0:
        return None  # one query sees everything; a fresh prompt uses SDPA's own causal path
    q_pos = torch.arange(start, start + num_tokens, device=device)
    k_pos = torch.arange(start + num_tokens, device=device)
    return k_pos[None, :] <= q_pos[:, None]  # [num_tokens, start + num_tokens]


def window_keys(kv_len: int, num_tokens: int, window: int) -> int:
    """The first key any of the last `num_tokens` queries of `kv_len` positions sees through a
    sliding `window` (0: no window, key 0)."""
    return max(0, kv_len - num_tokens - window + 1) if window else 0


def window_mask(kv_len: int, num_tokens: int, window: int, device: torch.device) -> torch.Tensor | None:
    """For the last `num_tokens` of `kv_len` positions through a sliding `window`: the mask over
    keys window_keys(...)..kv_len-1, causal and each query's last `window` positions only; None
    when plain causal masking from the first key is enough (one query, or a window that covers
    every key: the caller's causal mask then serves)."""
    first = window_keys(kv_len, num_tokens, window)
    if num_tokens == 1 or not (first or (window and kv_len > window)):
        return None
    q_pos = torch.arange(kv_len - num_tokens, kv_len, device=device)[:, None]
    k_pos = torch.arange(first, kv_len, device=device)[None, :]
    return (k_pos <= q_pos) & (k_pos > q_pos - window)  # [num_tokens, kv_len - first]


@dataclass
class ContiguousAttention:
    """Metadata for the contiguous (one slot per sequence) KV layout."""

    kv_caches: list[KVCache]
    seqs: list[SeqSpan]
    masks: list[torch.Tensor | None] = field(default_factory=list)
    scale: float | None = None  # None: SDPA's 1/sqrt(head_dim)

    def __post_init__(self) -> None:
        if not self.masks:
            device = self.kv_caches[0][0].device
            self.masks = [_causal_mask(s.start, s.num_tokens, device) for s in self.seqs]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer]  # [max_seqs, n_kv, max_len, head_dim]
        if len(self.seqs) == 1:
            return self._attend_one(self.seqs[0], self.masks[0], q, k, v, k_cache, v_cache, window)
        out = torch.empty_like(q)
        for span, mask in zip(self.seqs, self.masks):
            rows = slice(span.query_start, span.query_start + span.num_tokens)
            out[rows] = self._attend_one(span, mask, q[rows], k[rows], v[rows], k_cache, v_cache, window)
        return out

    def _attend_one(self, span: SeqSpan, mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, window: int) -> torch.Tensor:
        n, num_heads, head_dim = q.shape
        num_kv = k.shape[1]
        end = span.start + n
        k_cache[span.slot, :, span.start:end] = k.transpose(0, 1)  # [n_kv, n, head_dim]
        v_cache[span.slot, :, span.start:end] = v.transpose(0, 1)
        first = window_keys(end, n, window)  # keys before it are outside every query's window
        windowed = window_mask(end, n, window, q.device) if window else None
        mask = mask if windowed is None else windowed
        keys = k_cache[span.slot:span.slot + 1, :, first:end]  # [1, n_kv, end - first, head_dim]
        values = v_cache[span.slot:span.slot + 1, :, first:end]
        if n == 1:
            # GQA without copies: the query heads of one KV head become that head's query rows.
            qg = q.view(1, num_kv, num_heads // num_kv, head_dim)
            out = F.scaled_dot_product_attention(qg, keys, values, scale=self.scale)  # [1, n_kv, group, head_dim]
            return out.reshape(1, num_heads, head_dim)
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, num_heads, n, head_dim]
        out = F.scaled_dot_product_attention(
            qh, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=num_kv != num_heads, scale=self.scale
        )  # [1, num_heads, n, head_dim]
        return out[0].transpose(0, 1)


@dataclass
class WholeSequences:
    """Whole sequences laid end to end in the flat batch, each attending causally within itself,
    no KV kept: training and scoring where nothing is decoded after (compress/distill.py). Nothing
    is written in place, so autograd can run through it (a contiguous cache written sequence after
    sequence would invalidate the keys saved for backward)."""

    lengths: list[int]
    scale: float | None = None  # None: SDPA's 1/sqrt(head_dim)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0) -> torch.Tensor:
        n, num_heads, head_dim = q.shape
        gqa = k.shape[1] != num_heads
        if len(set(self.lengths)) == 1:  # equal lengths: one batched call
            b, t = len(self.lengths), self.lengths[0]
            qh, kh, vh = (x.view(b, t, x.shape[1], head_dim).transpose(1, 2) for x in (q, k, v))
            out = self._sdpa(qh, kh, vh, t, window, gqa)  # [b, heads, t, head_dim]
            return out.transpose(1, 2).reshape(n, num_heads, head_dim)
        outs, start = [], 0
        for t in self.lengths:
            qh, kh, vh = (x[start:start + t].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            outs.append(self._sdpa(qh, kh, vh, t, window, gqa)[0].transpose(0, 1))
            start += t
        return torch.cat(outs)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: int, window: int, gqa: bool) -> torch.Tensor:
        mask = window_mask(t, t, window, q.device) if window else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa,
                                              scale=self.scale)
