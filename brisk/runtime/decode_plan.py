"""Decode steps of a Llama or Gemma 3 layer stack in C++ (brisk/kernels/cpu_decode_plan.cpp).

A decode step on the CPU made ~270 nn.Module calls and ~4,300 Python function calls a token; on int4
Python and dispatch were about a third of the step. `build_decode_plan` hands each layer's tensors
to a C++ `DecodePlan` that runs the kernels the modules would call on the same rows, so the numbers
are identical (tested) and only the interpreter is gone; it runs a whole step in one OpenMP
parallel region (the threads split each Linear's rows and meet at spin barriers), so the thread
pool is not forked and joined around every kernel either. It is
the CPU counterpart of capturing a CUDA graph, and like one it belongs to the runtime, not the
model: each runner holds a `DecodePlans`, which builds the plan on the first step it can serve
(putting the quantized weights in their kernel layouts first, as their first kernel call would) and
builds it again whenever the model's `modules_version` has moved (`DecoderLM.modules_changed`:
`.to()`, `load_weights`, `load_state_dict`, `quant.apply`, `quant.set_activations`). Code that
edits modules in place otherwise (assigning `GroupLinear.activations`, forward hooks, which the
plan never calls) must call `modules_changed` itself, or the runner runs eagerly
(`LLM(enforce_eager=True)`). The model's own `run_layers` knows nothing of the plan: a runner's
`DecodePlans.run_layers` tries the plan first and falls back to it.

A plan exists only when every piece has its C++ kernel: float32 activations on the CPU (AVX-512, AVX2 or portable kernels),
float / int4 / gguf (group and block) / int8 / 2:4 sparse Linears (W8A8, ternary and tensor-parallel Linears keep the module
path), the paged KV cache; it runs steps served by the paged kernel (decode batches, speculative
verify steps), never long prefill chunks, of at most `PLAN_MAX_ROWS` tokens, or up to
`PLAN_ROWS_CAP` where every Linear's module keeps calling its op's kernel that far (`plan_rows`:
a full batch of block-quantized or group-quantized rows).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from brisk import kernels
from brisk.kernels.plan_ops import LinearOp
from brisk.model.base import CausalLM
from brisk.model.layers import RMSNorm
from brisk.model.paged_attention import HAVE_PAGED_KERNEL, PagedAttention

# float Linears take gemv (one row) or small_gemm (up to 8, model/layers.py linear) below this
PLAN_MAX_ROWS = 8
# a Linear module's `plan_rows`: the most rows for which its forward calls the kernel of its
# `plan_op` (the quantized kernels serve 64-128 rows before a float GEMM takes over); the plan
# takes steps of up to the least of them, at most this many (32 requests decoding)
PLAN_ROWS_CAP = 32
# low-rank adapters on a plan's Linears: (layer, linear) -> (a [rank, in], b [out, rank]) float32
Adapters = dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]


def plan_supported() -> bool:
    """The extension has the plan and the kernels it calls (each has an AVX-512, AVX2 and portable path)."""
    return (kernels.CAPS.built and all(kernels.CAPS.has(k) for k in ("DecodePlan", "rotary", "kv_store"))
            and HAVE_PAGED_KERNEL and kernels.SMALL_GEMM_MAX_ROWS >= PLAN_MAX_ROWS)


def linear_op(m: torch.nn.Module) -> LinearOp | None:
    """The kernel call `m.forward` makes for up to PLAN_MAX_ROWS float32 rows on the CPU, as the module
    describes it (`plan_op`, kernels/plan_ops.py); None when it makes no single C++ call."""
    plan_op = getattr(m, "plan_op", None)
    return plan_op() if callable(plan_op) else None


def plan_rows(model: torch.nn.Module) -> int:
    """The most tokens a step of the plan over `model` may have: PLAN_MAX_ROWS, or more where every
    layer's Linears say their kernel serves more (`plan_rows`), up to PLAN_ROWS_CAP. For a model
    whose layers `_layer_args` took."""
    return min([PLAN_ROWS_CAP, *(getattr(m, "plan_rows", PLAN_MAX_ROWS) for layer in model.layers
                                 for m in _linears(layer))])


def plan_refusal(model: torch.nn.Module) -> str | None:
    """Why no plan can ever serve this architecture (None: it can, given the kernels)."""
    known = _layer_kinds()
    kinds = {type(layer).__name__ for layer in model.layers if type(layer) not in known}
    kinds.discard("Dropped")  # another pipeline stage's layers
    if kinds:
        return f"{', '.join(sorted(kinds))} has no C++ decode plan yet"
    return None


def _layer_kinds() -> dict[type, tuple[str, str, str | None, str | None]]:
    """Layer class -> its norms by role: (before attention, before the MLP, on the attention
    output, on the MLP output); None where the layer has none."""
    from brisk.model.gemma3 import Gemma3DecoderLayer
    from brisk.model.llama import LlamaDecoderLayer

    return {LlamaDecoderLayer: ("input_layernorm", "post_attention_layernorm", None, None),
            Gemma3DecoderLayer: ("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm",
                                 "post_feedforward_layernorm")}


def build_decode_plan(model: torch.nn.Module) -> Any | None:
    """A `brisk._C.DecodePlan` over all of `model.layers`, or None when any piece lacks a kernel."""
    if not plan_supported():
        return None
    refusal = plan_refusal(model)
    if refusal is not None:
        logging.getLogger("brisk").warning("decode steps run module by module (slower): %s", refusal)
        return None
    cfg = model.config
    roles = _layer_kinds()
    layer_args = [_layer_args(layer, roles.get(type(layer)), cfg, i) for i, layer in enumerate(model.layers)]
    if any(args is None for args in layer_args):
        return None
    plan = kernels.new_decode_plan(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                   cfg.intermediate_size, float(cfg.rms_norm_eps), 0 if cfg.hidden_act == "silu" else 1,
                                   plan_rows(model))
    for i, args in enumerate(layer_args):
        plan.add_layer(*args, heads=cfg.heads(i), kv_heads=cfg.kv_heads(i), intermediate=cfg.intermediate(i))
    return plan


def _linears(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """A planned layer's Linears in the plan's order: qkv, o, gate_up, down."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _layer_args(layer: torch.nn.Module, roles: tuple[str, str, str | None, str | None] | None,
                cfg: Any, i: int) -> tuple | None:
    """DecodePlan.add_layer's arguments for layer `i` (its norms by `roles`); None when a piece has
    no kernel here."""
    from brisk.model.llama import LlamaAttention, LlamaMLP

    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if roles is None or type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP:
        return None
    if (attn.num_heads, attn.num_kv_heads) != (cfg.heads(i), cfg.kv_heads(i)):
        return None
    norms = [None if r is None else getattr(layer, r) for r in roles]
    qk = [attn.q_norm, attn.k_norm] if hasattr(attn, "q_norm") else [None, None]
    if not all(n is None or _plain_norm(n, cfg) for n in (*norms, *qk)):
        return None
    linears = _linears(layer)
    # the widths the C++ loop slices by: q | k | v and gate | up as the config says
    widths = ((cfg.heads(i) + 2 * cfg.kv_heads(i)) * cfg.head_dim, cfg.hidden_size, 2 * cfg.intermediate(i),
              cfg.hidden_size)
    if any(getattr(m, "out_features", None) != w for m, w in zip(linears, widths)):
        return None
    ops = [linear_op(m) for m in linears]
    if any(op is None for op in ops):
        return None
    w = [None if n is None else n.weight for n in (*qk, norms[2], norms[3])]
    return (norms[0].weight, norms[1].weight, ops, *w, attn.window, layer.rope_index)


