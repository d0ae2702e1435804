"""What every architecture shares: the `CausalLM` protocol the runtime speaks, and `DecoderLM`,
the machinery of a decoder-only stack that each architecture file builds on.

The runner, the parallel runner, speculation (early exit, Medusa, draft heads), tensor and
pipeline parallelism, quantization and the loaders use only what `CausalLM` names; an
architecture file (model/llama.py, model/gemma3.py) says how one layer computes, how tokens are
embedded and which rotary tables its layers use, nothing more.

The model is a function (habit 3): `forward(input_ids, positions, attn_metadata) -> hidden` over a
flat `[num_tokens]` batch of any mix of sequences; the attention metadata carries the KV cache.
`compute_logits` is separate so callers project only the rows they sample from.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from brisk.config import ModelConfig
from brisk.errors import UserError
from brisk.kernels import pack_supported, pack_weight
from brisk.model.attention import AttentionMetadata, ContiguousAttention, SeqSpan
from brisk.model.layers import WHOLE, Embedding, Linear, RMSNorm, linear
from brisk.model.rotary import partial_rotary_order, permute_heads, rope_tables

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) of this step's positions: [n, 1, head_dim] each


@runtime_checkable
class CausalLM(Protocol):
    """What the rest of brisk needs from an architecture."""

    config: ModelConfig
    layers: nn.ModuleList  # each layer: forward(h, residual, ropes, attn_metadata) -> (h, residual)
    embed_tokens: nn.Module
    lm_head: nn.Module | None  # None: tied to embed_tokens
    norm: nn.Module
    modules_version: int  # moves whenever the modules may have changed (runtime caches built over them go)

    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def max_positions(self) -> int: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                num_layers: int | None = None) -> torch.Tensor: ...
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...
    def run_layers(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                   attn_metadata: AttentionMetadata, start: int, end: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None]: ...
    def final_norm(self, h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor: ...
    def step_ropes(self, positions: torch.Tensor) -> list[Rope]: ...
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...
    def head_rows(self, ids: torch.Tensor) -> torch.Tensor: ...
    def head_subset(self, ids: torch.Tensor) -> nn.Module: ...
    def kv_heads_per_layer(self) -> list[int | None]: ...
    def linear_part(self, name: str) -> tuple[str, int] | None: ...
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...
    def pack_weights(self) -> int: ...
    def unpack_weights(self) -> None: ...
    def modules_changed(self) -> None: ...


# HF checkpoint names of projections that we stack into one Linear: name -> (our module, part).
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_UNSTACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_STACKED_RE = re.compile(r"^(layers\.\d+\.(?:self_attn|mlp))\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")


class DecoderLM(nn.Module):
    """A decoder-only stack: embedding, `num_hidden_layers` layers made by `make_layer`, a final
    norm, a tied or untied head. Subclasses set how a layer computes and may override `embed`,
    `rope_bases` and `load_tensor`."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(self.make_layer(cfg, i, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, (cfg.vocab_size,), False, dtype)
        positions = max_positions or cfg.max_position_embeddings
        # rotary tables, one pair per base (`rope_bases`); a layer's `rope_index` picks its pair
        self._rope_names: list[tuple[str, str]] = []  # buffer names of each (cos, sin) pair
        for i, (base, scaling) in enumerate(self.rope_bases()):
            cos, sin = rope_tables(cfg.head_dim, base, scaling, cfg.max_position_embeddings, positions,
                                   cfg.rotary_dim)
            names = ("rope_cos", "rope_sin") if i == 0 else (f"rope_cos_{i}", f"rope_sin_{i}")
            self.register_buffer(names[0], cos.to(dtype), persistent=False)  # [max_positions, head_dim]
            self.register_buffer(names[1], sin.to(dtype), persistent=False)
            self._rope_names.append(names)
        self._tied_head_packed: torch.Tensor | None = None  # the tied LM head's packed weight
        # moves whenever the modules may have changed (modules_changed): what the runtime built
        # over them (the C++ decode plan, CUDA graphs) is built again
        self.modules_version = 0

    # ---- what an architecture file provides -----------------------------------------------
    def make_layer(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        raise NotImplementedError

    def rope_bases(self) -> list[tuple[float, object]]:
        """(base, RopeScaling) of each rotary table; layers pick one by `rope_index` (default 0)."""
        return [(self.config.rope_theta, self.config.rope_scaling)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[n] token ids -> [n, hidden] inputs of the first layer."""
        return self.embed_tokens(input_ids)

    def load_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """An HF checkpoint tensor as this model stores it (Gemma keeps 1 + w in its norms)."""
        return tensor

    def save_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The inverse of `load_tensor`: a stored tensor as an HF checkpoint holds it."""
        return tensor

    def hf_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter under its HF checkpoint name, as a checkpoint stores it: the inverse of
        `load_weights` (stacked Linears split into q/k/v and gate/up, except Phi-3's fused ones;
        `save_tensor`; partial rotary's dims in HF's order). What `brisk distill` writes."""
        fused = self.config.architecture == "phi3"  # its checkpoints keep qkv_proj / gate_up_proj whole
        out: dict[str, torch.Tensor] = {}
        for name, param in self.named_parameters():
            if not param.dtype.is_floating_point:
                raise UserError(f"{name} is {param.dtype}: only a float model's weights are written as a checkpoint")
            module_name, _, leaf = name.rpartition(".")
            parent, _, kind = module_name.rpartition(".")
            module = self.get_submodule(module_name)
            pieces = [(name, param.detach())]
            if kind in _UNSTACKED and not fused and isinstance(module, Linear) and leaf in ("weight", "bias"):
                pieces = [(f"{parent}.{part}.{leaf}", piece)
                          for part, piece in zip(_UNSTACKED[kind], param.detach().split(module.output_sizes))]
            for hf_name, tensor in pieces:
                stored = rotary_layout(self.config, hf_name, self.save_tensor(hf_name, tensor), to_checkpoint=True)
                out[hf_name if hf_name.startswith("lm_head.") else f"model.{hf_name}"] = stored.contiguous()
        return out

    # ---- the protocol ---------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype, also after `.to(...)` and with quantized modules swapped in."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def max_positions(self) -> int:
        """Positions the rotary tables cover (the longest sequence this instance can run)."""
        return int(self.rope_cos.shape[0])

    def linear_part(self, name: str) -> tuple[str, int] | None:
        """The Linear module and part an HF checkpoint weight fills (e.g. k_proj -> qkv_proj, 1;
        Phi-3's fused qkv_proj -> qkv_proj, WHOLE); None for tensors that are not Linear weights
        (norms, embedding, biases)."""
        name = name.removeprefix("model.")
        m = _STACKED_RE.match(name)
        if m:
            module_name, part = _STACKED[m.group(2)]
            return (f"{m.group(1)}.{module_name}", part) if m.group(3) == "weight" else None
        module_name, _, leaf = name.rpartition(".")
        try:
            module = self.get_submodule(module_name) if module_name else None
        except AttributeError:
            return None
        if leaf != "weight" or not isinstance(module, Linear):
            return None
        return (module_name, 0 if len(module.output_sizes) == 1 else WHOLE)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata, num_layers: int | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden].

        `num_layers`: run only the first that many layers, then the final norm (early-exit
        self-speculation); their KV is written to the cache as in a full pass."""
        h = self.embed(input_ids)  # [n, hidden]
        end = len(self.layers) if num_layers is None else num_layers
        return self.final_norm(*self.run_layers(h, None, positions, attn_metadata, 0, end))

    def step_ropes(self, positions: torch.Tensor) -> list[Rope]:
        """Every rotary table looked up once for this step's positions."""
        out = []
        for cos_name, sin_name in self._rope_names:
            cos, sin = getattr(self, cos_name), getattr(self, sin_name)
            out.append((cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)))  # [n, 1, head_dim] each
        return out

    def run_layers(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                   attn_metadata: AttentionMetadata, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layers start..end-1 on (h, residual) [n, hidden] each: one pipeline stage's share of
        `forward`, whose (h, residual) travel to the next stage."""
        ropes = self.step_ropes(positions)
        layers = self.layers
        for i in range(start, end):
            h, residual = layers[i](h, residual, ropes, attn_metadata)
        return h, residual

    def load_state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.modules_changed()  # the quantized modules replace their buffers (untiled, new values)
        return super().load_state_dict(*args, **kwargs)

    def modules_changed(self) -> None:
        """Say that the modules may change: `modules_version` moves, so a runner's C++ decode plan
        (runtime/decode_plan.py) and CUDA graphs (runtime/decode_graphs.py), which hold pointers
        into them, are built again before their next step."""
        self.modules_version = getattr(self, "modules_version", 0) + 1

    def final_norm(self, h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self.norm(h if residual is None else h + residual)

    def kv_heads_per_layer(self) -> list[int | None]:
        """KV heads this process keeps for each layer (fewer under tensor parallelism); None for a
        layer it does not hold (another pipeline stage runs it)."""
        return [layer.self_attn.num_kv_heads if hasattr(layer, "self_attn") else None for layer in self.layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [rows, vocab] float32 logits."""
        if self.lm_head is None:
            logits = linear(hidden, self.embed_tokens.weight, None, self._tied_head_packed).float()
        else:
            logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the LM head's effective weight for token `ids`: [len(ids), hidden] float32
        (dequantized when the head is quantized). Draft heads project onto such a subset."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        dequantize = getattr(head, "dequantize_rows", None)
        if dequantize is not None:
            return dequantize(ids).float()
        return head.weight.index_select(0, ids).float()

    def head_subset(self, ids: torch.Tensor) -> nn.Module:
        """The LM head's rows for token `ids` as a module [rows, hidden] -> [rows, len(ids)]: in the
        head's stored format when it can select rows (group-quantized heads), else a float copy."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        select = getattr(head, "select_rows", None)
        if select is not None:
            return select(ids)
        rows = Linear(self.config.hidden_size, (len(ids),), dtype=self.dtype).to(ids.device)
        rows.weight.data = self.head_rows(ids).to(self.dtype).contiguous()
        return rows

    def pack_weights(self) -> int:
        """oneDNN-packed copies of every Linear and of a tied LM head, for batched rows on CPU
        (kernels.pack_weight). Returns the bytes the copies take; 0 where packing does not apply."""
        # Linear and the quantized modules that keep a packed copy (W8A8) share the pack() protocol
        nbytes = sum(m.pack() for m in self.modules() if m is not self and callable(getattr(m, "pack", None)))
        if self.lm_head is None:  # tied, not quantized: the head is the embedding matrix
            tied = self.embed_tokens.weight
            self._tied_head_packed = pack_weight(tied) if pack_supported(tied) else None
            if self._tied_head_packed is not None:
                nbytes += tied.numel() * tied.element_size()
        return nbytes

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self.unpack_weights()  # .to(device/dtype) would leave the packed copies behind
        return super()._apply(fn, recurse)

    def unpack_weights(self) -> None:
        """Drop the packed copies; runtime plans over the modules go too (they go stale when
        weights change or the model moves)."""
        self.modules_changed()
        for m in self.modules():
            if hasattr(m, "packed"):
                m.packed = None
        self._tied_head_packed = None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill parameters from HF-named tensors; every parameter must be provided exactly once."""
        self.unpack_weights()
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store a copy of the embedding
            tensor = self.load_tensor(name, rotary_layout(self.config, name, tensor))
            m = _STACKED_RE.match(name)
            if m:
                loaded.add(self._load_stacked(m, tensor))
                continue
            if name not in params:
                raise UserError(f"checkpoint tensor {name!r} has no place in a {self.config.architecture} model")
            if tuple(params[name].shape) != tuple(tensor.shape):
                raise UserError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the config expects "
                    f"{tuple(params[name].shape)}"
                )
            params[name].copy_(tensor)
            loaded.add(name)
        missing = _missing(set(params), loaded, self)
        if missing:
            raise UserError(f"checkpoint is missing tensors: {', '.join(sorted(missing)[:8])}"
                             f"{' …' if len(missing) > 8 else ''}")

    def _load_stacked(self, m: re.Match[str], tensor: torch.Tensor) -> str:
        """One part of a stacked Linear (q of qkv, up of gate|up); returns its loaded-name key."""
        module_name, part = _STACKED[m.group(2)]
        target = f"{m.group(1)}.{module_name}"
        stacked = self.get_submodule(target)
        assert isinstance(stacked, Linear)
        if m.group(3) == "weight":
            stacked.load_part(part, tensor)
        else:
            stacked.load_part_bias(part, tensor)
        return f"{target}.{m.group(3)}#{part}"


def rotary_layout(cfg: ModelConfig, name: str, tensor: torch.Tensor, to_checkpoint: bool = False) -> torch.Tensor:
    """A checkpoint tensor with partial rotary's q / k dims in the order brisk's kernels rotate
    (rotary.partial_rotary_order): q_proj, k_proj (weights, biases, block rows), the q and k part
    of a fused qkv_proj, QK-norm weights; every other tensor, and every tensor of a model whose
    heads rotate whole, as it is. `to_checkpoint`: the other way, brisk's order back to HF's."""
    order = partial_rotary_order(cfg.head_dim, cfg.rotary_dim)
    if order is None:
        return tensor
    if to_checkpoint:
        order = sorted(range(len(order)), key=order.__getitem__)  # the inverse permutation
    if name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
        return permute_heads(tensor, order, cfg.head_dim)
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):  # fused (Phi-3): q and k rows, v as it is
        layer = re.search(r"layers\.(\d+)\.", name)
        i = int(layer.group(1)) if layer else 0
        qk = (cfg.heads(i) + cfg.kv_heads(i)) * cfg.head_dim
        return torch.cat([permute_heads(tensor[:qk], order, cfg.head_dim), tensor[qk:]])
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return tensor[order]
    return tensor


@functools.cache
def embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden) rounded to `dtype` first, as HF's scaled embeddings multiply by it."""
    return float(torch.tensor(math.sqrt(hidden_size), dtype=dtype))


