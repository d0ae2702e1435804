"""Tensor parallelism at the Linear seam: each rank keeps a slice of every weight.

    qkv_proj, gate_up_proj   column parallel: this rank's heads / intermediate rows, no talk
    o_proj, down_proj        row parallel: this rank's input columns, then one all-reduce
    embed_tokens             vocabulary parallel: rows of this rank's token range, zero elsewhere,
                             one all-reduce
    lm_head                  vocabulary parallel: logits of this rank's token range, gathered on
                             the stage leader by the runner

Attention heads go by KV group so GQA stays whole: with T <= KV heads each rank takes a run of KV
heads (uneven runs allowed: 3 KV heads over 2 ranks is 2 + 1) and their query heads; with T > KV
heads each KV head is replicated on T / KV ranks that split its query heads. The split is exact:
every rank computes whole heads, and a row-parallel sum is the only reordered arithmetic.

Shards are cut from float weights; a quantization method then quantizes each shard (`quant.apply`
finds the Linears inside `RowParallel` like any other), so int8 / int4 / W8A8 / ternary shard too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from brisk.config import ModelConfig
from brisk.errors import UserError
from brisk.model.layers import Linear
from brisk.model.base import CausalLM
from brisk.parallel.groups import ParallelState


def even_ranges(n: int, parts: int) -> list[range]:
    """n items in `parts` contiguous runs, the first n % parts one longer."""
    size, extra = divmod(n, parts)
    starts = [i * size + min(i, extra) for i in range(parts + 1)]
    return [range(starts[i], starts[i + 1]) for i in range(parts)]


@dataclass(frozen=True)
class HeadSplit:
    q_heads: range
    kv_heads: range


def head_split(cfg: ModelConfig, tp: int, rank: int, layer: int = 0) -> HeadSplit:
    """The query and KV heads of layer `layer` that rank `rank` of `tp` computes; a ValueError when
    no exact split exists."""
    heads, kv = cfg.heads(layer), cfg.kv_heads(layer)
    group = heads // kv  # query heads per KV head
    if tp <= kv:
        kv_run = even_ranges(kv, tp)[rank]
        return HeadSplit(range(kv_run.start * group, kv_run.stop * group), kv_run)
    if tp % kv or group % (tp // kv):
        raise UserError(
            f"tensor_parallel_size {tp} cannot split {heads} attention heads in {kv} KV groups{_of_layer(cfg, layer)} "
            f"exactly: use a size "
            f"up to {kv} (each rank takes whole KV groups), or a multiple of {kv} that divides {group} query heads "
            f"per group into equal parts ({', '.join(str(kv * d) for d in range(2, group + 1) if group % d == 0)})")
    share = tp // kv  # ranks sharing one KV head
    kv_head = rank // share
    per = group // share
    first = kv_head * group + (rank % share) * per
    return HeadSplit(range(first, first + per), range(kv_head, kv_head + 1))


def _of_layer(cfg: ModelConfig, layer: int) -> str:
    return "" if cfg.uniform else f" (layer {layer} of this pruned model)"


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """Raise the ValueError a split would raise, before anything is spawned."""
    layers = range(cfg.num_hidden_layers)
    if tp > min(cfg.intermediate(i) for i in layers) or tp > cfg.vocab_size:
        raise UserError(f"tensor_parallel_size {tp} exceeds the model's MLP width or vocabulary")
    for layer in layers if not cfg.uniform else (0,):
        for rank in range(tp):
            head_split(cfg, tp, rank, layer)


class RowParallel(nn.Module):
    """A Linear over this rank's input columns, summed over the stage's ranks."""

    def __init__(self, inner: nn.Module, state: ParallelState) -> None:
        super().__init__()
        self.inner = inner
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.state.all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """Rows of tokens [start, start + rows) here; other tokens look up zeros; summed over ranks.

    `tied`: the LM head's shard is this table. Once the head is quantized, lookups read the
    quantized head's rows instead (`tie_vocab_parallel_head`), as a tied quantized head does in
    one process (quant.tie_head), and the float table is dropped."""

    def __init__(self, weight: torch.Tensor, start: int, state: ParallelState, tied: bool) -> None:
        super().__init__()
        self.weight: nn.Parameter | None = nn.Parameter(weight, requires_grad=False)  # [shard rows, hidden]
        self.rows = weight.shape[0]
        self.dtype = weight.dtype
        self.start = start
        self.state = state
        self.tied = tied
        self.head: nn.Module | None = None  # a quantized head to read rows from (dequantize_rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        local = local.clamp(0, self.rows - 1)
        if self.head is not None:
            h = self.head.dequantize_rows(local).to(self.dtype)  # type: ignore[operator]
        else:
            assert self.weight is not None
            h = F.embedding(local, self.weight)  # [n, hidden]
        return self.state.all_reduce(h.masked_fill(outside.unsqueeze(1), 0.0))


def tie_vocab_parallel_head(model: CausalLM) -> None:
    """After quantization: a tied embedding shard looks tokens up in the quantized head shard."""
    embed, head = model.embed_tokens, model.lm_head
    if isinstance(embed, VocabParallelEmbedding) and embed.tied and hasattr(head, "dequantize_rows"):
        embed.head, embed.weight = head, None


def _linear(rows: torch.Tensor, output_sizes: tuple[int, ...], bias: torch.Tensor | None) -> Linear:
    out = Linear(rows.shape[1], output_sizes, bias is not None, rows.dtype)
    with torch.no_grad():
        out.weight.copy_(rows)
        if bias is not None:
            out.bias.copy_(bias)  # type: ignore[union-attr]
    return out


def _rows_of_parts(linear: Linear, parts: list[range]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows `parts[i]` of each stacked part i of `linear`, stacked again (and its bias the same way)."""
    offsets = [sum(linear.output_sizes[:i]) for i in range(len(parts))]
    index = torch.tensor([o + r for o, part in zip(offsets, parts) for r in part], device=linear.weight.device)
    bias = None if linear.bias is None else linear.bias.index_select(0, index)
    return linear.weight.index_select(0, index), bias


