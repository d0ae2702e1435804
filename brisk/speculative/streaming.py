"""Speculative Streaming (Bhendawade et al., 2024): the target drafts its own next tokens.

The top `Ns` layers of the target also run gamma "stream" rows per position t. Stream j starts
from the residual stream entering layer L - Ns at t plus a learned stream embedding e_j, sits at
position t + j, attends to the main stream's keys and values up to t (the KV cache) and to the
streams j' <= j of the same t, and its final hidden state through the LM head predicts token
t + 1 + j: future n-gram prediction with attention over the whole context, which plain heads
(Medusa) lack. No main-stream row attends to a stream row.

brisk adds one input the paper's streams lack: the token x[t+1] that the row at t produced, known
when drafting, enters every stream row through a low-rank map of its embedding (Hydra's lesson for
Medusa heads). Without it stream 1 has to guess x[t+2] from a state that holds only a distribution
over x[t+1]: on SmolLM2 with 4 stream layers, 6-9% held-out top-1 after training (the untrained
stream reproduces x[t+1] 98.6% of the time, so the wiring was right and the task was the problem).

brisk's variant also keeps the main stream frozen: LoRA adapters on the top layers' projections act on
the stream rows only (forward hooks added for the stream pass), so the model that verifies, and
whose tokens come out, is exactly the original: lossless with respect to the model the user
loaded, perplexity change 0 by construction, extra parameters gamma x hidden + the adapters
(~0.2% of SmolLM2-135M at rank 8 over 4 layers). The paper fine-tunes the main stream too; that
trades the original model's quality for acceptance, and measured on SmolLM2 (a rank-16 LoRA on the
main rows of the 8 stream layers, with a KL term to the original) it bought none: held-out stream
agreement within 0.005 of training the streams alone, while 2-3% of the model's greedy tokens
changed (BENCHMARKS.md, "Fine-tuning the main stream, measured").

Decoding (`speculative_config={"method": "streaming", "heads": FILE}`): the runner keeps the
residual stream entering layer L - Ns of every sampled row (`PagedModelRunner.capture_layer`);
the proposer takes the row that produced each request's newest token (at position t = p - 1, its
KV already in the cache) and runs its gamma stream rows through the top Ns layers: gamma drafts in
one pass over Ns / L of the weights, verified as a top-1 chain by the shared verifier (greedy
identical to plain decoding, exact rejection sampling otherwise). The pass is an ordinary step of
gamma rows over the paged cache (their keys and values go to the draft slots the verify step then
overwrites: `StreamingProposer`), so the C++ decode plan runs it, adapters included.

File (`brisk train-heads --kind streaming`): safetensors with `streams` [gamma, hidden], the token
map `token_a` [token_rank, hidden] and `token_b` [hidden, token_rank], per
adapted projection `lora_a.<layer>.<name>` [rank, in] and `lora_b.<layer>.<name>` [out, rank],
optionally `vocab` (the draft vocabulary, FR-Spec); metadata kind, num_streams, first_layer,
rank, token_rank, base_model, hidden_size, num_layers.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from brisk.config import STREAM_PASS_QUANTIZATIONS, ModelConfig
from brisk.core.outputs import ScheduledRequest
from brisk.errors import UserError
from brisk.model.base import CausalLM
from brisk.speculative.base import Draft, DraftRequest, Proposer, pick_draft_token
from brisk.speculative.heads import DraftVocab, read_heads_file, stored_draft_vocab, write_safetensors
from brisk.speculative.registry import ProposerContext, register

KIND = "streaming"
KV = tuple[torch.Tensor, torch.Tensor]  # keys, values of the main stream: [positions, kv_heads, head_dim] each


# the adapted projections, in the order the C++ decode plan holds a layer's Linears
PLAN_ORDER = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def lora_targets(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, int]]:
    """The projections of a layer that get adapters: name -> (in features, out features)."""
    hd, hidden = cfg.head_dim, cfg.hidden_size
    q, kv, width = cfg.heads(layer) * hd, cfg.kv_heads(layer) * hd, cfg.intermediate(layer)
    return dict(zip(PLAN_ORDER, ((hidden, q + 2 * kv), (q, hidden), (hidden, 2 * width), (width, hidden))))


class StreamAdapter(nn.Module):
    """The extra parameters: gamma stream embeddings and rank-r LoRA on the top layers. B starts at
    zero, so an untrained adapter runs the stream rows through the original layers."""

    def __init__(self, cfg: ModelConfig, num_streams: int, num_layers: int, rank: int = 8,
                 dtype: torch.dtype = torch.float32, token_rank: int | None = None) -> None:
        super().__init__()
        total = cfg.num_hidden_layers
        if not 1 <= num_layers < total:
            raise UserError(f"streams run through 1..{total - 1} top layers of this {total}-layer model, got {num_layers}")
        if not 1 <= num_streams <= 15:
            raise UserError(f"num_streams must be 1..15 (one draft token each), got {num_streams}")
        if not 1 <= rank <= 256:
            raise UserError(f"the LoRA rank must be 1..256, got {rank}")
        self.first_layer = total - num_layers
        self.rank = rank
        self.streams = nn.Parameter(torch.zeros(num_streams, cfg.hidden_size, dtype=dtype))
        token_rank = token_rank or min(64, cfg.hidden_size // 4)
        # x[t+1] enters every stream row through a rank-`token_rank` map of its embedding (zero at
        # first): the token is known when drafting, and without it stream 1 must guess x[t+2]
        # from a state that only holds a distribution over x[t+1] (measured on SmolLM2: 6% top-1)
        self.token_a = nn.Parameter(torch.randn(token_rank, cfg.hidden_size, dtype=dtype) / cfg.hidden_size ** 0.5)
        self.token_b = nn.Parameter(torch.zeros(cfg.hidden_size, token_rank, dtype=dtype))
        self.lora_a = nn.ParameterDict()
        self.lora_b = nn.ParameterDict()
        for layer in range(self.first_layer, total):
            for name, (n_in, n_out) in lora_targets(cfg, layer).items():
                key = _key(layer, name)
                self.lora_a[key] = nn.Parameter(torch.randn(rank, n_in, dtype=dtype) / n_in ** 0.5)
                self.lora_b[key] = nn.Parameter(torch.zeros(n_out, rank, dtype=dtype))

    @property
    def num_streams(self) -> int:
        return self.streams.shape[0]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def stream_inputs(self, model: CausalLM, start: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """[m, hidden] residual streams and [m] tokens x[t+1] -> the first stream layer's input
        [m x num_streams, hidden], anchor-major."""
        emb = model.embed(next_tokens).to(self.token_a.dtype)  # [m, hidden]
        emb = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + 1e-6)  # unit RMS, whatever the embedding's scale
        h = start.to(self.token_a.dtype) + F.linear(F.linear(emb, self.token_a), self.token_b)
        return (h.unsqueeze(1) + self.streams).reshape(-1, h.shape[-1])

    def plan_adapters(self) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
        """The adapters as the C++ decode plan takes them: (layer, linear) -> (a, b), the linear by
        its place in the plan's order (qkv, o, gate_up, down: `lora_targets`' order)."""
        out = {}
        for key in self.lora_a:
            layer, name = _unkey(key)
            out[(layer, PLAN_ORDER.index(name))] = (self.lora_a[key].detach(), self.lora_b[key].detach())
        return out

    @contextlib.contextmanager
    def active(self, model: CausalLM) -> Iterator[None]:
        """Within: the top layers' projections add their adapters' output (the stream pass)."""
        handles = []
        for key in self.lora_a:
            layer, name = _unkey(key)
            module = model.layers[layer].get_submodule(name)
            handles.append(module.register_forward_hook(self._hook(key)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _hook(self, key: str) -> Callable[..., torch.Tensor]:
        a, b = self.lora_a[key], self.lora_b[key]

        def add(_module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
            x = inputs[0]
            return out + F.linear(F.linear(x.to(a.dtype), a), b).to(out.dtype)
        return add


def _key(layer: int, name: str) -> str:
    return f"{layer}:{name.replace('.', '/')}"  # ParameterDict keys may not hold dots


def _unkey(key: str) -> tuple[int, str]:
    layer, name = key.split(":")
    return int(layer), name.replace("/", ".")


@dataclass
class StreamSegment:
    """One sequence's stream rows: `anchors` [m] positions t (each with num_streams rows, stream j
    at t + j, rows ordered anchor-major), the token x[t+1] each anchor's row produced, over the
    main stream's KV `main[layer]` (positions 0..T-1, T > every anchor)."""

    anchors: torch.Tensor  # [m] long
    next_tokens: torch.Tensor  # [m] long: x[t+1]
    main: Callable[[int], KV]


