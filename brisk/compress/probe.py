"""Probe Pruning (Le et al., ICLR 2025): structured pruning decided per batch at run time.

For every layer but the first `dense_layers`, in order, on the batch being run:

1. **Probe**: the residual stream picks a probe, the `probe_sequences` share of the batch's
   sequences with the largest residual L2 norm and, in those, the `probe_tokens` share of their
   tokens with the largest norm entering this layer (the paper's residual importance).
2. **Probe states**: the mean square of each o_proj / down_proj input channel over the probe rows.
3. **Fusion** with the history (the same mean squares over the calibration text), per channel:
   r = p / (p + h), fused = (1 - r) h + r p (the reference code's fusion: a channel the probe
   sees strongly is trusted to the probe, a quiet one falls back on the history).
4. **Score** (the paper's PP metric, "ppwandasp"): fused_j * sqrt(sum_i W_ij^4) per input
   channel j of o_proj / down_proj; summed per KV group of heads (the model stays exact GQA).
5. **Prune**: the layer keeps its best KV groups and MLP channels so that `ratio'` of its weights
   go (ratio' = ratio spread over the pruned layers: `ratio` of all layer weights goes), and the
   whole batch runs that layer on the kept ones only. The next layer's probe sees this output.

How brisk runs it (`ProbePruner`): one decision pass over the batch's prompts through the dense
model, whose forward hooks do 1-5 layer by layer (dropping a head or channel = zeroing its o_proj /
down_proj input, exactly what removing it computes). Its output *is* the pruned model's output on
the prompts (what `brisk eval ppl` scores). For generation the decision becomes a compact dense
model (`compact_model`: the kept rows and columns copied, everything else shared with the dense
model) that brisk's engine prefills and decodes like any model: the decision holds for the whole
generation of that batch. A decode step of one request would be its own batch of one token, and
probing it means running the full layer on it, which saves nothing: here the probe is made of the
prompts, once. So a request alone and the same request in a batch may get different channels
(documented, tested); every request of one batch shares one model.

Where the reference differs: the probe's *sequences* are chosen once per batch, by their mean
residual norm entering the first pruned layer (the whole batch runs the `dense_layers` unpruned
layers for it, ~10% of a prefill), and only they run the decision pass, their tokens re-chosen at
every layer. The paper re-chooses sequences at every layer because its whole batch runs every
pruned layer anyway; here that would be a second, dense prefill of the batch before the engine's
(measured: 2.6-3.2 s of a 3.2 s batch of 16 x 128 tokens). Its probe attends among the probe tokens only (to save compute on
GPUs with big batches); brisk's decision pass computes each layer for the whole batch anyway,
so the probe rows see their full context. The history is a plain mean over the calibration
tokens (the reference's EMA at momentum 0.99 over calibration batches, per position: the same
order of magnitude, without a fixed sequence length).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from brisk.compress.prune import (
    Plan,
    calibrate,
    calibration_ids,
    kept_rows,
    model_params,
    stacked_rows,
)
from brisk.config import ModelConfig, PruneConfig
from brisk.errors import UserError
from brisk.loader.load import LoadedModel
from brisk.model.attention import SeqSpan
from brisk.model.base import CausalLM, contiguous_batch
from brisk.model.registry import build_model


@dataclass
class Decision:
    plan: Plan
    seconds: float  # the decision pass (probe, scores, the pruned forward of the prompts)
    probe_rows: int  # tokens in the probe, summed over the pruned layers


def layer_ratio(cfg: ModelConfig, pcfg: PruneConfig) -> float:
    """The share of each pruned layer's weights that goes so that `ratio` of all layer weights does."""
    n = cfg.num_hidden_layers
    pruned = n - pcfg.dense_layers
    total = sum(cfg.layer_params(i) for i in range(n))
    share = sum(cfg.layer_params(i) for i in range(pcfg.dense_layers, n))
    return pcfg.ratio * total / share if pruned > 0 else 0.0