def _check_float(module: nn.Module, name: str) -> Linear:
    if not isinstance(module, Linear):
        raise UserError(  # noqa: TRY004 - a user-facing checkpoint mismatch, reported like the others
            f"{name} is {type(module).__name__}, not a float Linear: tensor parallelism slices float weights "
            "and quantizes each slice; load the original (unquantized) model with a quantization option "
            "instead of a quantized checkpoint")
    return module


def shard_model(model: CausalLM, state: ParallelState) -> None:
    """Keep this rank's slice of every weight, in place (float weights, before quantization)."""
    cfg, tp, rank = model.config, state.tp_size, state.tp_rank
    hd = cfg.head_dim
    for i, layer in enumerate(model.layers):
        split = head_split(cfg, tp, rank, i)
        q_rows = range(split.q_heads.start * hd, split.q_heads.stop * hd)
        kv_rows = range(split.kv_heads.start * hd, split.kv_heads.stop * hd)
        mlp_rows = even_ranges(cfg.intermediate(i), tp)[rank]
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _check_float(attn.qkv_proj, f"layers.{i}.self_attn.qkv_proj")
        weight, bias = _rows_of_parts(qkv, [q_rows, kv_rows, kv_rows])
        attn.qkv_proj = _linear(weight, (len(q_rows), len(kv_rows), len(kv_rows)), bias)
        attn.num_heads, attn.num_kv_heads = len(split.q_heads), len(split.kv_heads)
        o = _check_float(attn.o_proj, f"layers.{i}.self_attn.o_proj")
        attn.o_proj = RowParallel(_linear(o.weight[:, q_rows.start:q_rows.stop], o.output_sizes, _once(o.bias, rank)),
                                  state)
        gate_up = _check_float(mlp.gate_up_proj, f"layers.{i}.mlp.gate_up_proj")
        weight, _ = _rows_of_parts(gate_up, [mlp_rows, mlp_rows])
        mlp.gate_up_proj = _linear(weight, (len(mlp_rows), len(mlp_rows)), None)
        down = _check_float(mlp.down_proj, f"layers.{i}.mlp.down_proj")
        mlp.down_proj = RowParallel(_linear(down.weight[:, mlp_rows.start:mlp_rows.stop], down.output_sizes,
                                            _once(down.bias, rank)), state)
    _shard_vocab(model, state)


def _once(bias: torch.Tensor | None, rank: int) -> torch.Tensor | None:
    """A row-parallel Linear's bias, added by rank 0 alone (the ranks' outputs are summed)."""
    return bias if rank == 0 else None


def vocab_shard(vocab_size: int, tp: int, rank: int) -> range:
    """Equal shards of ceil(V / T) tokens (the last one padded with zero rows) so gathered logits
    line up without per-rank sizes; the padding is cut off after the gather."""
    size = -(-vocab_size // tp)
    return range(rank * size, (rank + 1) * size)


def _shard_vocab(model: CausalLM, state: ParallelState) -> None:
    cfg = model.config
    shard = vocab_shard(cfg.vocab_size, state.tp_size, state.tp_rank)

    def rows(weight: torch.Tensor) -> torch.Tensor:
        part = weight[shard.start:min(shard.stop, cfg.vocab_size)]
        pad = len(shard) - part.shape[0]
        return torch.cat([part, part.new_zeros(pad, part.shape[1])]) if pad else part.clone()

    embed = getattr(model.embed_tokens, "weight", None)
    if embed is None:
        raise UserError("the token embedding is not a float table; load the unquantized model")
    local = rows(embed)
    head = model.lm_head
    model.embed_tokens = VocabParallelEmbedding(local, shard.start, state, head is None)  # type: ignore[assignment]
    if head is None:  # tied: the head's shard is the embedding's shard, one tensor for both
        tied = Linear(local.shape[1], (len(shard),), False, local.dtype)
        tied.weight = model.embed_tokens.weight  # type: ignore[assignment]
        model.lm_head = tied  # type: ignore[assignment]
    else:
        head = _check_float(head, "lm_head")
        model.lm_head = _linear(rows(head.weight), (len(shard),), None)  # type: ignore[assignment]