def contiguous_batch(model: CausalLM, seqs: list[list[int]], layers: int | None = None,
                     cache_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor, ContiguousAttention]:
    """Whole sequences as one flat batch over a fresh contiguous KV cache (one slot each, for the
    first `layers` layers, default all; `cache_len` tokens a slot, default the longest sequence's):
    input ids, positions and attention metadata for `model`."""
    cfg, device, dtype = model.config, model.device, model.dtype
    longest = cache_len or max(len(s) for s in seqs)
    shapes = [(len(seqs), cfg.kv_heads(i), longest, cfg.head_dim) for i in range(layers or cfg.num_hidden_layers)]
    caches = [(torch.empty(s, dtype=dtype, device=device), torch.empty(s, dtype=dtype, device=device)) for s in shapes]
    spans, offset = [], 0
    for slot, s in enumerate(seqs):
        spans.append(SeqSpan(slot, 0, len(s), offset))
        offset += len(s)
    ids = torch.tensor([t for s in seqs for t in s], device=device)
    positions = torch.cat([torch.arange(len(s), device=device) for s in seqs])
    return ids, positions, ContiguousAttention(caches, spans, scale=cfg.attn_scale)


@torch.inference_mode()
def forward_sequence(model: CausalLM, ids: list[int], num_layers: int | None = None) -> torch.Tensor:
    """One whole sequence through a fresh contiguous KV cache (evaluation, calibration, training
    data for heads): the final-normed hidden state of every position, [len(ids), hidden]."""
    return model(*contiguous_batch(model, [ids]), num_layers)


