"""One verifier for every proposer: keep what the target model itself would have produced.

For a request with drafts d1..dk the target scored k+1 positions in one forward: row j holds the
logits after t_last, d1..dj. Row j is processed exactly as the plain sampler would process it had
d1..dj been emitted (logit bias, bans until min_tokens, penalties over the history with d1..dj,
then temperature, min-p, top-k, top-p), so:

- greedy: accept the longest prefix of drafts equal to the argmax of their rows, then one more
  token: the argmax of the first row that disagreed, or of row k (the bonus) when none did;
- sampling: exact rejection sampling (Leviathan et al., Chen et al.): accept dj with probability
  min(1, p(dj) / q(dj)); at the first rejection draw from normalise(max(p - q, 0)); if all are
  accepted draw the bonus token from p of row k. Every emitted token is then distributed exactly
  as the target's p, whatever the draft (q a point mass for deterministic drafts: accept with
  probability p(d), else draw from p with d removed). Uniforms and draws come from the request's
  own generator, so a seeded request is reproducible.

A request under a grammar (structured outputs) has each row masked first, as the plain sampler
masks its one row: row j by the grammar's state after d1..dj. The first draft the grammar forbids
has probability 0 in its row, so it is rejected there (greedy: it cannot be the argmax; sampling:
u * q >= 0 = p), and the token chosen instead is drawn exactly as non-speculative constrained
decoding would draw it. Drafts are not cut at that point: for a drawn draft (q not a point mass)
the residual max(p - q, 0) at the rejection is what keeps the output distributed as p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from brisk.request import Request
from brisk.sample.logprobs import TokenLogprobs, token_logprobs
from brisk.sample.sampler import SamplingBatch, draw, penalise, probabilities
from brisk.sample.structured import Constraint, mask_draft_rows
from brisk.speculative.base import Draft


@dataclass
class VerifyOutput:
    token_ids: list[int]  # accepted drafts, then the correction or bonus token: 1..k+1 tokens
    num_accepted: int  # drafts kept
    logprobs: list[TokenLogprobs] | None  # one per token when the request asks for logprobs


def verify(logits: list[torch.Tensor], requests: list[Request], drafts: list[Draft],
           generators: list[torch.Generator | None],
           constraints: list[Constraint | None] | None = None) -> list[VerifyOutput]:
    """logits[i]: [1 + k_i, vocab] raw target logits for request i's t_last and its k_i drafts;
    constraints[i]: request i's grammar, or None. Logprobs are those of the masked rows."""
    if constraints and any(c is not None for c in constraints):
        logits = [rows if c is None else mask_draft_rows(rows, c, d.token_ids)
                  for rows, c, d in zip(logits, constraints, drafts)]
    penalised = _penalised_rows(logits, requests, drafts, generators)
    outs = []
    for rows, raw, req, draft, gen in zip(penalised, logits, requests, drafts, generators):
        if req.sampling_params.greedy:
            tokens, accepted = _greedy(rows, draft.token_ids)
        else:
            tokens, accepted = _rejection(probabilities(rows, [req.sampling_params] * rows.shape[0]), draft, gen)
        n = req.sampling_params.logprobs
        lps = None if n is None else token_logprobs(raw[:len(tokens)], torch.tensor(tokens, device=raw.device),
                                                    [n] * len(tokens))
        outs.append(VerifyOutput(tokens, accepted, lps))
    return outs


def _penalised_rows(logits: list[torch.Tensor], requests: list[Request], drafts: list[Draft],
                    generators: list[torch.Generator | None]) -> list[torch.Tensor]:
    """Stages 1-3 of the sampler on every row, row j seeing the drafts before it as emitted."""
    params, gens, outputs, prompts, banned = [], [], [], [], []
    history = any(r.sampling_params.uses_history for r in requests)
    for rows, req, draft, gen in zip(logits, requests, drafts, generators):
        for j in range(rows.shape[0]):
            params.append(req.sampling_params)
            gens.append(gen)
            banned.append(req.banned_token_ids(num_pending=j))
            if history:
                outputs.append(req.output_token_ids + draft.token_ids[:j])
                prompts.append(req.prompt_token_ids)
    batch = SamplingBatch(params, gens, outputs, prompts, banned if any(banned) else [])
    flat = penalise(torch.cat(logits) if len(logits) > 1 else logits[0], batch)  # [sum(1 + k_i), vocab]
    return list(flat.split([rows.shape[0] for rows in logits]))


def _greedy(rows: torch.Tensor, drafts: list[int]) -> tuple[list[int], int]:
    target = rows.argmax(dim=-1).tolist()  # [k + 1]
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target[accepted]:
        accepted += 1
    return drafts[:accepted] + [target[accepted]], accepted


def _rejection(p: torch.Tensor, draft: Draft, gen: torch.Generator | None) -> tuple[list[int], int]:
    """p: [k + 1, vocab] target probabilities; draft.probs: [k, vocab] or None (point masses)."""
    k = len(draft.token_ids)
    d = torch.tensor(draft.token_ids, dtype=torch.long, device=p.device)  # [k]
    p_d = p[:k].gather(1, d.unsqueeze(1)).squeeze(1)  # [k]
    q_d = torch.ones_like(p_d) if draft.probs is None else draft.probs.gather(1, d.unsqueeze(1)).squeeze(1)
    u = torch.rand(k, generator=gen, device=p.device)
    # u < p/q, written without a division: q_d > 0 for a token the draft actually drew
    rejected = (u * q_d >= p_d).tolist()
    accepted = rejected.index(True) if True in rejected else k
    if accepted == k:
        last = p[k]
    elif draft.probs is None:
        last = p[accepted].clone()
        last[draft.token_ids[accepted]] = 0.0  # max(p - onehot(d), 0): p without d
    else:
        last = (p[accepted] - draft.probs[accepted]).clamp_(min=0.0)
    total = last.sum()
    if not total > 0:  # p == q up to rounding: the residual is empty, p itself is the answer
        last, total = p[accepted], p[accepted].sum()
    token = draw((last / total).unsqueeze(0), [gen]).item()
    return draft.token_ids[:accepted] + [int(token)], accepted
