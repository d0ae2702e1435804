"""Static pruning: a smaller dense model, scored on calibration text (`brisk prune`, `LLM(pruning=...)`).

Two methods (config.PruneConfig):

- **structured**: whole KV groups of attention heads (a group's query heads, its key and value
  head and their o_proj columns: the model stays exact GQA) and MLP channels (gate and up rows,
  down_proj columns). Importance is FLAP's (An et al., AAAI 2024) fluctuation metric: per input
  channel of o_proj / down_proj, the variance of that channel over the calibration tokens times
  the squared norm of the weight column it multiplies (how much the output moves when the channel
  is replaced by its mean); attention scores are squared as in FLAP's code. Scores are standardized
  per layer and module and compared globally (FLAP's "AL-AM" structure), with each group and
  channel weighted by the parameters it carries, so layers keep different widths; the pruned
  channels' mean contribution is added back as an o_proj / down_proj bias (FLAP's bias
  compensation, `bias_compensation`). FLAP over Wanda-sp (|W| x ||x|| summed per structure): in
  FLAP's own table Wanda-sp needs retraining to stay usable at 20-50% while FLAP's variance metric
  with compensation does not (LLaMA-7B at 20%: WikiText-2 perplexity 14.6 vs 22.1), and the global
  standardized search is what gives per-layer widths without a hand-set schedule.
- **layers**: whole decoder layers, the ones whose output hidden state is most like their input
  (ShortGPT's block influence, Men et al., 2024: 1 - mean cosine(x_in, x_out)).

The result is a dense model with per-layer head counts and MLP widths (ModelConfig.layer_heads,
layer_kv_heads, layer_intermediate, output_bias), written as an HF-format directory whose config
carries them (loader/hf_loader.py LAYERS_KEY) or loaded straight into an engine.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from brisk.config import ModelConfig, PruneConfig, QuantConfig
from brisk.errors import UserError
from brisk.loader.load import (
    LoadedModel,
    load_model,
    model_config_of,
    quantize_model,
    read_checkpoint,
    torch_dtype,
)
from brisk.loader.tokenizer import Tokenizer
from brisk.model.base import CausalLM, forward_sequence
from brisk.model.registry import build_model

WINDOW = 1024  # tokens per calibration forward (fewer where the model's positions are fewer)
PRUNING_KEY = "brisk_pruning"  # config.json: how a pruned directory was made (eval ppl reports it)


@dataclass
class ChannelStats:
    """Mean and variance of each input channel of one Linear over the calibration tokens."""

    rows: int = 0
    total: torch.Tensor | None = None  # [in] float64
    squares: torch.Tensor | None = None  # [in] float64

    def add(self, x: torch.Tensor) -> None:
        x = x.double()
        s, ss = x.sum(0), (x * x).sum(0)
        self.total = s if self.total is None else self.total + s
        self.squares = ss if self.squares is None else self.squares + ss
        self.rows += x.shape[0]

    @property
    def mean(self) -> torch.Tensor:
        assert self.total is not None
        return self.total / self.rows

    @property
    def variance(self) -> torch.Tensor:
        """Unbiased, as FLAP's running estimate."""
        assert self.total is not None and self.squares is not None and self.rows > 1
        return ((self.squares - self.total * self.total / self.rows) / (self.rows - 1)).clamp_min(0)


@dataclass
class Calibration:
    attn: list[ChannelStats] = field(default_factory=list)  # per layer: o_proj's inputs
    mlp: list[ChannelStats] = field(default_factory=list)  # per layer: down_proj's inputs
    influence: list[float] = field(default_factory=list)  # per layer: 1 - mean cos(stream in, stream out)
    tokens: int = 0


@dataclass
class Plan:
    """What each kept layer keeps: original layer indices, its KV groups and MLP channels (sorted)."""

    layers: list[int]
    kv_groups: dict[int, list[int]]
    channels: dict[int, list[int]]


@dataclass
class Pruned:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # HF names and conventions, as a checkpoint stores them
    report: dict[str, Any]