def _plain_norm(norm: torch.nn.Module, cfg: Any) -> bool:
    return (type(norm) is RMSNorm and norm.eps == cfg.rms_norm_eps and norm.weight.dtype == torch.float32
            and norm.weight.is_cpu)


def plan_applies(h: torch.Tensor, meta: object) -> bool:
    """This step can run on a plan: few float32 CPU rows (up to PLAN_ROWS_CAP; the plan's own
    `max_rows` is checked once it exists), all of them the paged kernel's."""
    return (isinstance(meta, PagedAttention) and h.shape[0] <= PLAN_ROWS_CAP and h.dtype == torch.float32
            and h.device.type == "cpu" and meta.num_kernel_tokens == h.shape[0] and meta.padded is None
            and not meta.gather_spans)


def run_plan(plan: Any, h: torch.Tensor, residual: torch.Tensor | None, ropes: list[tuple[torch.Tensor, torch.Tensor]],
             meta: PagedAttention, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Layers start..end-1 through the plan; None when their caches are not all plain CPU float32
    tensors here (the module path then runs)."""
    caches: list[torch.Tensor] = []
    for kv in meta.kv_caches[start:end]:
        if kv is None:
            return None
        caches.extend(kv)
    first = caches[0] if caches else None
    if first is None or first.dtype != torch.float32 or not kernels.kv_store_supported(first):
        return None
    n = h.shape[0]
    residual = None if residual is None else residual.contiguous()
    cos = [c.reshape(n, -1).contiguous() for c, _ in ropes]
    sin = [s.reshape(n, -1).contiguous() for _, s in ropes]
    return plan.run(h.contiguous(), residual, cos, sin, caches,
                    meta.slot_blocks, meta.slot_offsets, meta.block_tables, meta.query_start, meta.kv_lens,
                    meta.scale, start, end, meta.layer_group or [])


class DecodePlans:
    """A runner's C++ decode plan over `model`: built on the first step it can serve, built again
    after the model's modules change (`modules_version`), never while `enabled` is False
    (`enforce_eager`)."""

    def __init__(self, model: CausalLM, enabled: bool = True, adapters: Adapters | None = None,
                 module_context: Callable[[], AbstractContextManager[None]] | None = None) -> None:
        """`adapters`: low-rank adapters the plan adds to some Linears, {(layer, linear): (a, b)}
        (linear 0 qkv, 1 o, 2 gate_up, 3 down; y += (x a^T) b^T); `module_context`: entered around
        the module path, which must then add the same (forward hooks)."""
        self.model = model
        self.enabled = enabled
        self.adapters = adapters or {}
        self.module_context = module_context or contextlib.nullcontext
        self._plan: Any = None  # the plan, or False where none applies to these modules
        self._version: int | None = None  # modules_version the plan was built for

    @property
    def current(self) -> Any | None:
        """The plan built for the model's modules as they are now; None when none was built since
        they last changed, or none applies (`refused`)."""
        return (self._plan or None) if self._version == self.model.modules_version else None

    @property
    def refused(self) -> bool:
        """True: a plan was asked for these modules and some piece has no kernel."""
        return self._plan is False and self._version == self.model.modules_version

    def run_layers(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, attn: object,
                   start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`model.run_layers`, through the plan when it serves this step."""
        plan = self._for_step(h, attn)
        if plan is not None:
            out = run_plan(plan, h, residual, self.model.step_ropes(positions), attn, start, end)  # type: ignore[arg-type]
            if out is not None:
                return out
        with self.module_context():
            return self.model.run_layers(h, residual, positions, attn, start, end)  # type: ignore[arg-type]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: object,
                num_layers: int | None = None) -> torch.Tensor:
        """`model.forward` (embed, layers, final norm), its layers through `run_layers`."""
        model = self.model
        end = model.config.num_hidden_layers if num_layers is None else num_layers
        return model.final_norm(*self.run_layers(model.embed(input_ids), None, positions, attn, 0, end))

    def _for_step(self, h: torch.Tensor, attn: object) -> Any | None:
        if self._plan and self._version != self.model.modules_version:
            self._plan = self._version = None  # stale: let go of the old weights it holds at once
        if not self.enabled or not plan_applies(h, attn):
            return None
        if self._version != self.model.modules_version:
            self._plan = build_decode_plan(self.model) or False
            if self._plan:
                for (layer, linear), (a, b) in self.adapters.items():
                    self._plan.set_lora(layer, linear, a.contiguous(), b.contiguous())
            self._version = self.model.modules_version  # read after: building may tile weights
        plan = self._plan or None
        return plan if plan is not None and h.shape[0] <= plan.max_rows() else None
