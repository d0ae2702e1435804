"""Logit processors: each stage of the sampler as a batched tensor op over `[B, V]` logits.

Every function takes per-row settings as tensors (one value per row) and acts on all rows at
once; a row whose setting means "off" (penalty 1.0, bias none, top_k 0, top_p 1.0, min_p 0.0)
passes through bit-for-bit unchanged, so the sampler can run a stage on the whole batch as soon
as one row needs it and skip it entirely when none does.

Token-id lists (prompt, output, banned, biased) become padded `[B, L]` index tensors whose
padding is the id `V`, one past the vocabulary. Scattering into a `[B, V + 1]` buffer and
dropping the last column makes the padding vanish without any masking:

    ids     [[7, 3, 7], [2, V, V]]        scatter_add_ ones ->  counts [B, V + 1]
    counts  row 0: {3: 1, 7: 2}   row 1: {2: 1, V: 2}  -> [:, :V] drops the pad column
"""

from __future__ import annotations

import itertools

import torch


def padded_ids(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Pack ragged id lists into a `[B, max_len]` int64 tensor padded with `pad` (at least 1 column).

    Ids >= `pad` are clamped to `pad`, so tokens outside the vocabulary fall into the dropped column.
    """
    return padded(rows, pad, torch.int64, device).clamp_(max=pad)


def padded(rows: list[list[int]] | list[list[float]], pad: float, dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:
    """Pack ragged lists into a `[B, max_len]` tensor of `dtype` padded with `pad` (at least 1 column)."""
    lens = [len(r) for r in rows]
    width = max(max(lens, default=0), 1)
    lengths = torch.tensor(lens, dtype=torch.int64)  # [B]
    flat = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=dtype)  # [sum(lens)]
    out = torch.full((len(rows), width), pad, dtype=dtype)  # [B, L]
    out[torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)] = flat  # a boolean mask fills row-major
    return out.to(device, non_blocking=True)


def token_counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """ids: [B, L] padded with `vocab` -> [B, V] float32 count of each token per row."""
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def token_mask(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """ids: [B, L] padded with `vocab` -> [B, V] bool, True where the token occurs in the row."""
    mask = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)
    mask.scatter_(1, ids, True)
    return mask[:, :vocab]


def apply_logit_bias(logits: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """In place: logits[b, ids[b, j]] += values[b, j]. ids: [B, L] padded with V, values: [B, L]."""
    vocab = logits.shape[-1]
    bias = torch.zeros(logits.shape[0], vocab + 1, dtype=logits.dtype, device=logits.device)
    bias.scatter_add_(1, ids, values.to(logits.dtype))
    return logits.add_(bias[:, :vocab])


def apply_bans(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """In place: banned tokens (ids: [B, L] padded with V) get -inf and can never be drawn."""
    return logits.masked_fill_(token_mask(ids, logits.shape[-1]), float("-inf"))


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF `RepetitionPenaltyLogitsProcessor`: for tokens already seen (prompt + output), divide a
    positive logit by the penalty and multiply a negative one, so penalty > 1 always makes the
    token less likely. seen: [B, V] bool, penalty: [B] (1.0 = off, exact identity).
    """
    pen = penalty.unsqueeze(-1)  # [B, 1]
    penalised = torch.where(logits < 0, logits * pen, logits / pen)  # [B, V]
    return torch.where(seen, penalised, logits)


def apply_frequency_presence(logits: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor,
                             presence: torch.Tensor) -> torch.Tensor:
    """OpenAI style, in place: logits -= frequency * count + presence * (count > 0).

    counts: [B, V] occurrences of each token in the row's *output* (not the prompt);
    frequency, presence: [B] (0.0 = off).
    """
    penalty = counts * frequency.unsqueeze(-1) + (counts > 0).to(counts.dtype) * presence.unsqueeze(-1)  # [B, V]
    return logits.sub_(penalty)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below `min_p` times the row's top probability. min_p: [B] (0 = off)."""
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(-1)  # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Keep each row's `top_k` largest logits (0 = keep all; ties with the k-th are kept).

    top_k: [B]; `max_k` is the largest top_k in the batch, a Python int so no host sync is needed.
    """
    vocab = logits.shape[-1]
    max_k = min(max_k, vocab)
    k = top_k.clamp(max=max_k)  # [B]
    kth = logits.topk(max_k, dim=-1).values.gather(-1, (k - 1).clamp(min=0).unsqueeze(-1))  # [B, 1]
    drop = (logits < kth) & (k > 0).unsqueeze(-1)  # [B, V]
    return logits.masked_fill(drop, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches `top_p` (the top token
    always stays). top_p: [B] (1.0 = off: then nothing is dropped, even when rounding makes the
    cumulative sum reach 1 before the tail).
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [B, V] probability of strictly better tokens
    drop_sorted = (mass_before >= top_p.unsqueeze(-1)) & (top_p < 1.0).unsqueeze(-1)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