@dataclass
class StreamAttention:
    """Attention metadata for stream rows laid out segment after segment: row (t, j) sees the main
    stream's keys <= t (within the layer's window from its own position t + j) and the rows
    (t, j' <= j). Writes nothing: training's pass (autograd runs through it)."""

    segments: list[StreamSegment]
    num_streams: int
    scale: float | None = None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0) -> torch.Tensor:
        outs, start = [], 0
        for seg in self.segments:
            rows = slice(start, start + len(seg.anchors) * self.num_streams)
            main_k, main_v = seg.main(layer)
            outs.append(self._one(seg.anchors, q[rows], k[rows], v[rows], main_k, main_v, window))
            start = rows.stop
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _one(self, anchors: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, main_k: torch.Tensor,
             main_v: torch.Tensor, window: int) -> torch.Tensor:
        g, dev = self.num_streams, q.device
        m, heads, hd = anchors.shape[0], q.shape[1], q.shape[2]
        anchor = anchors.repeat_interleave(g)[:, None]  # [m g, 1] each row's t
        stream = torch.arange(g, device=dev).repeat(m)[:, None]  # [m g, 1] j - 1
        keys = torch.arange(main_k.shape[0], device=dev)[None, :]  # [1, T]
        sees_main = keys <= anchor
        if window:
            sees_main &= keys > anchor + stream + 1 - window  # query position t + j
        row_anchor = torch.arange(m, device=dev).repeat_interleave(g)
        sees_streams = (row_anchor[:, None] == row_anchor[None, :]) & (stream.T <= stream)  # [m g, m g]
        mask = torch.cat([sees_main, sees_streams], dim=1)  # [m g, T + m g]
        keys_all = torch.cat([main_k, k]).transpose(0, 1).unsqueeze(0)  # [1, kv_heads, T + m g, hd]
        values_all = torch.cat([main_v, v]).transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys_all.to(q.dtype),
                                             values_all.to(q.dtype), attn_mask=mask,
                                             enable_gqa=keys_all.shape[1] != heads, scale=self.scale)
        return out[0].transpose(0, 1).reshape(m * g, heads, hd)


