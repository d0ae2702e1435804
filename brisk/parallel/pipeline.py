"""Pipeline parallelism: contiguous runs of layers per stage, and a step's batch cut into
micro-batches so the stages work at once.

    stage 0   [mb0][mb1]          [head mb0][head mb1]   embedding, layers 0..a, LM head (schedules, samples)
    stage 1        [mb0][mb1]                            layers a..L, final norm ─► rows' hidden back to stage 0
                        time ──►

The LM head sits with the embedding on the first stage (a tied head is the embedding table, so
no stage holds it twice), so what comes back is a hidden row per sampled token, not a vocabulary
of logits. With M micro-batches over P stages a step takes about (M + P - 1) stage-slots of 1/M
of the batch each instead of P; a single sequence (M = 1) gains nothing and pays the hops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from torch import nn

from brisk.config import ModelConfig
from brisk.errors import UserError
from brisk.model.base import CausalLM

T = TypeVar("T")


class Dropped(nn.Module):
    """Stands where a module another pipeline stage holds used to be; calling it is a bug."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def forward(self, *args: object) -> None:
        raise AssertionError(f"{self.what} lives on another pipeline stage")


def head_cost_in_layers(cfg: ModelConfig) -> float:
    """The LM head's weights over one (average) layer's: what a decode row costs the last stage extra."""
    layer = sum(cfg.layer_params(i) for i in range(cfg.num_hidden_layers)) / cfg.num_hidden_layers
    return cfg.vocab_size * cfg.hidden_size / layer


def stage_layers(cfg: ModelConfig, stages: int) -> list[range]:
    """Contiguous layer runs, balanced for decoding: the first stage, which also runs the LM head
    (and the scheduler and sampler), gets fewer layers (SmolLM2-135M over 2 stages: 11 + 19; its
    head weighs about 8 layers)."""
    n = cfg.num_hidden_layers
    if stages > n:
        raise UserError(f"pipeline_parallel_size {stages} exceeds the model's {n} layers: each stage needs one")
    ideal = (n + head_cost_in_layers(cfg)) / stages
    sizes: list[int] = []
    for s in range(stages - 1, 0, -1):  # the last stages take their share; the first keeps the rest
        size = max(1, min(round(ideal), n - sum(sizes) - s))
        sizes.append(size)
    sizes.append(n - sum(sizes))
    sizes.reverse()
    starts = [sum(sizes[:i]) for i in range(stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def keep_stage(model: CausalLM, layers: range, first: bool) -> None:
    """Drop what this stage does not run: other stages' layers; unless first, the embedding and
    the LM head (which live together on the first stage; every stage keeps the small final norm)."""
    for i in range(len(model.layers)):
        if i not in layers:
            model.layers[i] = Dropped(f"layer {i}")
    if not first:
        model.embed_tokens = Dropped("the token embedding")  # type: ignore[assignment]
        model.lm_head = Dropped("the LM head")  # type: ignore[assignment]


def split_micro_batches(steps: Sequence[T], sizes: Sequence[int], parts: int) -> list[list[T]]:
    """Cut `steps` (in order) into at most `parts` runs of about equal total `sizes` (tokens)."""
    parts = max(1, min(parts, len(steps)))
    total = sum(sizes)
    out: list[list[T]] = [[]]
    done = 0
    for step, size in zip(steps, sizes):
        # start the next run here when taking this step would end the run further from its share
        boundary = total * len(out) / parts
        if out[-1] and len(out) < parts and abs(done - boundary) < abs(done + size - boundary):
            out.append([])
        out[-1].append(step)
        done += size
    return out