# ---------------------------------------------------------------------------------- checks
def check_prunable(cfg: ModelConfig, pcfg: PruneConfig) -> None:
    """The ValueError a ratio or model shape would hit, before anything is loaded or scored."""
    n = cfg.num_hidden_layers
    if pcfg.method == "2:4":
        widths = {cfg.hidden_size, cfg.head_dim} | {cfg.intermediate(i) for i in range(n)}
        bad = sorted(w for w in widths if w % 4)
        if bad:
            raise UserError(f"2:4 sparsity needs every Linear's input width divisible by 4; this model has {bad[0]}")
        return
    if pcfg.method == "layers":
        drop = round(pcfg.ratio * n)
        if drop < 1 or drop >= n:
            raise UserError(f"pruning ratio {pcfg.ratio:g} of {n} layers removes {drop}: choose a ratio that removes "
                             f"1 to {n - 1} layers ({1 / n:.3f} to {(n - 1) / n:.3f})")
        return
    narrow = [i for i in range(n) if cfg.intermediate(i) < pcfg.multiple]
    if narrow:
        raise UserError(f"layer {narrow[0]}'s MLP is {cfg.intermediate(narrow[0])} channels, fewer than the multiple "
                         f"{pcfg.multiple} widths are kept in: lower \"multiple\"")
    floor = sum(_group_cost(cfg) + pcfg.multiple * _channel_cost(cfg) for _ in range(n))
    total = sum(cfg.layer_params(i) for i in range(n))
    if (1 - pcfg.ratio) * total < floor:
        raise UserError(f"pruning ratio {pcfg.ratio:g} would leave some layer no attention head or no MLP channel "
                         f"(each keeps at least one KV group and {pcfg.multiple} channels, "
                         f"{1 - floor / total:.2f} of the weights at most can go): lower the ratio or use method "
                         "\"layers\"")


def check_before_load(ref: str, pcfg: PruneConfig) -> None:
    """What can be refused from the model's config and the calibration path alone."""
    check_prunable(model_config_of(ref), pcfg)
    if not Path(pcfg.calibration or "").is_file():
        raise UserError(f"pruning calibration text {pcfg.calibration} is not a file")


def calibration_ids(tokenizer: Tokenizer, pcfg: PruneConfig) -> list[int]:
    assert pcfg.calibration is not None
    path = Path(pcfg.calibration)
    if not path.is_file():
        raise UserError(f"pruning calibration text {path} is not a file")
    ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
    if len(ids) < 256:
        raise UserError(f"pruning calibration text {path} gives {len(ids)} tokens; at least 256 are needed "
                         f"(a few thousand are better; {pcfg.calibration_tokens} are used)")
    return ids[:pcfg.calibration_tokens]


# ---------------------------------------------------------------------------- calibration
@torch.inference_mode()
def calibrate(model: CausalLM, ids: list[int]) -> Calibration:
    """Forward `ids` in windows; keep o_proj / down_proj input statistics and each layer's block
    influence. The model is not changed."""
    cal = Calibration()
    layers = list(model.layers)
    cal.attn = [ChannelStats() for _ in layers]
    cal.mlp = [ChannelStats() for _ in layers]
    cos_sum = [0.0] * len(layers)

    def stats_hook(stats: ChannelStats) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        return lambda _m, args: stats.add(args[0].reshape(-1, args[0].shape[-1]))

    def influence_hook(i: int) -> Callable[[nn.Module, tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]], None]:
        def hook(_m: nn.Module, args: tuple[Any, ...], out: tuple[torch.Tensor, torch.Tensor]) -> None:
            h, residual = args[0], args[1]
            stream_in = h if residual is None else h + residual
            cos_sum[i] += float(torch.cosine_similarity(stream_in.double(), (out[0] + out[1]).double(), dim=-1).sum())
        return hook

    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(stats_hook(cal.attn[i])))
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(stats_hook(cal.mlp[i])))
        hooks.append(layer.register_forward_hook(influence_hook(i)))
    window = min(WINDOW, model.max_positions)
    model.pack_weights()  # windows of 1024 rows: the packed GEMM is ~1.5x torch's here (copies dropped below)
    try:
        for start in range(0, len(ids), window):
            chunk = ids[start:start + window]
            if len(chunk) > 1:
                forward_sequence(model, chunk)
                cal.tokens += len(chunk)
    finally:
        for h in hooks:
            h.remove()
        model.unpack_weights()
    cal.influence = [1.0 - c / cal.tokens for c in cos_sum]
    return cal


