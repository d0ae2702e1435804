"""Early-exit self-speculation: the target's first `exit_layer` layers, its final norm and LM head
(optionally through a trained exit head) draft k tokens; the full model verifies them.

The draft passes write the KV of their layers into the target's own cache, at the slots the
scheduler reserved after t_last: no second cache, no catch-up. The verify pass then rewrites those
layers' KV at the same positions before any attention reads it, so the draft's values are never
used by the target (nothing stale is read).
"""

from __future__ import annotations

from typing import Protocol

import torch

from brisk.errors import UserError
from brisk.model.base import CausalLM
from brisk.core.outputs import ScheduledRequest
from brisk.speculative.base import Draft, DraftRequest, Proposer, pick_draft_token
from brisk.speculative.heads import DraftVocab, ResidualHeads, load_heads
from brisk.speculative.registry import ProposerContext, register


class ExitRunner(Protocol):
    """runtime.paged_runner.PagedModelRunner.exit_hidden"""

    def exit_hidden(self, steps: list, num_layers: int) -> torch.Tensor: ...


class EarlyExitProposer(Proposer):
    name = "early_exit"

    def __init__(self, model: CausalLM, runner: ExitRunner, exit_layer: int,
                 head: ResidualHeads | None = None, vocab: DraftVocab | None = None) -> None:
        layers = model.config.num_hidden_layers
        if not 1 <= exit_layer < layers:
            raise UserError(f"exit_layer must be between 1 and {layers - 1} for a {layers}-layer model, got {exit_layer}")
        self.model = model
        self.runner = runner
        self.exit_layer = exit_layer
        self.head = head
        self.vocab = vocab
        self.draft_cost = exit_layer / layers  # refined from timings as steps run

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        steps = [ScheduledRequest(r.request_id, [r.token_ids[-1]], r.last_pos, r.block_ids, sample=True) for r in requests]
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))
        while active:
            hidden = self.runner.exit_hidden([steps[i] for i in active], self.exit_layer)  # [A, hidden]
            if self.head is not None:
                hidden = self.head(hidden)[:, 0]
            logits = self._project(hidden)  # [A, vocab]
            for row, i in enumerate(active):
                token, q = pick_draft_token(logits[row], requests[i])
                tokens[i].append(token)
                if q is not None:
                    probs[i].append(q)
                steps[i] = ScheduledRequest(steps[i].request_id, [token], steps[i].start_pos + 1, steps[i].block_ids,
                                            sample=True)
            active = [i for i in active if len(tokens[i]) < requests[i].num_drafts]
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits: over the heads' frequent-token subset when they bring one (a fraction of
        the LM head's cost), else the full LM head."""
        return self.vocab.logits(hidden) if self.vocab is not None else self.model.compute_logits(hidden)

    def release(self, request_id: str) -> None:
        pass  # the draft's KV lives in the target's blocks


@register("early_exit")
def build(ctx: ProposerContext) -> EarlyExitProposer:
    """The exit layer: the config's, else the one the heads file was trained for, else half the model."""
    config, model = ctx.config, ctx.target
    head, meta, vocab = (None, {}, None) if config.heads is None else load_heads(config.heads, "early_exit", model)
    trained_for = int(meta["exit_layer"]) if "exit_layer" in meta else None
    layer = config.exit_layer or trained_for or model.config.num_hidden_layers // 2
    if head is not None and trained_for is not None and layer != trained_for:
        raise UserError(f"the exit head in {config.heads!r} was trained at layer {trained_for}, not {layer}; "
                         "drop exit_layer or train a head for that layer")
    return EarlyExitProposer(model, ctx.runner, layer, head, vocab)
