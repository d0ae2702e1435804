"""Prompt lookup (n-gram) drafts: find the request's last n tokens earlier in its own tokens and
propose what followed them there. Free to compute, and strong wherever the output copies the
input (summaries, extraction, code edits).

Tries the longest n first (`prompt_lookup_max` down to `prompt_lookup_min`); among matches of one
n, the most recent wins, since recent context predicts best. Matching is a scan over the token
list in plain Python per request per step (numpy for long contexts); contexts here are at most a
few thousand tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from brisk.speculative.base import Draft, DraftRequest, Proposer
from brisk.speculative.registry import ProposerContext, register


def ngram_match(tokens: list[int] | np.ndarray, n_min: int, n_max: int, k: int) -> tuple[int, list[int]]:
    """(n, up to k tokens that followed the latest earlier occurrence of the longest matching
    suffix, of n tokens); (0, []) when no suffix of n_min or more tokens occurs earlier."""
    arr = np.asarray(tokens, dtype=np.int64)
    total = len(arr)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = arr[total - n:]
        # windows ending before the suffix itself: start s in [0, total - n - 1]
        windows = np.lib.stride_tricks.sliding_window_view(arr[:total - 1], n)  # [total - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # the token right after the match
            return n, arr[start:start + k].tolist()
    return 0, []


class NgramProposer(Proposer):
    """Draft class: the matched suffix's length n (a 4-token match predicts far better than a
    1-token one). The match found when the engine plans a step is kept for that step's proposal."""

    name = "ngram"
    draft_cost = 0.0

    def __init__(self, n_min: int, n_max: int, max_drafts: int = 15) -> None:
        self.n_min = n_min
        self.n_max = n_max
        self.max_drafts = max_drafts
        self._planned: dict[str, tuple[int, list[int]]] = {}  # request id -> (tokens seen, continuation)

    def draft_class(self, request_id: str, token_ids: list[int]) -> tuple[int, int]:
        n, follow = ngram_match(token_ids, self.n_min, self.n_max, self.max_drafts)
        self._planned[request_id] = (len(token_ids), follow)
        return n, len(follow)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft(self._continuation(r)[:r.num_drafts]) for r in requests]

    def _continuation(self, r: DraftRequest) -> list[int]:
        seen, follow = self._planned.pop(r.request_id, (-1, []))
        if seen == len(r.token_ids):
            return follow
        return ngram_match(r.token_ids, self.n_min, self.n_max, r.num_drafts)[1]

    def release(self, request_id: str) -> None:
        self._planned.pop(request_id, None)


class LookupFirst(Proposer):
    """Prompt lookup first, another proposer where it finds nothing (`"lookup_first": true`): a
    request whose last n tokens occur earlier in its own tokens drafts what followed them (free,
    and long when the output copies its input), any other request drafts with `inner` (a model's
    drafts: streams, heads, a draft model). Draft classes: the match length n (1..n_max) for
    lookups, 0 for `inner`'s drafts, so the length controller learns each source's acceptance
    apart and prices lookups at no cost. `inner` keeps everything it observes, so a step it skips
    loses it nothing (the streams and heads read each step's rows, a draft model catches up)."""

    def __init__(self, inner: Proposer, n_min: int, n_max: int) -> None:
        self.inner = inner
        self.lookup = NgramProposer(n_min, n_max)
        self.name = f"{inner.name}+lookup"
        self.draft_cost = inner.draft_cost
        self.max_drafts = self.lookup.max_drafts
        self.free_classes = frozenset(range(1, n_max + 1))
        self.observes_hidden = inner.observes_hidden
        self._inner_cap = inner.max_drafts or self.lookup.max_drafts

    def draft_class(self, request_id: str, token_ids: list[int]) -> tuple[int, int]:
        n, available = self.lookup.draft_class(request_id, token_ids)
        return (n, available) if n else (0, self._inner_cap)

    def fallback_class(self, request_id: str, token_ids: list[int]) -> tuple[int, int]:
        """A match too short to pay (the controller drafts 0 for its class): the method drafts."""
        self.lookup._planned[request_id] = (len(token_ids), [])  # propose then finds no lookup
        return 0, self._inner_cap

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        out = self.lookup.propose(requests)
        rest = [i for i, d in enumerate(out) if not d.token_ids]
        if rest:
            for i, draft in zip(rest, self.inner.propose([requests[i] for i in rest])):
                out[i] = draft
        return out

    def observe(self, request_id: str, hidden: torch.Tensor, position: int) -> None:
        self.inner.observe(request_id, hidden, position)

    def release(self, request_id: str) -> None:
        self.lookup.release(request_id)
        self.inner.release(request_id)


@register("ngram", parallel=True)  # reads only the request's tokens: drafts over parallel workers too
def build(ctx: ProposerContext) -> NgramProposer:
    return NgramProposer(ctx.config.prompt_lookup_min, ctx.config.prompt_lookup_max)
