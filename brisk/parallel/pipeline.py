"""Pipeline parallelism: contiguous runs of layers per stage, and a step's batch cut into
micro-batches so the stages work at once.

    stage 0   [mb0][mb1]                     embedding + layers 0..a    (also schedules and samples)
    stage 1        [mb0][mb1]                layers a..L, norm, LM head ──► logits to rank 0
                        time ──►

With M micro-batches over P stages a step takes (M + P - 1) stage-slots of 1/M of the batch each
instead of P; a single sequence (M = 1) gains nothing and pays the hop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from torch import nn

from brisk.config import ModelConfig
from brisk.model.layers import Linear
from brisk.model.llama import LlamaForCausalLM

T = TypeVar("T")


class Dropped(nn.Module):
    """Stands where a module another pipeline stage holds used to be; calling it is a bug."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def forward(self, *args: object) -> None:
        raise AssertionError(f"{self.what} lives on another pipeline stage")


def head_cost_in_layers(cfg: ModelConfig) -> float:
    """The LM head's weights over one layer's: what a decode row costs the last stage extra."""
    layer = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size \
        + 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.vocab_size * cfg.hidden_size / layer


def stage_layers(cfg: ModelConfig, stages: int) -> list[range]:
    """Contiguous layer runs, balanced for decoding: the last stage, which also runs the LM head,
    gets fewer layers (SmolLM2-135M over 2 stages: 19 + 11, its head weighs about 8 layers)."""
    n = cfg.num_hidden_layers
    if stages > n:
        raise ValueError(f"pipeline_parallel_size {stages} exceeds the model's {n} layers: each stage needs one")
    ideal = (n + head_cost_in_layers(cfg)) / stages
    runs: list[range] = []
    start = 0
    for s in range(stages - 1):
        left_for_rest = stages - 1 - s  # every later stage keeps at least one layer
        size = max(1, min(round(ideal), n - start - left_for_rest))
        runs.append(range(start, start + size))
        start += size
    runs.append(range(start, n))
    return runs


def keep_stage(model: LlamaForCausalLM, layers: range, first: bool, last: bool) -> None:
    """Drop what this stage does not run: other stages' layers, the embedding (unless first),
    the LM head (unless last). A tied head on a last stage that is not the first keeps the
    embedding's table as its own."""
    for i in range(len(model.layers)):
        if i not in layers:
            model.layers[i] = Dropped(f"layer {i}")
    if last and model.lm_head is None and not first:
        table = model.embed_tokens.weight
        head = Linear(table.shape[1], (table.shape[0],), False, table.dtype)
        head.weight = table
        model.lm_head = head  # type: ignore[assignment]
    if not first:
        model.embed_tokens = Dropped("the token embedding")  # type: ignore[assignment]
    if not last:
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
