"""How many draft tokens each request verifies next step.

A fixed `num_speculative_tokens` is simply that. Under "auto" each request keeps Beta posteriors
over its drafts' acceptance (as in Early-Exit Speculative Decoding, EESD, with one refinement):
p1, that the first draft is accepted, and p2, that a draft is accepted once the one before it was.
Drafts come in runs (an n-gram match copies a whole span, a good draft model agrees for a while),
so p2 is usually well above p1, and one i.i.d. rate would undervalue long drafts. Every step it
draws p1 from its posterior (Thompson sampling; p2 too once p1 is high, see `wanted`) and picks
the k that maximises tokens gained per unit of cost:

    E[tokens | p1, p2, k] = 1 + p1 (1 - p2^k) / (1 - p2)     (= Leviathan et al.'s when p1 = p2)
    cost(k)               = 1 + verify(k) + draft_cost * k   (in target decode steps)

verify(k), the extra cost of scoring k more tokens in the target's forward, is not linear on a
CPU: the second row leaves the single-row streaming kernels, further rows then cost little. The
engine measures it at start-up (engine/speculative.py); without a measurement a linear 0.06 per
token is assumed. draft_cost is measured from the proposer's timings as steps run.

A proposer that can tell in advance how good its next draft will be (n-gram lookup: the length of
the matched suffix) passes a draft class with each request; every class keeps posteriors of its
own, per request and engine-wide. On this model's outputs a 4-token match starts an accepted run
87% of the time (7 tokens on average), a 1-token match 20% (under 1): one posterior for both
drafts short after a good match and too often after a poor one.

k = 0 (plain decoding) wins when the drawn p1 is low: speculation turns itself off for a request
whose drafts stop being accepted. The posteriors forget (counts decay by `DECAY` per update and,
while off, per step), so their spread grows back and a request whose text turns repetitive later
is tried again. A new request starts from what the engine has seen so far (all requests'
evidence, scaled down to `START_EVIDENCE` observations): requests of one workload behave alike,
and a uniform start would spend its first dozens of steps exploring.
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


def expected_run_tokens(p1: float, p2: float, k: int) -> float:
    """Tokens one verify step yields with k drafts: the first accepted with probability p1, each
    later one with probability p2 given the one before it was."""
    if k == 0:
        return 1.0
    if p2 >= 1.0:
        return 1.0 + p1 * k
    return 1.0 + p1 * (1.0 - p2 ** k) / (1.0 - p2)


class DraftLength:
    """Per-request draft lengths (plain Python: the engine passes them to Scheduler.schedule).
    `cls`: the proposer's draft class for this step (None: a proposer without classes)."""

    def __init__(self, cfg: SpecConfig, draft_cost: float, verify_costs: list[float], seed: int = 0,
                 max_k: int | None = None, free_classes: frozenset[int] = frozenset()) -> None:
        """`verify_costs[k]`: extra cost of verifying k drafts, in target decode steps (index 0..max_k);
        `free_classes`: draft classes whose drafts cost nothing to make (prompt lookup's)."""
        self.free_classes = free_classes
        self.auto = cfg.auto
        self.max_k = cfg.max_tokens if max_k is None else max_k
        assert len(verify_costs) > self.max_k and verify_costs[0] == 0.0
        self.verify_costs = verify_costs
        self.draft_cost = draft_cost  # of each draft token, in target decode steps (refined by the engine)
        # request id -> draft class -> [alpha1, beta1, alpha2, beta2]
        self._posterior: dict[str, dict[int | None, list[float]]] = {}
        self._overall: dict[int | None, list[float]] = {}  # every request's observations, decayed alike
        self._rng = random.Random(seed)

    def wanted(self, request_id: str, cls: int | None = None, cap: int | None = None) -> int:
        """Drafts for the request's next step, at most `cap` (the drafts its source has: a
        lookup's continuation, the method's streams), chosen among the lengths it can use."""
        if not self.auto:
            return self.max_k if cap is None else min(cap, self.max_k)
        post = self._counts(request_id, cls)
        # Thompson sampling on p1 (whether to draft at all). p2 is drawn too when the drawn p1 says
        # first drafts are mostly accepted, else taken at its mean: at its mean always, it never
        # learned (an accepted one-token draft is no trial of a second, so a request settled on
        # k = 1 kept p2 at its prior 0.5, for which k = 1 stays best: a draft model accepted 100%
        # of the time drafted one token a step), and drawn always, an untried p2 lengthens the
        # occasional try of drafts whose first token is rarely accepted.
        p1 = self._rng.betavariate(post[0], post[1])
        p2 = self._rng.betavariate(post[2], post[3]) if p1 >= 0.5 else post[2] / (post[2] + post[3])
        k = self.best_k(p1, p2, cls, cap)
        if k == 0:
            self._decay(post, OFF_DECAY)
        return k

    def best_k(self, p1: float, p2: float, cls: int | None = None, cap: int | None = None) -> int:
        """The k in 0..min(max_k, cap) with the most tokens per unit of cost (a best k past the
        cap, cut to it, could pay less than not drafting)."""
        top = self.max_k if cap is None else min(cap, self.max_k)
        return max(range(top + 1), key=lambda k: expected_run_tokens(p1, p2, k) / self.cost(k, cls))

    def cost(self, k: int, cls: int | None = None) -> float:
        """One step with k drafts of class `cls`, in plain decode steps."""
        per_draft = 0.0 if cls in self.free_classes else self.draft_cost
        return 1.0 + self.verify_costs[k] + per_draft * k

    def observe(self, request_id: str, num_drafts: int, num_accepted: int, cls: int | None = None) -> None:
        """A verify step of `num_drafts` drafts accepted the first `num_accepted`: one trial of the
        first draft, then one of each later draft that was reached (drafts after the first
        rejection were never tried)."""
        if num_drafts == 0:
            return
        post = self._counts(request_id, cls)
        first_ok = num_accepted >= 1
        later_ok = max(0, num_accepted - 1)
        later_failed = 1.0 if 1 <= num_accepted < num_drafts else 0.0
        for counts in (post, self._overall[cls]):
            self._decay(counts, DECAY)
            counts[0] += first_ok
            counts[1] += not first_ok
            counts[2] += later_ok
            counts[3] += later_failed

    def _counts(self, request_id: str, cls: int | None) -> list[float]:
        per_class = self._posterior.setdefault(request_id, {})
        if cls not in per_class:
            per_class[cls] = self._start(self._overall.setdefault(cls, list(PRIOR * 2)))
        return per_class[cls]

    @staticmethod
    def _start(overall: list[float]) -> list[float]:
        """A new request's posteriors of one class: the engine-wide ones, each holding at most
        START_EVIDENCE observations."""
        out = []
        for i in (0, 2):
            evidence = overall[i] + overall[i + 1] - 2 * PRIOR[0]
            scale = min(1.0, START_EVIDENCE / evidence) if evidence > 0 else 0.0
            out += [PRIOR[0] + (overall[i] - PRIOR[0]) * scale, PRIOR[1] + (overall[i + 1] - PRIOR[1]) * scale]
        return out

    @staticmethod
    def _decay(post: list[float], factor: float) -> None:
        # shrink the evidence towards the prior, never below it
        for i, prior in enumerate(PRIOR * 2):
            post[i] = prior + (post[i] - prior) * factor

    def forget(self, request_id: str) -> None:
        self._posterior.pop(request_id, None)