def check_probe(cfg: ModelConfig, pcfg: PruneConfig) -> None:
    """The ValueError a ratio or model shape would hit, before anything is scored."""
    n = cfg.num_hidden_layers
    if pcfg.dense_layers >= n and pcfg.ratio > 0:
        raise UserError(f"dense_layers {pcfg.dense_layers} leaves none of the {n} layers to prune: lower it")
    rho = layer_ratio(cfg, pcfg)
    if rho >= 1:
        raise UserError(f"pruning ratio {pcfg.ratio:g} of all layer weights, taken from the {n - pcfg.dense_layers} "
                         f"layers after the first {pcfg.dense_layers}, removes {rho:.2f} of each: lower the ratio "
                         "or dense_layers")
    for i in range(pcfg.dense_layers, n):
        if rho > 0 and cfg.intermediate(i) < pcfg.multiple:
            raise UserError(f"layer {i}'s MLP is {cfg.intermediate(i)} channels, fewer than the multiple "
                             f"{pcfg.multiple} widths are kept in: lower \"multiple\"")
        groups, width = keep_counts(cfg, i, rho, pcfg.multiple)
        removed = 1 - (groups * _group_cost(cfg, i) + width * 3 * cfg.hidden_size) / cfg.layer_params(i)
        if rho > 0 and removed > rho + 0.25:
            raise UserError(f"pruning ratio {pcfg.ratio:g} cannot be met in layer {i} with at least one KV group "
                             f"and {pcfg.multiple} MLP channels (it would remove {removed:.2f} of it): lower the "
                             "ratio")


def _group_cost(cfg: ModelConfig, i: int) -> int:
    group = cfg.heads(i) // cfg.kv_heads(i)
    return cfg.hidden_size * cfg.head_dim * (2 * group + 2)


def keep_counts(cfg: ModelConfig, i: int, rho: float, multiple: int) -> tuple[int, int]:
    """KV groups and MLP channels layer `i` keeps when `rho` of its weights go: a whole KV group
    goes only where `rho` of the groups covers it (a group is a coarse step: a third of the
    attention of a 3-group model), at least one stays; the rest of the target comes from the MLP,
    its width rounded to the nearest multiple of `multiple` (at least one)."""
    kv, inter = cfg.kv_heads(i), cfg.intermediate(i)
    if rho <= 0:
        return kv, inter
    groups = max(1, kv - math.floor(kv * rho + 1e-9))
    target = rho * cfg.layer_params(i) - (kv - groups) * _group_cost(cfg, i)
    width = inter - target / (3 * cfg.hidden_size)
    width = min(inter, max(multiple, multiple * round(width / multiple)))
    return groups, width