def run_streams(model: CausalLM, adapter: StreamAdapter, start: torch.Tensor, segments: list[StreamSegment]
                ) -> torch.Tensor:
    """The stream rows of `segments` from the residual stream entering layer `first_layer` at their
    anchors (`start` [sum m, hidden], segment after segment): final-normed hidden states
    [sum m x num_streams, hidden]: stream j of the i-th anchor (counting across segments) at row
    i * num_streams + j - 1."""
    g = adapter.num_streams
    anchors = torch.cat([s.anchors for s in segments])
    h = adapter.stream_inputs(model, start, torch.cat([s.next_tokens for s in segments])).to(start.dtype)  # [m g, hidden]
    positions = (anchors[:, None] + torch.arange(1, g + 1, device=anchors.device)).reshape(-1)
    ropes = model.step_ropes(positions.clamp(max=model.max_positions - 1))
    attn = StreamAttention(segments, g, model.config.attn_scale)
    residual = None
    with adapter.active(model):
        for i in range(adapter.first_layer, model.config.num_hidden_layers):
            h, residual = model.layers[i](h, residual, ropes, attn)
    return model.final_norm(h, residual)


@dataclass
class CaptureKV:
    """Wraps attention metadata and keeps the keys and values it is given for layers >= `first`
    (after rotary: what a KV cache holds). Training reads the main stream's KV from it."""

    inner: object
    first: int
    kv: dict[int, KV]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0) -> torch.Tensor:
        if layer >= self.first:
            self.kv[layer] = (k.detach(), v.detach())
        return self.inner.attend(layer, q, k, v, window)  # type: ignore[attr-defined]


# ---- files -------------------------------------------------------------------------------------

