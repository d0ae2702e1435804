"""Draft-model proposals: a smaller (or quantized) brisk model with the target's tokenizer runs k
batched decode steps ahead of the target, with its own paged KV cache.

Per request the draft keeps a shadow sequence: the tokens whose KV its cache holds. Each step it
first catches up on what the target emitted since (the accepted drafts it may already hold are
kept, the rejected ones dropped by comparing token lists), then drafts:

    pass 1   every request: [uncomputed known tokens] -> d1      (a whole prompt the first time)
    pass j   requests still drafting: [d(j-1)] -> dj             (one token each, batched)

The shadow's known tokens are the target's, so its full blocks go to the draft's own prefix cache
exactly as the target's do; draft tokens are never published. Greedy requests draft the argmax;
sampled ones draw from the draft's distribution with the request's generator and hand it to the
verifier as q, which keeps the result exact and raises acceptance to sum(min(p, q)).

With a draft vocabulary (FR-Spec) the draft's head projects onto its N most frequent tokens only:
for a small draft the head is most of a pass (SmolLM2's 49,152 x 576 is 28M of a 10-layer
student's 64M parameters), and q is zero outside the subset, which the verifier handles exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from brisk.request import Request, SamplingParams
from brisk.core.outputs import ScheduledRequest
from brisk.speculative.base import Draft, DraftRequest, Proposer, pick_draft_token
from brisk.model.base import CausalLM
from brisk.speculative.heads import DraftVocab, read_draft_vocab
from brisk.speculative.registry import ProposerContext, register


class _Pool(Protocol):
    def uncache(self, block_ids: set[int]) -> None: ...


class DraftKV(Protocol):
    """The draft's block manager (core.kv_cache_manager.KVCacheManager)."""

    pool: _Pool

    def get_computed_blocks(self, request: Request) -> tuple[list[list[int]], int]: ...
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[list[int]] = ...) -> list[list[int]] | None: ...
    def free(self, request: Request) -> None: ...


class DraftRunner(Protocol):
    """The draft's forward (runtime.paged_runner.PagedModelRunner): last-row logits per request,
    projected by `head` when given."""

    def execute(self, steps: list, all_rows_for: frozenset[str] = ...,
                head: Callable[[torch.Tensor], torch.Tensor] | None = ...) -> object: ...


@dataclass
class _Shadow:
    request: Request  # prompt_token_ids: the target's known tokens; num_computed_tokens: KV held
    cached: list[int] = field(default_factory=list)  # the tokens whose KV the draft cache holds, in order


