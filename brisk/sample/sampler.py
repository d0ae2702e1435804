"""Pick the next token of each row of a logits batch.

Greedy rows take the argmax. Sampled rows apply temperature, then top-k, then top-p, and draw
with their own `torch.Generator`, so a seeded request gives the same tokens whatever else shares
its batch (each row's randomness comes from its generator alone).
"""

from __future__ import annotations

import torch

from brisk.request import SamplingParams


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's `top_k` largest logits (0 = keep all). logits: [B, V], top_k: [B]."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = logits.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1).unsqueeze(-1))  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches `top_p` (the top token always stays)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [B, V] probability of strictly better tokens
    drop_sorted = mass_before >= top_p.unsqueeze(-1)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           banned: list[list[int]] | None = None) -> list[int]:
    """logits: [B, vocab] float32 -> one token id per row.

    `banned[i]` lists token ids row i may not produce now (EOS before `min_tokens`).
    """
    if banned and any(banned):
        logits = logits.clone()
        for row, ids in enumerate(banned):
            if ids:
                logits[row, ids] = float("-inf")
    greedy = [p.greedy for p in params]
    if all(greedy):
        return logits.argmax(dim=-1).tolist()
    device = logits.device
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
    scaled = logits / temps.unsqueeze(-1)
    if any(p.top_k > 0 for p in params):
        scaled = _apply_top_k(scaled, torch.tensor([p.top_k for p in params], device=device))
    if any(p.top_p < 1.0 for p in params):
        scaled = _apply_top_p(scaled, torch.tensor([p.top_p for p in params], device=device))
    probs = scaled.softmax(dim=-1)  # [B, vocab]
    out: list[int] = []
    argmax = logits.argmax(dim=-1).tolist()
    for row, gen in enumerate(generators):
        if greedy[row]:
            out.append(argmax[row])
        else:
            out.append(int(torch.multinomial(probs[row], 1, generator=gen)))
    return out
