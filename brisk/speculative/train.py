"""Self-distillation of Medusa and early-exit heads on text the target itself generated.

The target's greedy continuations are its own argmax at every position, so they are exactly what
greedy verification compares drafts against. For each generated position t:

    medusa      head k (k = 1..K) reads the final hidden state at t, target token x[t+1+k]
    early_exit  the head reads the normed hidden state after `exit_layer` layers, target x[t+1]

Features are computed once (one forward per sequence), then the heads train on them with the
target's LM head frozen: AdamW, cross-entropy over the draft vocabulary (the rows of the LM head
drafts are chosen among; a token outside it can never be drafted), teacher forcing for
sequential heads, a held-out tenth of the sequences for the reported top-1 agreement.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from brisk.model.base import CausalLM, forward_sequence
from brisk.speculative.heads import ResidualHeads

IGNORE = -100


@dataclass(frozen=True)
class HeadTraining:
    kind: str  # "medusa" or "early_exit"
    num_heads: int = 4  # medusa; early_exit trains one
    exit_layer: int | None = None  # early_exit
    sequential: bool = True  # medusa: Hydra-style heads that read the drafted tokens
    epochs: int = 3
    lr: float = 1e-3
    batch_size: int = 256
    seed: int = 0


@dataclass
class Features:
    """Training rows: the hidden state at t, the tokens x[t+1..t+K] (sequential heads' inputs)
    and the targets x[t+2..t+K+1] (Medusa) or x[t+1] (exit head); IGNORE past a sequence's end."""

    hidden: torch.Tensor  # [N, hidden] float32
    inputs: torch.Tensor  # [N, K] long
    targets: torch.Tensor  # [N, K] long

    def __len__(self) -> int:
        return self.hidden.shape[0]


def features(model: CausalLM, sequences: list[tuple[list[int], int]], cfg: HeadTraining) -> Features:
    """Rows over the generated positions of (token ids, prompt length) pairs."""
    k = cfg.num_heads if cfg.kind == "medusa" else 1
    offset = 2 if cfg.kind == "medusa" else 1  # head 1 of Medusa guesses x[t+2]; an exit head x[t+1]
    layers = cfg.exit_layer if cfg.kind == "early_exit" else None
    xs, ins, ys = [], [], []
    for ids, prompt_len in sequences:
        n = len(ids)
        if n - prompt_len < 2:
            continue
        hidden = forward_sequence(model, ids, layers)  # [n, hidden]
        positions = range(prompt_len - 1, n - 1)  # t: the last prompt token onwards

        xs.append(hidden[prompt_len - 1:n - 1].float())
        ins.append(torch.tensor([[_at(ids, t + 1 + j, 0) for j in range(k)] for t in positions]))
        ys.append(torch.tensor([[_at(ids, t + offset + j, IGNORE) for j in range(k)] for t in positions]))
    return Features(torch.cat(xs), torch.cat(ins), torch.cat(ys))


def _at(ids: list[int], i: int, missing: int) -> int:
    return ids[i] if i < len(ids) else missing


class DraftRows:
    """The frozen LM head rows drafts are chosen among (the draft vocabulary; None: every token),
    float32 on `device` (default: the model's), and the map from target ids to those rows."""

    def __init__(self, model: CausalLM, vocab: torch.Tensor | None, device: torch.device | None = None) -> None:
        vocab_size = model.config.vocab_size
        self.vocab = torch.arange(vocab_size) if vocab is None else vocab.cpu()
        with torch.no_grad():
            self.weight = model.head_rows(self.vocab.to(model.device)).to(device or model.device)  # [N, hidden]
        self.index = torch.full((vocab_size,), IGNORE, dtype=torch.long)  # token id -> row, or IGNORE
        self.index[self.vocab] = torch.arange(len(self.vocab))

    def rows(self, targets: torch.Tensor) -> torch.Tensor:
        """Target ids -> rows of the draft vocabulary (IGNORE stays IGNORE, and so does a token
        outside the vocabulary: no draft could ever propose it)."""
        return torch.where(targets == IGNORE, targets, self.index[targets.clamp(min=0)])


class _Trainer(DraftRows):
    """The heads, the frozen LM head rows they project onto (the draft vocabulary), the frozen
    embeddings sequential heads read, and the target ids mapped into the vocabulary."""

    def __init__(self, model: CausalLM, heads: ResidualHeads, vocab: torch.Tensor | None) -> None:
        super().__init__(model, vocab, torch.device("cpu"))
        with torch.no_grad():
            # sequential heads read token embeddings; the others never do
            self.embed = model.embed(torch.arange(model.config.vocab_size, device=model.device)).float().cpu() \
                if heads.sequential else None
        self.heads = heads

    def logits(self, hidden: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """[B, hidden], [B, K] -> [B, K, N] (teacher-forced chain for sequential heads)."""
        if not self.heads.sequential:
            return F.linear(self.heads(hidden), self.weight)
        assert self.embed is not None
        g, outs = hidden, []
        for k in range(self.heads.num_heads):
            g = self.heads.head(k, g, self.embed[inputs[:, k]])
            outs.append(F.linear(g, self.weight))
        return torch.stack(outs, dim=1)

    @torch.no_grad()
    def agreement(self, data: Features) -> list[float]:
        """Per head: how often its top-1 is the target (a target outside the vocabulary is a miss)."""
        hits = torch.zeros(data.targets.shape[1])
        seen = torch.zeros(data.targets.shape[1])
        for start in range(0, len(data), 512):
            rows = slice(start, start + 512)
            pred = self.vocab[self.logits(data.hidden[rows], data.inputs[rows]).argmax(-1)]  # [B, K] token ids
            target = data.targets[rows]
            valid = target != IGNORE
            hits += ((pred == target) & valid).sum(0)
            seen += valid.sum(0)
        return [round(float(h / max(1.0, s)), 4) for h, s in zip(hits, seen)]


def train_heads(model: CausalLM, train: Features, held_out: Features, cfg: HeadTraining,
                vocab: torch.Tensor | None = None,
                log: Callable[[dict[str, object]], None] = lambda _: None) -> tuple[ResidualHeads, dict[str, object]]:
    """Fit heads on `train`; returns them and a report with held-out top-1 agreement. `vocab`: the
    draft vocabulary the heads project onto (None: the whole vocabulary)."""
    torch.manual_seed(cfg.seed)
    heads = ResidualHeads(model.config.hidden_size, train.targets.shape[1],
                          sequential=cfg.sequential and cfg.kind == "medusa")
    trainer = _Trainer(model, heads, vocab)
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=0.0)
    order = list(range(len(train)))
    rng = random.Random(cfg.seed)
    started = time.perf_counter()
    report: dict[str, object] = {"positions": len(train), "held_out_positions": len(held_out),
                                 "sequential": heads.sequential, "before": trainer.agreement(held_out)}
    log({"epoch": 0, "held_out_top1": report["before"]})
    for epoch in range(1, cfg.epochs + 1):
        rng.shuffle(order)
        total, count = 0.0, 0
        for start in range(0, len(order), cfg.batch_size):
            idx = torch.tensor(order[start:start + cfg.batch_size])
            targets = trainer.rows(train.targets[idx]).flatten()
            if bool((targets == IGNORE).all()):
                continue  # nothing to learn from (the loss would be NaN)
            logits = trainer.logits(train.hidden[idx], train.inputs[idx])  # [B, K, N]
            loss = F.cross_entropy(logits.flatten(0, 1), targets, ignore_index=IGNORE)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
            count += len(idx)
        top1 = trainer.agreement(held_out)
        log({"epoch": epoch, "loss": round(total / count, 4), "held_out_top1": top1,
             "seconds": round(time.perf_counter() - started, 1)})
        report["after"] = top1
    report["seconds"] = round(time.perf_counter() - started, 1)
    return heads.eval().requires_grad_(False), report
