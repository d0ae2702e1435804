"""What every proposer speaks: one batch of draft requests in, one draft per request out.

The engine asks for drafts after scheduling, when each decoding request's block table already
covers its draft slots (`ScheduledRequest.num_spec_slots`), so a proposer that writes KV (early
exit, into the target's own cache) has somewhere to write it:

    position   ... p-1 | p = num_tokens - 1 | p+1 .. p+k
    token          ... | t_last (known)     | d1 .. dk   <- the proposer fills these
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from brisk.request import SamplingParams
from brisk.sample.sampler import draw, probabilities


@dataclass
class DraftRequest:
    """One request asking for up to `num_drafts` draft tokens this step."""

    request_id: str
    token_ids: list[int]  # every known token: prompt + output; the last one is t_last
    num_drafts: int  # k >= 1: the slots reserved after t_last
    block_ids: list[list[int]]  # the target's block tables (one per KV group), covering len(token_ids) + num_drafts slots
    params: SamplingParams
    generator: torch.Generator | None  # the request's own generator (None: the device default)

    @property
    def last_pos(self) -> int:
        return len(self.token_ids) - 1


@dataclass
class Draft:
    """Proposed tokens (possibly fewer than asked, possibly none) and the distribution each was
    drawn from: `probs` [len(token_ids), vocab], or None when every token was chosen
    deterministically (a point mass: n-gram lookup, greedy drafts)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """A source of draft tokens. `draft_cost`: one draft token's cost as a fraction of one target
    decode step (0 for a lookup), which the length controller weighs against acceptance.

    Proposers subclass this protocol, so the optional parts below keep their defaults unless a
    proposer says otherwise (the engine calls them on every proposer, never asks whether they exist)."""

    name: str
    draft_cost: float
    max_drafts: int | None = None  # most drafts one step can use (Medusa: one per head); None: no cap
    # draft classes (`draft_class`) whose drafts cost nothing to make (prompt lookup's matches): the
    # length controller prices them at 0 and the engine does not time them as the proposer's passes
    free_classes: frozenset[int] = frozenset()
    observes_hidden: bool = False  # True: `observe` gets each request's newest row after every step

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """One Draft per request, in order; never more than `num_drafts` tokens."""
        ...

    def release(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: drop whatever is kept for it."""
        ...

    def draft_class(self, request_id: str, token_ids: list[int]) -> tuple[int, int] | None:
        """For proposers that know before drafting how good a draft will be (ngram): a small int
        the length controller keeps separate acceptance statistics for, and how many tokens it
        could propose now (0: none, so no slots are reserved). None: one class, any length."""
        return None

    def fallback_class(self, request_id: str, token_ids: list[int]) -> tuple[int, int] | None:
        """When the length controller drafts nothing for a request's free class (a lookup whose
        matches of that length have stopped landing): another class to draft in instead, and how
        many tokens it could propose (`LookupFirst`: the wrapped method's); None: none."""
        return None

    def observe(self, request_id: str, hidden: torch.Tensor, position: int) -> None:
        """With `observes_hidden`: the row of the target that produced the request's newest token
        (its final hidden state, or the residual stream at the runner's `capture_layer`) and that
        row's position."""
        return None


def pick_draft_token(logits: torch.Tensor, r: DraftRequest) -> tuple[int, torch.Tensor | None]:
    """One draft token from a draft distribution's logits [vocab]: the argmax for a greedy request
    (a point mass), else a draw under the request's temperature / min-p / top-k / top-p with its
    own generator, returned with the distribution it came from (q for the verifier)."""
    if r.params.greedy:
        return int(logits.argmax()), None
    q = probabilities(logits.unsqueeze(0), [r.params])  # [1, vocab]
    return int(draw(q, [r.generator])[0]), q[0]