class DraftModelProposer(Proposer):
    name = "draft"

    def __init__(self, runner: DraftRunner, kv: DraftKV, draft_cost: float, vocab: DraftVocab | None = None) -> None:
        self.runner = runner
        self.kv = kv
        self.draft_cost = draft_cost
        self.vocab = vocab  # FR-Spec: draft among these tokens only (a fraction of the head's cost)
        self._shadows: dict[str, _Shadow] = {}

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        steps = {r.request_id: self._catch_up(r) for r in requests}
        try:
            return self._draft(requests, steps)
        except BaseException:
            # Blocks published at catch-up hold no valid KV: out of the draft's prefix cache, and
            # these requests start over (the engine aborts them; this keeps the draft pool clean).
            self.kv.pool.uncache({b for step in steps.values() if step is not None
                                  for table in step.block_ids for b in table if b >= 0})
            for rid in steps:
                self.release(rid)
            raise

    def _draft(self, requests: list[DraftRequest], steps: dict[str, ScheduledRequest | None]) -> list[Draft]:
        tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in requests}
        by_id = {r.request_id: r for r in requests}
        active = [rid for rid, step in steps.items() if step is not None]
        for j in range(max((r.num_drafts for r in requests), default=0)):
            if not active:
                break
            out = self.runner.execute([steps[rid] for rid in active],
                                      head=None if self.vocab is None else self.vocab.logits)
            logits = out.last_rows(active)  # [len(active), vocab]
            for row, rid in enumerate(active):
                token, q = pick_draft_token(logits[row], by_id[rid])
                tokens[rid].append(token)
                if q is not None:
                    probs[rid].append(q)
            active = [rid for rid in active if len(tokens[rid]) < by_id[rid].num_drafts]
            for rid in active:  # the next pass feeds the token just drafted
                step = steps[rid]
                assert step is not None
                step.start_pos += len(step.token_ids)
                step.token_ids = [tokens[rid][-1]]
        for rid, toks in tokens.items():
            if toks:
                shadow = self._shadows[rid]
                shadow.cached.extend(toks[:-1])  # the last draft was never fed
                shadow.request.num_computed_tokens = len(shadow.cached)
        return [Draft(tokens[r.request_id], torch.stack(probs[r.request_id]) if probs[r.request_id] else None)
                for r in requests]

    def _catch_up(self, r: DraftRequest) -> ScheduledRequest | None:
        """Sync the shadow with the target's tokens and reserve slots for this step's passes;
        None when the draft's pool is full (the request then goes without drafts this step)."""
        shadow = self._shadows.get(r.request_id)
        if shadow is None:
            shadow = self._shadows[r.request_id] = _Shadow(Request(r.request_id, list(r.token_ids), SamplingParams()))
            hit_ids, num_hit = self.kv.get_computed_blocks(shadow.request)
            hit_ids = hit_ids if num_hit else []
            shadow.cached = list(r.token_ids[:num_hit])
        else:
            hit_ids = []
            known = shadow.request.prompt_token_ids
            old = len(known)
            known.extend(r.token_ids[old:])
            # The cache holds the old known tokens, then drafts: keep the drafts the target
            # accepted, drop the rest (t_last, the newest known token, is never counted computed).
            limit = min(len(shadow.cached), len(known) - 1)
            keep = min(old, limit)
            while keep < limit and shadow.cached[keep] == known[keep]:
                keep += 1
            del shadow.cached[keep:]
        # shadow.cached is a prefix of the known tokens, now also of the computed count
        shadow.request.num_computed_tokens = 0 if hit_ids else len(shadow.cached)
        todo = r.token_ids[len(shadow.cached):]  # >= 1 token: t_last is never in the cache
        blocks = self.kv.allocate_slots(shadow.request, len(todo) + r.num_drafts - 1, hit_ids)
        if blocks is None:
            self.release(r.request_id)
            return None
        shadow.request.num_computed_tokens = len(shadow.cached)
        shadow.cached.extend(todo)
        return ScheduledRequest(r.request_id, list(todo), len(shadow.cached) - len(todo), blocks, sample=True)

    def release(self, request_id: str) -> None:
        shadow = self._shadows.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow.request)


@register("draft")
def build(ctx: ProposerContext) -> DraftModelProposer:
    config, draft = ctx.config, ctx.draft_model
    assert draft is not None, "method draft needs the loaded draft model"
    runner, kv = ctx.draft_runtime(draft)
    vocab = None if config.draft_vocab is None else read_draft_vocab(
        config.draft_vocab_file or str(config.model), config.draft_vocab, draft)
    return DraftModelProposer(runner, kv, weight_ratio(draft, ctx.target, vocab), vocab)


def weight_ratio(draft: CausalLM, target: torch.nn.Module, vocab: DraftVocab | None = None) -> float:
    """A first guess of the draft's cost per pass (refined from timings as steps run): its weight
    bytes over the target's (with a draft vocabulary, its rows instead of the head), floored for
    the per-pass overhead that does not shrink with size."""
    def nbytes(m: torch.nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
    size = nbytes(draft)
    if vocab is not None:  # a pass reads the subset's rows, not the head (a tied one: the embedding's lookups)
        head = draft.lm_head if draft.lm_head is not None else draft.embed_tokens  # type: ignore[attr-defined]
        size += vocab.nbytes - nbytes(head)
    return max(0.2, size / max(1, nbytes(target)))