# ------------------------------------------------------------------------------- planning
def _group_cost(cfg: ModelConfig) -> int:
    """Weights of one KV group: its query heads' q and o slices, its key and value head."""
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    return cfg.hidden_size * cfg.head_dim * (2 * group + 2)


def _channel_cost(cfg: ModelConfig) -> int:
    return 3 * cfg.hidden_size  # a gate row, an up row, a down column


def _standardize(x: torch.Tensor) -> torch.Tensor:
    std = x.std()
    return (x - x.mean()) / (std if std > 0 else 1.0)


def structure_scores(model: CausalLM, cal: Calibration) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """FLAP's standardized fluctuation scores: per layer one per KV group and one per MLP channel."""
    cfg = model.config
    group_scores, channel_scores = [], []
    for i, layer in enumerate(model.layers):
        w_o = layer.self_attn.o_proj.weight.double()  # [hidden, heads * hd]
        attn = (cal.attn[i].variance * w_o.pow(2).sum(0)) ** 2
        group_scores.append(_standardize(attn).view(cfg.kv_heads(i), -1).mean(1))
        w_down = layer.mlp.down_proj.weight.double()  # [hidden, inter]
        channel_scores.append(_standardize(cal.mlp[i].variance * w_down.pow(2).sum(0)))
    return group_scores, channel_scores


def structured_plan(model: CausalLM, cal: Calibration, pcfg: PruneConfig) -> Plan:
    """Keep the highest-scoring groups and channels over all layers until (1 - ratio) of the
    layers' weights are kept; every layer keeps its best KV group and its MLP width rounded to
    `multiple` (nearest, at least one multiple)."""
    cfg = model.config
    groups, channels = structure_scores(model, cal)
    scores = torch.cat([*groups, *channels])
    costs = torch.cat([torch.full((len(g),), float(_group_cost(cfg)), dtype=torch.float64) for g in groups]
                      + [torch.full((len(c),), float(_channel_cost(cfg)), dtype=torch.float64) for c in channels])
    order = torch.argsort(scores, descending=True)
    target = (1 - pcfg.ratio) * float(costs.sum())
    kept_cost = torch.cumsum(costs[order], 0)
    cut = int(torch.argmin((kept_cost - target).abs()))
    threshold = float(scores[order[cut]])
    plan = Plan(list(range(cfg.num_hidden_layers)), {}, {})
    for i in range(cfg.num_hidden_layers):
        g = groups[i]
        keep = (g >= threshold).nonzero().flatten().tolist() or [int(g.argmax())]
        plan.kv_groups[i] = sorted(keep)
        c = channels[i]
        width = int((c >= threshold).sum())
        width = min(c.numel(), max(pcfg.multiple, pcfg.multiple * round(width / pcfg.multiple)))
        plan.channels[i] = sorted(torch.topk(c, width).indices.tolist())
    return plan


def layers_plan(cal: Calibration, pcfg: PruneConfig) -> Plan:
    n = len(cal.influence)
    drop = set(sorted(range(n), key=lambda i: cal.influence[i])[:round(pcfg.ratio * n)])
    return Plan([i for i in range(n) if i not in drop], {}, {})


# ------------------------------------------------------------------------------- slicing
_LAYER_RE = re.compile(r"^(model\.)?layers\.(\d+)\.(.+)$")


