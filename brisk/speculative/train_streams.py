"""Training Speculative Streaming's stream embeddings and adapters on the target's own text.

The main stream is frozen, so everything the streams read from it is computed once per sequence
(`StreamFeatures`: the residual stream entering layer L - Ns at every position and the top
layers' keys and values). A training step then runs only stream rows: for each anchor t of a
sequence's generated part, gamma rows through the top Ns layers with the adapters on; stream j's
loss is the cross-entropy of token x[t+1+j] over the draft vocabulary (the LM head rows drafts are
chosen among), the streams weighted equally. On the target's greedy continuations x[t+1+j] is
exactly what greedy verification will compare stream j's draft with. A held-out tenth of the
sequences gives each stream's top-1 agreement, the acceptance a chain of drafts can expect.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from brisk.errors import UserError
from brisk.model.attention import WholeSequences
from brisk.model.base import CausalLM
from brisk.speculative.streaming import KV, CaptureKV, StreamAdapter, StreamSegment, run_streams
from brisk.speculative.train import IGNORE, DraftRows


@dataclass(frozen=True)
class StreamTraining:
    num_streams: int = 4
    num_layers: int = 4  # Ns: the top layers the streams run through
    rank: int = 8
    epochs: int = 2
    lr: float = 2e-3  # the adapters
    # the stream embeddings and the token map are added to the residual stream, whose rows are
    # hundreds in norm on SmolLM2 (RMS ~60 at layer 26): at the adapters' rate they would barely
    # move in a few hundred steps
    stream_lr: float = 5e-2
    batch_size: int = 1  # sequences a step: one answer is already ~140 anchors x num_streams rows
    seed: int = 0
    token_rank: int | None = None  # the map of x[t+1]'s embedding (None: StreamAdapter's default, 64)
    bf16: bool = False  # bfloat16 autocast for the stream rows (AMX / AVX-512 BF16 CPUs, GPUs)


@dataclass
class StreamFeatures:
    """One sequence as the streams see it."""

    ids: list[int]
    prompt_len: int
    start: torch.Tensor  # [n, hidden]: the residual stream entering the first stream layer
    kv: dict[int, KV]  # top layer -> keys, values [n, kv_heads, head_dim]

    def anchors(self) -> torch.Tensor:
        """Positions t whose stream 1 has a target: the last prompt token .. n - 3."""
        return torch.arange(self.prompt_len - 1, len(self.ids) - 2, device=self.start.device)

    def targets(self, anchors: torch.Tensor, num_streams: int) -> torch.Tensor:
        """[m, num_streams]: x[t + 1 + j] for j = 1..num_streams, IGNORE past the end."""
        ids = torch.tensor(self.ids + [IGNORE] * (num_streams + 2))
        return ids[anchors.cpu()[:, None] + 1 + torch.arange(1, num_streams + 1)]


@torch.no_grad()
def stream_features(model: CausalLM, sequences: list[tuple[list[int], int]], first_layer: int,
                    kv_dtype: torch.dtype | None = None) -> list[StreamFeatures]:
    """One frozen forward per sequence (no KV cache: `WholeSequences`). `kv_dtype`: keep the top
    layers' keys and values in it (bfloat16 for bfloat16 training, whose attention casts them so
    anyway: 2,000 answers of float32 features of 8 layers outgrew 24 GiB)."""
    out = []
    for ids, prompt_len in sequences:
        if len(ids) - prompt_len < 3:
            continue
        t = torch.tensor(ids, device=model.device)
        positions = torch.arange(len(ids), device=model.device)
        attn = CaptureKV(WholeSequences([len(ids)], scale=model.config.attn_scale), first_layer, {})
        h, residual = model.run_layers(model.embed(t), None, positions, attn, 0, first_layer)
        start = h if residual is None else h + residual
        model.run_layers(h, residual, positions, attn, first_layer, model.config.num_hidden_layers)
        kv = attn.kv if kv_dtype is None else {i: (k.to(kv_dtype), v.to(kv_dtype)) for i, (k, v) in attn.kv.items()}
        out.append(StreamFeatures(ids, prompt_len, start, kv))  # the model's device
    return out


class _Head(DraftRows):
    """The draft vocabulary's rows as the streams' logits, softcapped like the model's."""

    def __init__(self, model: CausalLM, vocab: torch.Tensor | None) -> None:
        super().__init__(model, vocab)
        self.cap = model.config.final_logit_softcapping

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = F.linear(hidden.float(), self.weight)
        return out if not self.cap else torch.tanh(out / self.cap) * self.cap


