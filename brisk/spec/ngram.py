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

from brisk.spec.base import Draft, DraftRequest


def ngram_lookup(tokens: list[int] | np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
    arr = np.asarray(tokens, dtype=np.int64)
    total = len(arr)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = arr[total - n:]
        # windows ending before the suffix itself: start s in [0, total - n - 1]
        windows = np.lib.stride_tricks.sliding_window_view(arr[:total - 1], n)  # [total - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # the token right after the match
            return arr[start:start + k].tolist()
    return []


class NgramProposer:
    name = "ngram"
    draft_cost = 0.0

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft(ngram_lookup(r.token_ids, self.n_min, self.n_max, r.num_drafts)) for r in requests]

    def release(self, request_id: str) -> None:
        pass  # keeps nothing per request