@torch.inference_mode()
def sample_batch(model: CausalLM, prompts: list[list[int]], max_new: list[int], generator: torch.Generator,
                 temperature: float = 1.0, top_p: float = 1.0, stop_ids: frozenset[int] = frozenset()
                 ) -> list[list[int]]:
    """Each prompt's sampled continuation through a fresh contiguous KV cache (calibration text,
    distillation data; serving goes through the engine): one prefill, then a token a step for the
    sequences still going, each until `max_new[i]` tokens or a stop id (kept). Tokens are drawn on
    the CPU from `generator`, so a seed gives the same text on any device."""
    device = model.device
    seqs = [list(p) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    ids, positions, meta = contiguous_batch(model, seqs, cache_len=max(len(p) + n for p, n in zip(prompts, max_new)))
    hidden = model(ids, positions, meta)
    live = [i for i, n in enumerate(max_new) if n > 0]
    last = [meta.seqs[i].query_start + meta.seqs[i].num_tokens - 1 for i in live]
    while live:
        drawn = _draw(model.compute_logits(hidden[torch.tensor(last, device=device)]), generator, temperature, top_p)
        for i, tok in zip(live, drawn):
            outs[i].append(tok)
            seqs[i].append(tok)
        live = [i for i in live if outs[i][-1] not in stop_ids and len(outs[i]) < max_new[i]]
        if not live:
            break
        meta = ContiguousAttention(meta.kv_caches, [SeqSpan(i, len(seqs[i]) - 1, 1, k) for k, i in enumerate(live)],
                                   scale=meta.scale)
        ids = torch.tensor([seqs[i][-1] for i in live], device=device)
        positions = torch.tensor([len(seqs[i]) - 1 for i in live], device=device)
        hidden = model(ids, positions, meta)
        last = list(range(len(live)))
    return outs


def _draw(logits: torch.Tensor, generator: torch.Generator, temperature: float, top_p: float) -> list[int]:
    """One token per row of logits [b, vocab]: greedy at temperature 0, else sampled from the
    smallest set of tokens whose probability reaches `top_p`."""
    if temperature == 0:
        return logits.argmax(dim=-1).tolist()
    probs = torch.softmax(logits.float() / temperature, dim=-1).cpu()
    if top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        sorted_p[(sorted_p.cumsum(dim=-1) - sorted_p) >= top_p] = 0  # past the nucleus (its first token stays)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1).tolist()


def _missing(expected: set[str], loaded: set[str], model: nn.Module) -> set[str]:
    """Parameters not filled; a stacked Linear counts as filled when all its parts are."""
    missing = set()
    for name in expected:
        if name in loaded:
            continue
        module_name, _, kind = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, Linear) and len(module.output_sizes) > 1:
            if all(f"{name}#{i}" in loaded for i in range(len(module.output_sizes))):
                continue
        missing.add(name)
    return missing
