"""How many draft tokens each request verifies next step.

A fixed `num_speculative_tokens` is simply that. Under "auto" each request keeps a Beta posterior
over the probability `a` that one draft token is accepted (as in Early-Exit Speculative Decoding,
EESD): every step it draws `a` from the posterior (Thompson sampling) and picks the k that
maximises tokens gained per unit of cost,

    E[tokens | a, k] = (1 - a^(k+1)) / (1 - a)        (Leviathan et al.)
    cost(k)          = 1 + (verify_cost + draft_cost) * k     (in target decode steps)

k = 0 (plain decoding) wins when the drawn `a` is low: speculation turns itself off for a request
whose drafts stop being accepted. The posterior forgets (counts decay by `DECAY` per update and,
while off, per step), so its spread grows back and a request whose text turns repetitive later is
tried again. A new request starts from what the engine has seen so far (all requests' evidence,
scaled down to `START_EVIDENCE` observations): requests of one workload behave alike, and a
uniform start would spend its first dozens of steps exploring.
"""

from __future__ import annotations

import random

from brisk.config import SpecConfig

PRIOR = (1.0, 1.0)  # uniform Beta(1, 1) over the acceptance probability
DECAY = 0.98  # weight kept by older observations at each new one: ~50 verify steps of memory
OFF_DECAY = 0.99  # per step while speculation is off for the request: ~70 steps to halve the evidence
START_EVIDENCE = 10.0  # observations' worth of the engine-wide posterior a new request starts with


def expected_tokens(a: float, k: int) -> float:
    """Tokens one verify step yields with k drafts, each accepted with probability a (i.i.d.)."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class DraftLength:
    """Per-request draft lengths (plain Python: the engine sets Request.num_spec_wanted from it)."""

    def __init__(self, cfg: SpecConfig, draft_cost: float, verify_cost: float, seed: int = 0,
                 max_k: int | None = None) -> None:
        self.auto = cfg.auto
        self.max_k = cfg.max_tokens if max_k is None else max_k
        self.step_cost = draft_cost + verify_cost  # of each extra draft token, in target decode steps
        self._posterior: dict[str, list[float]] = {}  # request id -> [alpha, beta]
        self._overall = list(PRIOR)  # every request's observations, decayed alike
        self._rng = random.Random(seed)

    def wanted(self, request_id: str) -> int:
        if not self.auto:
            return self.max_k
        post = self._posterior.get(request_id)
        if post is None:
            post = self._posterior[request_id] = self._start()
        a = self._rng.betavariate(post[0], post[1])
        k = self.best_k(a)
        if k == 0:
            self._decay(post, OFF_DECAY)
        return k

    def best_k(self, a: float) -> int:
        """The k in 0..max_k with the most tokens per unit of cost at acceptance rate a."""
        return max(range(self.max_k + 1), key=lambda k: expected_tokens(a, k) / (1.0 + self.step_cost * k))

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verify step of `num_drafts` drafts accepted the first `num_accepted`. Drafts after the
        first rejection say nothing about acceptance: the first rejection is one failure."""
        if num_drafts == 0:
            return
        post = self._posterior.get(request_id)
        if post is None:
            post = self._posterior[request_id] = self._start()
        for counts in (post, self._overall):
            self._decay(counts, DECAY)
            counts[0] += num_accepted
            counts[1] += 1.0 if num_accepted < num_drafts else 0.0

    def _start(self) -> list[float]:
        """A new request's posterior: the engine-wide one, holding at most START_EVIDENCE observations."""
        evidence = self._overall[0] + self._overall[1] - PRIOR[0] - PRIOR[1]
        scale = min(1.0, START_EVIDENCE / evidence) if evidence > 0 else 0.0
        return [PRIOR[0] + (self._overall[0] - PRIOR[0]) * scale, PRIOR[1] + (self._overall[1] - PRIOR[1]) * scale]

    @staticmethod
    def _decay(post: list[float], factor: float) -> None:
        # shrink the evidence towards the prior, never below it
        post[0] = PRIOR[0] + (post[0] - PRIOR[0]) * factor
        post[1] = PRIOR[1] + (post[1] - PRIOR[1]) * factor

    def acceptance(self, request_id: str) -> float | None:
        """The posterior mean, or None before any observation."""
        post = self._posterior.get(request_id)
        return None if post is None else post[0] / (post[0] + post[1])

    def forget(self, request_id: str) -> None:
        self._posterior.pop(request_id, None)
