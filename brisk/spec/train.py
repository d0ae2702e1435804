"""Self-distillation of Medusa and early-exit heads on text the target itself generated.

The target's greedy continuations are its own argmax at every position, so they are exactly what
greedy verification compares drafts against. For each generated position t:

    medusa      head k (k = 1..K) reads the final hidden state at t, target token x[t+1+k]
    early_exit  the head reads the normed hidden state after `exit_layer` layers, target x[t+1]

Features are computed once (one forward per sequence), then the heads train on them with the
target's LM head frozen: AdamW, cross-entropy, a held-out tenth of the sequences for the reported
top-1 agreement. SmolLM2-135M: ~50k positions, 3 epochs of 4 Medusa heads, minutes on 2 cores.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from brisk.model.llama import LlamaForCausalLM, forward_sequence
from brisk.spec.heads import ResidualHeads

IGNORE = -100


@dataclass(frozen=True)
class HeadTraining:
    kind: str  # "medusa" or "early_exit"
    num_heads: int = 4  # medusa; early_exit trains one
    exit_layer: int | None = None  # early_exit
    epochs: int = 3
    lr: float = 1e-3
    batch_size: int = 256
    seed: int = 0


def features(model: LlamaForCausalLM, sequences: list[tuple[list[int], int]], cfg: HeadTraining
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [N, hidden], targets [N, K]) over the generated positions of (token ids, prompt
    length) pairs; a target past a sequence's end is IGNORE."""
    k = cfg.num_heads if cfg.kind == "medusa" else 1
    offset = 2 if cfg.kind == "medusa" else 1  # head 1 of Medusa guesses x[t+2]; an exit head x[t+1]
    layers = cfg.exit_layer if cfg.kind == "early_exit" else None
    xs, ys = [], []
    for ids, prompt_len in sequences:
        n = len(ids)
        if n - prompt_len < 2:
            continue
        hidden = forward_sequence(model, ids, layers)  # [n, hidden]
        positions = range(prompt_len - 1, n - 1)  # t: the last prompt token onwards
        xs.append(hidden[prompt_len - 1:n - 1].float())
        ys.append(torch.tensor([[ids[t + offset + j] if t + offset + j < n else IGNORE for j in range(k)]
                                for t in positions]))
    return torch.cat(xs), torch.cat(ys)


def train_heads(model: LlamaForCausalLM, train: tuple[torch.Tensor, torch.Tensor],
                held_out: tuple[torch.Tensor, torch.Tensor], cfg: HeadTraining,
                log: Callable[[dict[str, object]], None] = lambda _: None) -> tuple[ResidualHeads, dict[str, object]]:
    """Fit heads on (hidden, targets); returns them and a report with held-out top-1 agreement."""
    torch.manual_seed(cfg.seed)
    k = train[1].shape[1]
    heads = ResidualHeads(model.config.hidden_size, k)
    head_weight = _lm_head_weight(model)
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=0.0)
    x, y = train
    order = list(range(x.shape[0]))
    rng = random.Random(cfg.seed)
    started = time.perf_counter()
    report: dict[str, object] = {"positions": x.shape[0], "held_out_positions": held_out[0].shape[0],
                                 "before": _agreement(heads, head_weight, *held_out)}
    log({"epoch": 0, "held_out_top1": report["before"]})
    for epoch in range(1, cfg.epochs + 1):
        rng.shuffle(order)
        total, count = 0.0, 0
        for start in range(0, len(order), cfg.batch_size):
            idx = torch.tensor(order[start:start + cfg.batch_size])
            logits = F.linear(heads(x[idx]), head_weight)  # [B, K, vocab]
            loss = F.cross_entropy(logits.flatten(0, 1), y[idx].flatten(), ignore_index=IGNORE)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
            count += len(idx)
        top1 = _agreement(heads, head_weight, *held_out)
        log({"epoch": epoch, "loss": round(total / count, 4), "held_out_top1": top1,
             "seconds": round(time.perf_counter() - started, 1)})
        report["after"] = top1
    report["seconds"] = round(time.perf_counter() - started, 1)
    return heads.eval().requires_grad_(False), report


def _lm_head_weight(model: LlamaForCausalLM) -> torch.Tensor:
    """The LM head matrix [vocab, hidden] as float32 (dequantized if need be), frozen."""
    with torch.no_grad():
        return model.head_rows(torch.arange(model.config.vocab_size, device=model.device)).cpu()


@torch.no_grad()
def _agreement(heads: ResidualHeads, head_weight: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Per head: how often its top-1 equals the target token (positions with a target)."""
    hits = torch.zeros(y.shape[1])
    seen = torch.zeros(y.shape[1])
    for start in range(0, x.shape[0], 512):
        pred = F.linear(heads(x[start:start + 512]), head_weight).argmax(-1)  # [B, K]
        target = y[start:start + 512]
        valid = target != IGNORE
        hits += ((pred == target) & valid).sum(0)
        seen += valid.sum(0)
    return [round(float(h / max(1.0, s)), 4) for h, s in zip(hits, seen)]
