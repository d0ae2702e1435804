"""Medusa: K heads on the target's last hidden state guess the K tokens after the next one.

After every step the proposer keeps, per request, the final hidden state of the row that produced
its newest token (for a verified request: the row of its last accepted draft). At the next step
head k turns it into a guess for the token k+1 places ahead, so all k drafts cost one small pass
(K residual blocks and K rows through the LM head) and no extra target layers. Sequential heads
(the default of `brisk train-heads`) run one after another, each also reading the token drafted
before its own (Hydra), which is what makes the later heads worth verifying. The drafts are
verified as a top-1 chain.
"""

from __future__ import annotations

import torch

from brisk.model.base import CausalLM
from brisk.speculative.base import Draft, DraftRequest, Proposer, pick_draft_token
from brisk.speculative.heads import DraftVocab, ResidualHeads, load_heads
from brisk.speculative.registry import ProposerContext, register


class MedusaProposer(Proposer):
    name = "medusa"
    observes_hidden = True  # the engine hands over each request's newest hidden state (observe)

    def __init__(self, model: CausalLM, heads: ResidualHeads, vocab: DraftVocab | None = None) -> None:
        self.model = model
        self.heads = heads
        self.vocab = vocab
        self.draft_cost = 0.05  # per draft token; refined from timings as steps run
        self._hidden: dict[str, torch.Tensor] = {}

    @property
    def max_drafts(self) -> int:
        return self.heads.num_heads

    def observe(self, request_id: str, hidden: torch.Tensor, position: int) -> None:
        self._hidden[request_id] = hidden  # the heads read the state alone, wherever it was

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        have = [i for i, r in enumerate(requests) if r.request_id in self._hidden]
        out = [Draft([]) for _ in requests]
        if not have:
            return out
        k_max = min(self.heads.num_heads, max(requests[i].num_drafts for i in have))
        hidden = torch.stack([self._hidden[requests[i].request_id] for i in have])  # [B, hidden]
        picks: list[list[tuple[int, torch.Tensor | None]]] = [[] for _ in have]
        if self.heads.sequential:
            # one head at a time: each reads the token just drafted (t_last for the first)
            g, last = hidden, [requests[i].token_ids[-1] for i in have]
            for k in range(k_max):
                emb = self.model.embed(torch.tensor(last, device=hidden.device))  # [B, hidden]
                g = self.heads.head(k, g, emb.to(g.dtype))
                logits = self._project(g)  # [B, vocab]
                for row, i in enumerate(have):
                    picks[row].append(pick_draft_token(logits[row], requests[i]))
                last = [p[-1][0] for p in picks]
        else:
            guesses = self.heads(hidden)[:, :k_max]  # [B, k, hidden]
            logits = self._project(guesses.reshape(-1, guesses.shape[-1])).view(len(have), k_max, -1)
            for row, i in enumerate(have):
                picks[row] = [pick_draft_token(logits[row, k], requests[i]) for k in range(k_max)]
        for row, i in enumerate(have):
            mine = picks[row][:requests[i].num_drafts]
            qs = [q for _, q in mine if q is not None]
            out[i] = Draft([t for t, _ in mine], torch.stack(qs) if qs else None)
        return out

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits: over the heads' frequent-token subset when they bring one (a fraction of
        the LM head's cost), else the full LM head."""
        return self.vocab.logits(hidden) if self.vocab is not None else self.model.compute_logits(hidden)

    def release(self, request_id: str) -> None:
        self._hidden.pop(request_id, None)


@register("medusa")
def build(ctx: ProposerContext) -> MedusaProposer:
    assert ctx.config.heads is not None  # SpecConfig requires them
    heads, _, vocab = load_heads(ctx.config.heads, "medusa", ctx.target)
    return MedusaProposer(ctx.target, heads, vocab)