def save_streams(path: str | Path, adapter: StreamAdapter, base_model: str, cfg: ModelConfig,
                 extra: dict[str, str] | None = None, vocab: torch.Tensor | None = None) -> None:
    tensors = {"streams": adapter.streams.detach().float().contiguous(),
               "token_a": adapter.token_a.detach().float().contiguous(),
               "token_b": adapter.token_b.detach().float().contiguous()}
    for key in adapter.lora_a:
        tensors[f"lora_a.{key}"] = adapter.lora_a[key].detach().float().contiguous()
        tensors[f"lora_b.{key}"] = adapter.lora_b[key].detach().float().contiguous()
    if vocab is not None:
        tensors["vocab"] = vocab.to(torch.int64).contiguous()
    meta = {"kind": KIND, "num_streams": str(adapter.num_streams), "first_layer": str(adapter.first_layer),
            "rank": str(adapter.rank), "token_rank": str(adapter.token_a.shape[0]), "base_model": base_model, "hidden_size": str(cfg.hidden_size),
            "num_layers": str(cfg.num_hidden_layers), **(extra or {})}
    write_safetensors(path, tensors, meta)


def load_streams(path: str | Path, model: CausalLM) -> tuple[StreamAdapter, dict[str, str], DraftVocab | None]:
    """The adapter in `path` for `model`, its metadata and draft vocabulary; UserError for a file
    of another kind or another model's shape."""
    path = Path(path)
    meta, tensors = read_heads_file(path, KIND)
    cfg = model.config
    retrain = "train streams for this model: `brisk train-heads --kind streaming --model <model>`"
    if meta.get("hidden_size") != str(cfg.hidden_size) or meta.get("num_layers") != str(cfg.num_hidden_layers):
        raise UserError(f"{str(path)!r} was trained for a model of hidden size {meta.get('hidden_size')} and "
                        f"{meta.get('num_layers')} layers; this one has {cfg.hidden_size} and "
                        f"{cfg.num_hidden_layers}: {retrain}")
    missing = [k for k in ("num_streams", "first_layer", "rank", "token_rank") if not meta.get(k, "").isdigit()]
    if missing:
        raise UserError(f"{str(path)!r} lacks {', '.join(missing)} in its metadata (written by an older brisk?): {retrain}")
    adapter = StreamAdapter(cfg, int(meta["num_streams"]), cfg.num_hidden_layers - int(meta["first_layer"]),
                            int(meta["rank"]), token_rank=int(meta["token_rank"]))
    expected = {"streams": adapter.streams, "token_a": adapter.token_a, "token_b": adapter.token_b, **{f"lora_a.{k}": p for k, p in adapter.lora_a.items()},
                **{f"lora_b.{k}": p for k, p in adapter.lora_b.items()}}
    with torch.no_grad():
        for name, param in expected.items():
            got = tensors.get(name)
            if got is None or got.shape != param.shape:
                raise UserError(f"{str(path)!r}: {name} is {None if got is None else tuple(got.shape)}, this model "
                                f"needs {tuple(param.shape)} (trained for another model?): {retrain}")
            param.copy_(got)
    adapter = adapter.to(device=model.device, dtype=model.dtype).eval().requires_grad_(False)
    return adapter, meta, stored_draft_vocab(path, tensors.get("vocab"), model)


# ---- decoding ----------------------------------------------------------------------------------