class ProbePruner:
    """Probe Pruning on one dense float model: history from calibration text, decisions per batch."""

    def __init__(self, model: CausalLM, pcfg: PruneConfig, history_attn: list[torch.Tensor],
                 history_mlp: list[torch.Tensor], calibration_tokens: int, calibration_seconds: float) -> None:
        self.model = model
        self.config = model.config
        self.pcfg = pcfg
        self.rho = layer_ratio(self.config, pcfg)
        self.history_attn = history_attn  # per layer: mean x^2 of o_proj inputs, float64
        self.history_mlp = history_mlp
        self.calibration_tokens = calibration_tokens
        self.calibration_seconds = calibration_seconds
        # sqrt(sum_i W_ij^4) of each input column: fixed per model, computed once
        self.w_attn = [_column_norm4(layer.self_attn.o_proj.weight) for layer in model.layers]
        self.w_mlp = [_column_norm4(layer.mlp.down_proj.weight) for layer in model.layers]
        self.keep = [keep_counts(self.config, i, self.rho if i >= pcfg.dense_layers else 0.0, pcfg.multiple)
                     for i in range(self.config.num_hidden_layers)]

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, pcfg: PruneConfig) -> ProbePruner:
        check_probe(loaded.config, pcfg)
        ids = calibration_ids(loaded.tokenizer, pcfg)
        started = time.perf_counter()
        cal = calibrate(loaded.model, ids)
        attn = [s.squares / s.rows for s in cal.attn]  # type: ignore[operator]
        mlp = [s.squares / s.rows for s in cal.mlp]  # type: ignore[operator]
        return cls(loaded.model, pcfg, attn, mlp, cal.tokens, time.perf_counter() - started)

    @property
    def active(self) -> bool:
        return self.rho > 0

    # ---------------------------------------------------------------- the decision pass
    @torch.inference_mode()
    def forward(self, seqs: list[list[int]]) -> tuple[torch.Tensor, Decision]:
        """The batch's prompts through the model, each layer pruned by its probe: the final-normed
        hidden states of every token (flat, in order) and the channels each layer kept."""
        started = time.perf_counter()
        model, cfg = self.model, self.config
        ids, positions, meta = contiguous_batch(model, seqs)
        plan = Plan(list(range(cfg.num_hidden_layers)), {}, {})
        probe: dict[str, torch.Tensor] = {}
        counted = [0]
        hooks = []
        for i, layer in enumerate(model.layers):
            if i < self.pcfg.dense_layers or not self.active:
                continue
            hooks.append(layer.register_forward_pre_hook(self._probe_hook(meta.seqs, probe, counted)))
            hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(self._attn_hook(i, probe, plan)))
            hooks.append(layer.mlp.down_proj.register_forward_pre_hook(self._mlp_hook(i, probe, plan)))
        try:
            hidden = model(ids, positions, meta)
        finally:
            for h in hooks:
                h.remove()
        return hidden, Decision(plan, time.perf_counter() - started, counted[0])

    def decide(self, seqs: list[list[int]]) -> Decision:
        """The heads and channels a batch gets: its probe sequences (chosen once, by their mean
        residual norm entering the first pruned layer) through the decision pass."""
        started = time.perf_counter()
        k = max(1, math.ceil(self.pcfg.probe_sequences * len(seqs)))
        if self.active and k < len(seqs):
            norms = self._entry_norms(seqs)
            seqs = [seqs[i] for i in sorted(torch.topk(norms, k).indices.tolist())]
        decision = self.forward(seqs)[1]
        decision.seconds = time.perf_counter() - started
        return decision

    @torch.inference_mode()
    def _entry_norms(self, seqs: list[list[int]]) -> torch.Tensor:
        """Each sequence's mean residual L2 norm entering layer `dense_layers` (the layers before
        it are never pruned: the whole batch runs only those)."""
        model, end = self.model, self.pcfg.dense_layers
        ids, positions, meta = contiguous_batch(model, seqs, end)
        h, residual = model.run_layers(model.embed(ids), None, positions, meta, 0, end)
        return _span_means(_row_norms(h if residual is None else h + residual), meta.seqs)

    def _probe_hook(self, spans: list[SeqSpan], probe: dict[str, torch.Tensor],
                    counted: list[int]) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(_m: nn.Module, args: tuple[Any, ...]) -> None:
            h, residual = args[0], args[1]
            stream = h if residual is None else h + residual
            probe["rows"] = probe_rows(stream, spans, self.pcfg.probe_sequences, self.pcfg.probe_tokens)
            counted[0] += probe["rows"].numel()
        return hook

    def _attn_hook(self, i: int, probe: dict[str, torch.Tensor],
                   plan: Plan) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], tuple[torch.Tensor]]:
        cfg = self.config

        def hook(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
            x = args[0]  # [n, heads * head_dim]
            score = _channel_scores(x, probe["rows"], self.history_attn[i], self.w_attn[i])
            groups = score.view(cfg.kv_heads(i), -1).sum(1)
            kept = sorted(torch.topk(groups, self.keep[i][0]).indices.tolist())
            plan.kv_groups[i] = kept
            mask = torch.zeros(cfg.kv_heads(i), 1, dtype=x.dtype, device=x.device)
            mask[kept] = 1
            return (x * mask.expand(-1, x.shape[1] // cfg.kv_heads(i)).reshape(1, -1),)
        return hook

    def _mlp_hook(self, i: int, probe: dict[str, torch.Tensor],
                  plan: Plan) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], tuple[torch.Tensor]]:
        def hook(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
            x = args[0]  # [n, intermediate]
            score = _channel_scores(x, probe["rows"], self.history_mlp[i], self.w_mlp[i])
            kept = torch.topk(score, self.keep[i][1]).indices.sort().values
            plan.channels[i] = kept.tolist()
            mask = torch.zeros(x.shape[1], dtype=x.dtype, device=x.device)
            mask[kept] = 1
            return (x * mask,)
        return hook

    # ------------------------------------------------------------------- the compact model
    def compact_model(self, plan: Plan, reuse: CausalLM | None = None) -> CausalLM:
        """The dense model with only the plan's heads and channels: a smaller dense model of
        per-layer widths (ModelConfig.layer_heads ...), its untouched tensors shared with the dense
        one. `reuse`: an earlier compact model no engine runs any more, refilled when its widths fit."""
        cfg = self.config
        new_cfg = decided_config(cfg, plan)
        params = dict(self.model.state_dict())
        cuts = [c for i in plan.kv_groups for c in _cuts(cfg, i, plan) if c[0] in params]
        if reuse is not None and reuse.config == new_cfg:
            # The same widths (every batch at one ratio): write into the idle compact model's own
            # tensors instead of fresh ones (no page faults on ~60% of the layers' bytes per batch).
            reuse.unpack_weights()  # and modules_changed: the runtime's plan over them goes
            own = dict(reuse.state_dict())
            with torch.no_grad():
                for name, dim, index in cuts:
                    torch.index_select(params[name], dim, index, out=own[name])
            return reuse
        for name, dim, index in cuts:
            params[name] = params[name].index_select(dim, index)
        with torch.device("meta"):
            compact = build_model(new_cfg, self.model.dtype, max_positions=self.model.max_positions)
        compact.load_state_dict(params, strict=True, assign=True)
        for name, buf in self.model.named_buffers():  # rotary tables: shared
            module, _, leaf = name.rpartition(".")
            setattr(compact.get_submodule(module) if module else compact, leaf, buf)
        return compact.eval()

    def report(self, plan: Plan | None = None) -> dict[str, Any]:
        cfg = self.config
        new_cfg = decided_config(cfg, plan if plan is not None else first_plan(cfg, self.keep))
        layers = [sum(c.layer_params(i) for i in range(c.num_hidden_layers)) for c in (cfg, new_cfg)]
        return {
            "method": "probe", "ratio": self.pcfg.ratio, "layer_ratio": round(self.rho, 4),
            "dense_layers": self.pcfg.dense_layers, "probe_tokens": self.pcfg.probe_tokens,
            "probe_sequences": self.pcfg.probe_sequences,
            "layer_weights_removed": round(1 - layers[1] / layers[0], 4),
            "params": model_params(new_cfg), "params_dense": model_params(cfg),
            "kv_heads": list(new_cfg.layer_kv_heads) or None, "mlp_widths": list(new_cfg.layer_intermediate) or None,
            "calibration": self.pcfg.calibration, "calibration_tokens": self.calibration_tokens,
            "seconds": round(self.calibration_seconds, 2),
        }


def _row_norms(stream: torch.Tensor) -> torch.Tensor:
    """The residual L2 norm of every row (token) of the flat batch: [n]."""
    return torch.linalg.vector_norm(stream.float(), dim=-1)


def _span_means(norms: torch.Tensor, spans: list[SeqSpan]) -> torch.Tensor:
    """Each sequence's mean of `norms` over its rows: [sequences]."""
    return torch.stack([norms[s.query_start:s.query_start + s.num_tokens].mean() for s in spans])


def probe_rows(stream: torch.Tensor, spans: list[SeqSpan], seq_share: float, token_share: float) -> torch.Tensor:
    """Flat row indices of the probe: the `seq_share` of sequences with the largest mean residual
    L2 norm (at least one), and in each the `token_share` of tokens with the largest norm (at least one)."""
    norms = _row_norms(stream)
    means = _span_means(norms, spans)
    n_seq = max(1, math.ceil(seq_share * len(spans)))
    rows = []
    for k in torch.topk(means, n_seq).indices.tolist():
        s = spans[k]
        own = norms[s.query_start:s.query_start + s.num_tokens]
        top = torch.topk(own, max(1, math.ceil(token_share * s.num_tokens))).indices
        rows.append(top + s.query_start)
    return torch.cat(rows).sort().values


def _column_norm4(weight: torch.Tensor) -> torch.Tensor:
    """sqrt(sum_i W_ij^4) for every input column j."""
    return weight.double().pow(4).sum(0).sqrt()


def _channel_scores(x: torch.Tensor, rows: torch.Tensor, history: torch.Tensor, w4: torch.Tensor) -> torch.Tensor:
    """The PP metric per input channel: fused mean square of the probe and history, times the
    column's weight norm."""
    p = x[rows].double().pow(2).mean(0)
    total = p + history
    r = torch.where(total > 0, p / total.clamp_min(1e-300), torch.zeros_like(p))
    return ((1 - r) * history + r * p) * w4


def decided_config(cfg: ModelConfig, plan: Plan) -> ModelConfig:
    """`cfg` with each layer's kept heads and MLP width; untouched layers keep their own."""
    n = cfg.num_hidden_layers
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    kv = [len(plan.kv_groups[i]) if i in plan.kv_groups else cfg.kv_heads(i) for i in range(n)]
    return dataclasses.replace(
        cfg, layer_heads=tuple(k * group for k in kv), layer_kv_heads=tuple(kv),
        layer_intermediate=tuple(len(plan.channels[i]) if i in plan.channels else cfg.intermediate(i)
                                 for i in range(n)))


def first_plan(cfg: ModelConfig, keep: list[tuple[int, int]]) -> Plan:
    """A plan of the widths `keep` gives, keeping each layer's first groups and channels (the
    shape of every decision at one ratio)."""
    plan = Plan(list(range(cfg.num_hidden_layers)), {}, {})
    for i, (groups, width) in enumerate(keep):
        if (groups, width) != (cfg.kv_heads(i), cfg.intermediate(i)):
            plan.kv_groups[i] = list(range(groups))
            plan.channels[i] = list(range(width))
    return plan


def _cuts(cfg: ModelConfig, i: int, plan: Plan) -> list[tuple[str, int, torch.Tensor]]:
    """(tensor name, dim, kept indices) of layer `i`'s attention and MLP tensors, in brisk's own
    names and layout (q|k|v stacked, gate|up stacked)."""
    q_rows, kv_rows, ch = kept_rows(cfg, i, plan)
    qkv, gate_up = stacked_rows(cfg, i, q_rows, kv_rows, ch)
    p = f"layers.{i}."
    return [(p + "self_attn.qkv_proj.weight", 0, qkv), (p + "self_attn.qkv_proj.bias", 0, qkv),
            (p + "self_attn.o_proj.weight", 1, q_rows), (p + "mlp.gate_up_proj.weight", 0, gate_up),
            (p + "mlp.down_proj.weight", 1, ch)]


def load_probe(ref: str, pcfg: PruneConfig, *, dtype: str = "float32", device: str = "cpu",
               max_model_len: int | None = None) -> tuple[LoadedModel, ProbePruner]:
    """`LLM(pruning={"method": "probe", ...})`: the dense float model (a .gguf's blocks
    dequantized) and its pruner, the history scored on the calibration text."""
    from brisk.loader.load import load_model, model_config_of
    from brisk.loader.quantized import quantization_of

    check_probe(model_config_of(ref), pcfg)
    if not Path(pcfg.calibration or "").is_file():
        raise UserError(f"pruning calibration text {pcfg.calibration} is not a file")
    loaded = load_model(ref, dtype=dtype, device=device, max_model_len=max_model_len, dequantize=True)
    if loaded.source.kind == "hf" and quantization_of(loaded.source.path) is not None:
        raise UserError(f"{ref} is a quantized checkpoint: Probe Pruning cuts float weights; give the original model")
    return loaded, ProbePruner.from_loaded(loaded, pcfg)