def _batch(model: CausalLM, adapter: StreamAdapter, batch: list[StreamFeatures]) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states of every stream row of `batch` [rows, hidden] and their targets [rows]."""
    g = adapter.num_streams
    segments, starts, targets = [], [], []
    for f in batch:
        anchors = f.anchors()
        segments.append(StreamSegment(anchors, torch.tensor(f.ids, device=anchors.device)[anchors + 1],
                                      lambda layer, kv=f.kv: kv[layer]))
        starts.append(f.start[anchors])
        targets.append(f.targets(anchors, g).reshape(-1))
    return run_streams(model, adapter, torch.cat(starts), segments), torch.cat(targets)


@torch.no_grad()
def agreement(model: CausalLM, adapter: StreamAdapter, head: _Head, data: list[StreamFeatures]) -> list[float]:
    """Per stream: how often its top-1 is the target (a target outside the draft vocabulary is a miss)."""
    g = adapter.num_streams
    hits, seen = torch.zeros(g), torch.zeros(g)
    for f in data:
        hidden, targets = _batch(model, adapter, [f])
        pred = head.vocab[head.logits(hidden).argmax(-1).cpu()].view(-1, g)
        targets = targets.view(-1, g)
        valid = targets != IGNORE
        hits += ((pred == targets) & valid).sum(0)
        seen += valid.sum(0)
    return [round(float(h / max(1.0, s)), 4) for h, s in zip(hits, seen)]


def train_streams(model: CausalLM, train: list[StreamFeatures], held_out: list[StreamFeatures], cfg: StreamTraining,
                  vocab: torch.Tensor | None = None,
                  log: Callable[[dict[str, object]], None] = lambda _: None,
                  progress: bool = False, init: StreamAdapter | None = None,
                  on_epoch: Callable[[StreamAdapter, int], None] = lambda _a, _e: None,
                  ) -> tuple[StreamAdapter, dict[str, object]]:
    """Fit the stream embeddings and adapters (the model stays as it is); returns them and a
    report: parameters added, held-out top-1 agreement per stream before and after. `init`: start
    from these streams (a file trained before, `load_streams`) instead of fresh ones; its shape
    must be `cfg`'s. `on_epoch(adapter, epoch)` after each epoch (the caller's checkpoint). A
    non-finite loss or gradient raises FloatingPointError before the step is taken, so the
    adapter and the last epoch's checkpoint stay as they were."""
    torch.manual_seed(cfg.seed)
    model.requires_grad_(False)
    adapter = StreamAdapter(model.config, cfg.num_streams, cfg.num_layers, cfg.rank,
                            token_rank=cfg.token_rank).to(model.device)
    if init is not None:
        shapes = {n: p.shape for n, p in adapter.named_parameters()}
        if {n: p.shape for n, p in init.named_parameters()} != shapes:
            raise UserError(f"the streams to continue from have {init.num_streams} streams over "
                            f"{model.config.num_hidden_layers - init.first_layer} layers, LoRA rank {init.rank}, token "
                            f"rank {init.token_a.shape[0]}; this training asks for {cfg.num_streams}, "
                            f"{cfg.num_layers}, {cfg.rank}, {adapter.token_a.shape[0]}: give the same or start afresh")
        with torch.no_grad():
            for mine, theirs in zip(adapter.parameters(), init.parameters()):
                mine.copy_(theirs)
    head = _Head(model, vocab)
    # what adds to the residual stream itself (stream embeddings, the token map's output side) at
    # stream_lr, the adapters inside the layers at lr
    direct = {"streams", "token_a", "token_b"}
    lora = [p for name, p in adapter.named_parameters() if name not in direct]
    opt = torch.optim.AdamW([{"params": lora, "lr": cfg.lr},
                             {"params": [p for n, p in adapter.named_parameters() if n in direct], "lr": cfg.stream_lr}],
                            weight_decay=0.0)
    steps = cfg.epochs * -(-len(train) // cfg.batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / max(1, steps)))
    rng = random.Random(cfg.seed)
    order = list(range(len(train)))
    cfg_m = model.config  # weights counted from the config: a quantized model keeps them in buffers
    params = sum(cfg_m.layer_params(i) for i in range(cfg_m.num_hidden_layers)) + \
        cfg_m.vocab_size * cfg_m.hidden_size * (1 if cfg_m.tie_word_embeddings else 2)
    report: dict[str, object] = {"sequences": len(train), "held_out_sequences": len(held_out),
                                 "extra_params": adapter.num_params(),
                                 "extra_params_fraction": round(adapter.num_params() / params, 5),
                                 "before": agreement(model, adapter, head, held_out)}
    log({"epoch": 0, "held_out_top1": report["before"]})
    started = time.perf_counter()
    bar = tqdm(total=steps, desc="streams", unit="step", disable=not progress)
    for epoch in range(1, cfg.epochs + 1):
        rng.shuffle(order)
        total, count = 0.0, 0
        for first in range(0, len(order), cfg.batch_size):
            with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                hidden, targets = _batch(model, adapter, [train[i] for i in order[first:first + cfg.batch_size]])
                rows = head.rows(targets).to(hidden.device)
                if bool((rows == IGNORE).all()):
                    continue
                loss = F.cross_entropy(head.logits(hidden).float(), rows, ignore_index=IGNORE)
            value = float(loss.detach())
            if not math.isfinite(value):
                raise FloatingPointError(f"epoch {epoch}: a loss of {value}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            norm = float(torch.nn.utils.clip_grad_norm_(adapter.parameters(), 1.0))
            if not math.isfinite(norm):
                opt.zero_grad(set_to_none=True)
                raise FloatingPointError(f"epoch {epoch}: a gradient norm of {norm}")
            opt.step()
            sched.step()
            total += value
            count += 1
            bar.set_postfix(loss=f"{value:.3f}", epoch=epoch, refresh=False)
            bar.update()
        top1 = agreement(model, adapter, head, held_out)
        log({"epoch": epoch, "loss": round(total / max(1, count), 4), "held_out_top1": top1,
             "seconds": round(time.perf_counter() - started, 1)})
        report["after"] = top1
        on_epoch(adapter, epoch)
    bar.close()
    report["seconds"] = round(time.perf_counter() - started, 1)
    return adapter.eval().requires_grad_(False), report