class PassModel:
    """What the stream pass runs over when its weights are quantized (`quantization` "int8" or
    "int4"): the target with layers `first`.. replaced by copies whose Linears hold int8 weights
    (per output channel) or 4-bit ones (groups of 32, round to nearest, multiplied by int8
    activations: llama.cpp's Q4 x Q8), the layers below shared. Drafts only: the verify step runs
    the target's own layers, so the output stays the target's. The C++ decode plan and the module
    path take it as a model (`layers`, `config`, `step_ropes`, `run_layers`, `modules_version`): the
    copies follow the weights as they were when the proposer was built."""

    def __init__(self, model: CausalLM, first: int, quantization: str = "int8") -> None:
        from brisk.quant import quantizable

        self.model = model
        self.config = model.config
        self.step_ropes = model.step_ropes
        layers = list(model.layers)
        for i in range(first, len(layers)):
            layer = _clone(layers[i])
            for parent, name, child in quantizable(layer):
                setattr(parent, name, _pass_linear(child.weight, child.bias, child.output_sizes, model.dtype,
                                                   quantization))
            for parent, name, child in _quantized_children(layer):
                # an already quantized target (int4, GGUF blocks): its effective weight requantized;
                # activations stay the model's dtype
                setattr(parent, name, _pass_linear(_effective_weight(child), child.bias, child.output_sizes,
                                                   getattr(child, "dtype", model.dtype), quantization))
            layers[i] = layer
        self.layers = nn.ModuleList(layers)

    @property
    def modules_version(self) -> int:
        return self.model.modules_version

    def run_layers(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, attn: Any,
                   start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        ropes = self.step_ropes(positions)
        for i in range(start, end):
            h, residual = self.layers[i](h, residual, ropes, attn)
        return h, residual


def _clone(module: nn.Module) -> nn.Module:
    """A copy of `module`'s tree whose children can be replaced without touching the original; the
    tensors stay shared (oneDNN-packed weights cannot be deep-copied, and only the Linears change)."""
    out = copy.copy(module)
    for attr, value in vars(module).items():  # every container (parameters, buffers, hooks, sets): its own
        if isinstance(value, (dict, set, list)):
            setattr(out, attr, type(value)(value))
    out._modules = {name: None if child is None else _clone(child) for name, child in module._modules.items()}
    return out


def _pass_linear(weight: torch.Tensor, bias: torch.Tensor | None, output_sizes: tuple[int, ...], dtype: torch.dtype,
                 quantization: str) -> nn.Module:
    """A stream pass's copy of one Linear: int8 per output channel, or 4-bit groups of 32 whose
    activations are int8 (a draft's numbers need not be the target's; a Linear whose inputs are
    not whole groups stays int8)."""
    from brisk.quant.grouped import GroupLinear
    from brisk.quant.int8 import Int8Linear

    if quantization == "int4" and weight.shape[1] % 32 == 0:
        copied = GroupLinear.from_weight(weight.float(), bias, 32, 4, output_sizes, dtype)
        copied.activations = "int8"
        return copied
    copied = Int8Linear.from_weight(weight, bias, output_sizes)
    copied.dtype = dtype
    return copied


def _quantized_children(layer: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) for the layer's quantized Linears other than int8 ones."""
    from brisk.quant.base import QuantizedLinear
    from brisk.quant.int8 import Int8Linear

    return [(parent, name, child) for parent in layer.modules() for name, child in parent.named_children()
            if isinstance(child, QuantizedLinear) and not isinstance(child, Int8Linear)
            and callable(getattr(child, "dequantize", None))]


def _effective_weight(module: nn.Module) -> torch.Tensor:
    """What a quantized Linear multiplies x by: its dequantized weight, with the input scale of
    AWQ / SmoothQuant checkpoints (y = W (x * s)) folded into the columns."""
    weight = module.dequantize().float()  # type: ignore[operator]
    scale = getattr(module, "input_scale", None)
    return weight if scale is None else weight * scale.float()


def int8_draft_vocab(model: CausalLM, vocab: DraftVocab | None) -> DraftVocab:
    """The draft vocabulary's head rows (every token when `vocab` is None) as an int8 Linear."""
    from brisk.quant.int8 import Int8Linear

    ids = vocab.token_ids if vocab is not None else torch.arange(model.config.vocab_size, device=model.device)
    return DraftVocab(ids, model, Int8Linear.from_weight(model.head_rows(ids).to(model.dtype), None))


class StreamingProposer(Proposer):
    """Drafts from the stream rows at the position that produced each request's newest token.

    The stream pass runs over the target's own paged cache: stream j of the row at t sits at
    position t + j, a slot the next verify step writes anyway (it holds t_last and the drafts), so
    the stream rows write their keys and values there first and then attend as any step's rows
    do, causally over the cache: keys <= t and the streams j' <= j, the mask training used. The
    verify step overwrites those slots before anything reads them. So the pass is an ordinary
    multi-row step over the top layers, run by the C++ decode plan with the adapters added to
    its Linears (the module path with forward hooks where no plan applies)."""

    name = KIND
    observes_hidden = True  # the residual stream at capture_layer of each request's newest row (observe)

    def __init__(self, model: CausalLM, adapter: StreamAdapter, runner: Any, vocab: DraftVocab | None = None,
                 quantization: str | None = None) -> None:
        """`quantization` "int8" / "int4": the pass on quantized copies of its layers' weights
        (`PassModel`), the draft head on an int8 copy of its rows; None: on the target's own."""
        self.model = model
        self.adapter = adapter
        self.runner = runner  # the target's runtime.paged_runner.PagedModelRunner: its cache, its steps
        passes: Any = model
        if quantization is not None and quantization not in STREAM_PASS_QUANTIZATIONS:
            raise UserError(f'the stream pass takes quantization {" or ".join(STREAM_PASS_QUANTIZATIONS)} or none, '
                            f'got {quantization!r}')
        if quantization is not None and model.device.type != "cpu":
            raise UserError(f'the {quantization} stream pass runs on the CPU\'s integer kernels; on '
                            f'{model.device.type} leave "quantization" out of the streaming config')
        if quantization is not None:
            passes = PassModel(model, adapter.first_layer, quantization)
            vocab = int8_draft_vocab(model, vocab)
        self.plans = runner.adapted_plans(adapter.plan_adapters(), lambda: adapter.active(passes), passes)
        self.vocab = vocab
        self.capture_layer = adapter.first_layer  # the runner keeps the residual stream entering it
        layers = model.config.num_hidden_layers
        self.draft_cost = (layers - adapter.first_layer) / layers / adapter.num_streams  # refined from timings
        self._start: dict[str, tuple[int, torch.Tensor]] = {}  # request -> (position t, residual stream at t)

    @property
    def max_drafts(self) -> int:
        return self.adapter.num_streams

    def observe(self, request_id: str, hidden: torch.Tensor, position: int) -> None:
        """`hidden`: the residual stream entering `capture_layer` at `position`, the row that produced
        the request's newest token (whose KV is in the cache)."""
        self._start[request_id] = (position, hidden)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        out = [Draft([]) for _ in requests]
        # a start from the row before t_last; anything else (a preempted, restarted request) waits
        have = [i for i, r in enumerate(requests)
                if r.request_id in self._start and self._start[r.request_id][0] == r.last_pos - 1]
        if not have:
            return out
        counts = [min(self.adapter.num_streams, requests[i].num_drafts) for i in have]  # stream j reads only j' <= j
        hidden = self.stream_hidden([requests[i] for i in have], counts)  # [sum counts, hidden]
        logits = self.vocab.logits(hidden) if self.vocab is not None else self.model.compute_logits(hidden)
        first = 0
        for i, n in zip(have, counts):
            picks = [pick_draft_token(logits[first + j], requests[i]) for j in range(n)]
            first += n
            qs = [q for _, q in picks if q is not None]
            out[i] = Draft([t for t, _ in picks], torch.stack(qs) if qs else None)
        return out

    def stream_hidden(self, requests: list[DraftRequest], counts: list[int]) -> torch.Tensor:
        """The first `counts[i]` stream rows of each request (each has an observed start at
        last_pos - 1 and at least that many draft slots): final-normed hidden states, request
        after request [sum counts, hidden]."""
        g, dev = self.adapter.num_streams, self.model.device
        start = torch.stack([self._start[r.request_id][1] for r in requests])  # [B, hidden]
        newest = torch.tensor([r.token_ids[-1] for r in requests], device=dev)  # x[t+1]
        h = self.adapter.stream_inputs(self.model, start, newest).to(start.dtype)  # [B g, hidden]
        if sum(counts) < h.shape[0]:
            h = h[torch.tensor([i * g + j for i, n in enumerate(counts) for j in range(n)], device=dev)]
        steps = [ScheduledRequest(r.request_id, [0] * n, r.last_pos, r.block_ids, sample=False)
                 for r, n in zip(requests, counts)]
        return self.runner.run_rows(steps, h, self.adapter.first_layer, self.plans)

    def release(self, request_id: str) -> None:
        self._start.pop(request_id, None)


@register(KIND)
def build(ctx: ProposerContext) -> StreamingProposer:
    assert ctx.config.heads is not None  # SpecConfig requires them
    adapter, _, vocab = load_streams(ctx.config.heads, ctx.target)
    ctx.runner.capture_layer = adapter.first_layer
    return StreamingProposer(ctx.target, adapter, ctx.runner, vocab, ctx.config.quantization)