def kept_rows(cfg: ModelConfig, i: int, plan: Plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kept q rows, kv rows (per k or v) and MLP channels of original layer `i`."""
    hd, group = cfg.head_dim, cfg.heads(i) // cfg.kv_heads(i)
    kv = plan.kv_groups.get(i, list(range(cfg.kv_heads(i))))
    q_rows = [r for g in kv for r in range(g * group * hd, (g + 1) * group * hd)]
    kv_rows = [r for g in kv for r in range(g * hd, (g + 1) * hd)]
    ch = plan.channels.get(i, list(range(cfg.intermediate(i))))
    return torch.tensor(q_rows), torch.tensor(kv_rows), torch.tensor(ch)


def _compensation(weight: torch.Tensor, mean: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """What the dropped input channels added on average: W[:, dropped] @ mean[dropped]."""
    dropped = torch.ones(weight.shape[1], dtype=torch.bool)
    dropped[kept] = False
    return (weight.double()[:, dropped] @ mean[dropped]).to(weight.dtype)


def slice_tensors(cfg: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]], plan: Plan,
                  cal: Calibration | None, bias: bool) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with the plan's layers renumbered and their heads and channels
    cut; o_proj / down_proj biases compensating the cut channels where `bias` (and `cal`)."""
    new_index = {old: new for new, old in enumerate(plan.layers)}
    out: dict[str, torch.Tensor] = {}
    extra: dict[str, torch.Tensor] = {}  # compensation biases, added to any bias the checkpoint has
    for name, tensor in weights:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        m = _LAYER_RE.match(name)
        if m is None:
            out[name] = tensor
            continue
        i, rest = int(m.group(2)), m.group(3)
        if i not in new_index:
            continue
        q, kv, ch = kept_rows(cfg, i, plan)
        new_name = f"{m.group(1) or ''}layers.{new_index[i]}.{rest}"
        out[new_name] = _cut(cfg, i, rest, tensor, q, kv, ch)
        if bias and cal is not None and rest in _COMPENSATED:
            stats, kept = (cal.attn[i], q) if rest.startswith("self_attn") else (cal.mlp[i], ch)
            extra[new_name.removesuffix(".weight") + ".bias"] = _compensation(tensor, stats.mean, kept)
    for name, b in extra.items():
        out[name] = b if name not in out else out[name] + b
    return out


_COMPENSATED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def stacked_rows(cfg: ModelConfig, i: int, q: torch.Tensor, kv: torch.Tensor,
                 ch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept rows of layer `i`'s stacked q|k|v and gate|up weights (Phi-3's fused tensors,
    brisk's own Linears) from its kept q rows, kv rows and MLP channels."""
    q_size, kv_size, inter = cfg.heads(i) * cfg.head_dim, cfg.kv_heads(i) * cfg.head_dim, cfg.intermediate(i)
    return torch.cat([q, q_size + kv, q_size + kv_size + kv]), torch.cat([ch, inter + ch])


def _cut(cfg: ModelConfig, i: int, rest: str, t: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
         ch: torch.Tensor) -> torch.Tensor:
    """One layer tensor (HF name `rest` within the layer) with the dropped heads / channels removed."""
    kind = rest.rsplit(".", 1)[0]
    if kind == "self_attn.q_proj":
        return t[q].contiguous()
    if kind in ("self_attn.k_proj", "self_attn.v_proj"):
        return t[kv].contiguous()
    if kind == "self_attn.qkv_proj":  # fused (Phi-3)
        return t[stacked_rows(cfg, i, q, kv, ch)[0]].contiguous()
    if rest == "self_attn.o_proj.weight":
        return t[:, q].contiguous()
    if kind in ("mlp.gate_proj", "mlp.up_proj"):
        return t[ch].contiguous()
    if kind == "mlp.gate_up_proj":  # fused (Phi-3)
        return t[stacked_rows(cfg, i, q, kv, ch)[1]].contiguous()
    if rest == "mlp.down_proj.weight":
        return t[:, ch].contiguous()
    return t  # norms, biases of o_proj / down_proj (per output row: unchanged)


# ------------------------------------------------------------------------------- drivers
def pruned_config(cfg: ModelConfig, plan: Plan, bias: bool) -> ModelConfig:
    """`cfg` with the plan's layers and each one's kept heads and MLP width."""
    keep = plan.layers
    structured = bool(plan.kv_groups)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    kv = [len(plan.kv_groups[i]) if structured else cfg.kv_heads(i) for i in keep]
    return dataclasses.replace(
        cfg, num_hidden_layers=len(keep),
        layer_types=tuple(cfg.layer_types[i] for i in keep) if cfg.layer_types else (),
        layer_heads=tuple(k * group for k in kv) if structured or cfg.layer_heads else (),
        layer_kv_heads=tuple(kv) if structured or cfg.layer_kv_heads else (),
        layer_intermediate=tuple(len(plan.channels[i]) if structured else cfg.intermediate(i) for i in keep)
        if structured or cfg.layer_intermediate else (),
        output_bias=cfg.output_bias or (structured and bias))


def model_params(cfg: ModelConfig) -> int:
    """Parameters of the weights that matter for size: embedding, head, the layers' Linears."""
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return cfg.vocab_size * cfg.hidden_size + head + sum(cfg.layer_params(i) for i in range(cfg.num_hidden_layers))


def prune_loaded(loaded: LoadedModel, pcfg: PruneConfig, ref: str) -> Pruned:
    """Score `loaded` (the float model of `ref`) on the calibration text and cut its checkpoint's tensors."""
    cfg = loaded.config
    check_prunable(cfg, pcfg)
    ids = calibration_ids(loaded.tokenizer, pcfg)
    started = time.perf_counter()
    cal = calibrate(loaded.model, ids)
    plan = structured_plan(loaded.model, cal, pcfg) if pcfg.method == "structured" else layers_plan(cal, pcfg)
    bias = pcfg.bias_compensation and pcfg.method == "structured"
    _, _, weights = read_checkpoint(loaded.source)
    tensors = slice_tensors(cfg, weights, plan, cal, bias)
    new_cfg = pruned_config(cfg, plan, bias)
    layer_weights = [sum(c.layer_params(i) for i in range(c.num_hidden_layers)) for c in (cfg, new_cfg)]
    report = {
        "method": pcfg.method, "ratio": pcfg.ratio, "source": ref,
        "layer_weights_removed": round(1 - layer_weights[1] / layer_weights[0], 4),
        "params": model_params(new_cfg), "params_dense": model_params(cfg),
        "layers_kept": plan.layers if pcfg.method == "layers" else None,
        "kv_heads": list(new_cfg.layer_kv_heads) or None, "mlp_widths": list(new_cfg.layer_intermediate) or None,
        "bias_compensation": bias, "calibration": pcfg.calibration, "calibration_tokens": cal.tokens,
        "seconds": round(time.perf_counter() - started, 2),
    }
    return Pruned(new_cfg, tensors, report)


def _dense_float(ref: str, device: str, max_model_len: int | None = None) -> LoadedModel:
    """The float32 model pruning scores (a quantized GGUF's blocks dequantized)."""
    from brisk.loader.quantized import quantization_of

    loaded = load_model(ref, dtype="float32", device=device, max_model_len=max_model_len, dequantize=True)
    if loaded.source.kind == "hf" and quantization_of(loaded.source.path) is not None:
        raise UserError(f"{ref} is a quantized checkpoint: prune the original model, then quantize the pruned "
                         "one (-q METHOD or `brisk quantize`)")
    return loaded


def prune_to_dir(ref: str, pcfg: PruneConfig, out: Path, dtype: str = "float32", device: str = "cpu",
                 quant: QuantConfig | None = None) -> dict[str, Any]:
    """`brisk prune`: write an HF-format directory of the pruned model (2:4: a quantized-format
    one holding the packed weights, int8 values with `quant` int8); returns the report."""
    from safetensors.torch import save_file

    from brisk.loader.convert import write_tokenizer_files
    from brisk.loader.hf_loader import hf_config_dict

    if pcfg.method == "probe":
        raise UserError("Probe Pruning decides per batch at run time, so there is no pruned model to write: give "
                         "--pruning '{\"method\": \"probe\", ...}' to generate / eval ppl")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    check_before_load(ref, pcfg)
    if pcfg.method == "2:4":
        return _sparse_to_dir(ref, pcfg, out, dtype, quant)
    if quant is not None:
        raise UserError("quantize a pruned directory when loading it (-q METHOD), or with `brisk quantize DIR`")
    loaded = _dense_float(ref, device, None)
    if loaded.source.kind == "hf" and out.resolve() == loaded.source.path.resolve():
        raise UserError("--out must differ from the source directory")
    pruned = prune_loaded(loaded, pcfg, ref)
    tdtype = torch_dtype(dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(tdtype).contiguous() for k, v in pruned.tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = hf_config_dict(pruned.config, dtype)
    config[PRUNING_KEY] = pruned.report
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer_files(loaded.tokenizer, pruned.config, out)
    return pruned.report


def _sparse_report(cfg: ModelConfig, pcfg: PruneConfig, ref: str, quant: QuantConfig, seconds: float) -> dict[str, Any]:
    layers = sum(cfg.layer_params(i) for i in range(cfg.num_hidden_layers))
    return {"method": "2:4", "ratio": 0.5, "source": ref, "layer_weights_removed": 0.5,
            "params": model_params(cfg) - layers // 2, "params_dense": model_params(cfg), "values": quant.describe(),
            "calibration": pcfg.calibration, "calibration_tokens": pcfg.calibration_tokens, "seconds": round(seconds, 2)}


def _sparse_to_dir(ref: str, pcfg: PruneConfig, out: Path, dtype: str, quant: QuantConfig | None) -> dict[str, Any]:
    from brisk.loader.convert import quantize_to_dir

    sparse = pcfg.sparse_quant(quant)
    started = time.perf_counter()
    quantize_to_dir(ref, sparse, out, dtype)
    report = _sparse_report(model_config_of(ref), pcfg, ref, sparse, time.perf_counter() - started)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    config[PRUNING_KEY] = report
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return report


def pruning_of(path: Path) -> dict[str, Any] | None:
    """How a directory written by `brisk prune` was made; None for any other model."""
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw.get(PRUNING_KEY) if isinstance(raw, dict) else None


def load_pruned(ref: str, pcfg: PruneConfig, *, dtype: str = "float32", device: str = "cpu",
                max_model_len: int | None = None, quant: QuantConfig | None = None) -> tuple[LoadedModel, dict[str, Any]]:
    """`LLM(pruning=...)`: prune at load, then quantize with `quant`; the model `brisk prune`
    would write and `--model DIR` load, without the directory."""
    from brisk.quant import set_activations

    check_before_load(ref, pcfg)
    window = model_config_of(ref).max_position_embeddings
    if max_model_len is not None and max_model_len > window:
        raise UserError(f"max_model_len {max_model_len} exceeds the model's context window ({window} tokens)")
    # Scoring runs at the model's own positions (calibration windows of WINDOW tokens), whatever
    # `max_model_len` is: the same model as `brisk prune` writes.
    if pcfg.method == "2:4":
        sparse = pcfg.sparse_quant(quant)
        started = time.perf_counter()
        loaded = load_model(ref, dtype=dtype, device=device, quant=sparse)
        return loaded, _sparse_report(loaded.config, pcfg, ref, sparse, time.perf_counter() - started)
    dense = _dense_float(ref, device, None)
    pruned = prune_loaded(dense, pcfg, ref)
    tokenizer, source = dense.tokenizer, dense.source
    del dense  # the dense model's memory goes before the pruned one is built
    tdtype, cfg = torch_dtype(dtype), pruned.config
    with torch.device(device):
        model = build_model(cfg, tdtype, max_positions=max_model_len or cfg.max_position_embeddings)
    with torch.no_grad():
        model.load_weights((k, v.to(tdtype)) for k, v in pruned.tensors.items())
    if quant is not None:
        quantize_model(model, quant, source, cfg, tokenizer)
        set_activations(model, quant.act_mode)
    return LoadedModel(model.eval(), tokenizer, cfg, source, quant), pruned.report

