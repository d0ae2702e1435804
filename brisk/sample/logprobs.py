"""Log-probabilities of chosen tokens (sampled or prompt), their rank and the top-N alternatives.

Which distribution: the model's raw one, `log_softmax(logits)` of the logits exactly as the model
produced them, before logit bias, bans, penalties, temperature, min-p, top-k and top-p. That is
vLLM v1's default (`logprobs_mode="raw_logprobs"`) and what OpenAI-style clients expect: the
numbers describe the model, not the request's sampling settings, so they are comparable across
requests and a token the sampler banned still has a finite logprob.

Rank is 1 + the number of tokens with a strictly larger logprob (1 = the most likely token; the
argmax ranks 1 even when tied).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PROMPT_CHUNK = 512  # prompt positions per log_softmax, bounding the [chunk, V] float32 temporary


@dataclass(frozen=True)
class TokenLogprobs:
    """The logprob of one chosen token and the `n` most likely tokens at that position."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first; len = requested N


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """logits: [R, V] raw model logits, token_ids: [R] the chosen token per row, num_top[r]: N for row r.

    One host transfer for the whole call.
    """
    if logits.shape[0] == 0:
        return []
    logprobs = logits.float().log_softmax(dim=-1)  # [R, V]
    chosen = logprobs.gather(-1, token_ids.view(-1, 1).to(logits.device))  # [R, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [R]
    max_n = max(num_top)
    if max_n > 0:
        top_vals, top_ids = logprobs.topk(min(max_n, logprobs.shape[-1]), dim=-1)  # [R, N] sorted, best first
        top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    ids_l, chosen_l, ranks_l = token_ids.tolist(), chosen.squeeze(-1).tolist(), ranks.tolist()
    out: list[TokenLogprobs] = []
    for r, n in enumerate(num_top):
        top = tuple(zip(top_ids_l[r][:n], top_vals_l[r][:n])) if n > 0 else ()
        out.append(TokenLogprobs(int(ids_l[r]), float(chosen_l[r]), int(ranks_l[r]), top))
    return out


def prompt_logprobs(logits: torch.Tensor, next_token_ids: torch.Tensor | list[int], n: int) -> list[TokenLogprobs]:
    """Per prompt position p: the logprob of the actual next prompt token given tokens <= p, its rank, top-n.

    logits: [P, V], the model's logits at P prompt positions; next_token_ids: [P], the prompt token
    that follows each position. The first prompt token has no logprob: a caller passes positions
    0..len-2 with next tokens 1..len-1. Computed in chunks of PROMPT_CHUNK rows to bound memory.
    """
    ids = torch.as_tensor(next_token_ids, dtype=torch.int64, device=logits.device)  # [P]
    assert ids.shape == logits.shape[:1], f"{tuple(ids.shape)} next tokens for {logits.shape[0]} positions"
    out: list[TokenLogprobs] = []
    for start in range(0, logits.shape[0], PROMPT_CHUNK):
        chunk = slice(start, start + PROMPT_CHUNK)
        out.extend(token_logprobs(logits[chunk], ids[chunk], [n] * ids[chunk].shape[0]))
    return out
