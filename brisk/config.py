"""One frozen config tree (ARCHITECTURE.md, habit 1).

Every component receives its own sub-config. Values discovered at run time (number of KV blocks,
EOS ids) are constructor arguments elsewhere, never written back here. Validation raises
ValueError with a message a user can act on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from brisk.errors import UserError

DTYPES = ("float32", "bfloat16", "float16")

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
HIDDEN_ACTS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full", "sliding")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling as HF configs spell it (`rope_scaling` / `rope_parameters`)."""

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # yarn, longrope: cos/sin scale; None: the paper's formula
    # longrope (Phi-3 "su"): per-frequency divisors within / beyond the original window
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # Per-frequency divisors applied after any type (a GGUF file's `rope_freqs.weight`: Llama 3.1's
    # scaling as llama.cpp's converter precomputes it); () for none.
    freq_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor", "freq_factors"):
            object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))
        if self.rope_type not in ROPE_TYPES:
            raise UserError(
                f"unsupported rope scaling type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )
        if self.factor <= 0:
            raise UserError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "longrope" and not (self.short_factor and self.long_factor
                                                 and self.original_max_position_embeddings):
            raise UserError("longrope scaling needs short_factor, long_factor and original_max_position_embeddings")

    def check_dim(self, rotary_dim: int) -> None:
        """Per-frequency lists must give one value per rotated pair of dims."""
        for name in ("short_factor", "long_factor", "freq_factors"):
            got = len(getattr(self, name))
            if got and got != rotary_dim // 2:
                raise UserError(f"rope scaling {name} has {got} values; {rotary_dim} rotated dims need "
                                 f"{rotary_dim // 2}")

    @staticmethod
    def from_hf(d: dict[str, Any] | None) -> RopeScaling:
        """Build from an HF `rope_scaling` / `rope_parameters` dict (None means no scaling)."""
        if not d:
            return RopeScaling()
        kind = d.get("rope_type", d.get("type", "default"))
        kind = "longrope" if kind == "su" else kind  # Phi-3's first configs named it "su"
        known = {f for f in RopeScaling.__dataclass_fields__ if f not in ("rope_type", "freq_factors")}
        kwargs = {k: v for k, v in d.items() if k in known and v is not None}
        return RopeScaling(rope_type=kind, **kwargs)

    def to_hf(self) -> dict[str, Any] | None:
        if self.freq_factors:
            raise UserError("this model's rotary frequencies come as a GGUF file's precomputed factors "
                             "(rope_freqs.weight), which an HF config cannot express; run the GGUF file itself")
        if self.rope_type == "default":
            return None
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.original_max_position_embeddings is not None:
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.rope_type == "llama3":
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor)
        if self.rope_type == "yarn":
            out.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow)
        if self.rope_type == "longrope":
            out.update(short_factor=list(self.short_factor), long_factor=list(self.long_factor))
        if self.attention_factor is not None and self.rope_type in ("yarn", "longrope"):
            out["attention_factor"] = self.attention_factor
        return out


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer, in HF's terms. What differs between families beyond
    these numbers (norm placement, embedding scale) lives in the architecture's file (model/)."""

    architecture: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 0  # 0 means hidden_size // num_attention_heads
    rotary_dim: int = 0  # dims of each head that rotate (Phi-4-mini: 3/4 of them); 0 means head_dim
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    attention_bias: bool = False  # Qwen2 has a bias on q, k, v
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    # per layer: "full" or "sliding" (attends to the last `sliding_window` positions); () = all full
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    qk_norm: bool = False  # RMSNorm over each query / key head before rotary (Qwen3, Gemma 3)
    query_pre_attn_scalar: float = 0.0  # attention scale is its -1/2 power; 0: head_dim
    rope_local_theta: float = 0.0  # rotary base of the sliding layers (Gemma 3: 10k); 0: rope_theta
    final_logit_softcapping: float = 0.0  # logits = cap * tanh(logits / cap); 0: none
    # Non-uniform layers (a structurally pruned model, compress/prune.py): per layer the query heads,
    # KV heads and MLP width; () = every layer has num_attention_heads / num_key_value_heads /
    # intermediate_size. Each layer keeps the model's query heads per KV head (whole GQA groups).
    layer_heads: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    layer_intermediate: tuple[int, ...] = ()
    output_bias: bool = False  # o_proj and down_proj carry a bias (FLAP's compensation of pruned channels)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // max(1, self.num_attention_heads))
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise UserError(f"model config: {name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(
                f"model config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise UserError(f"model config: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise UserError(f"model config: hidden_act {self.hidden_act!r} is not supported; supported: "
                             f"{', '.join(HIDDEN_ACTS)}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types and (len(self.layer_types) != self.num_hidden_layers
                                 or not set(self.layer_types) <= set(LAYER_TYPES)):
            raise UserError(f"model config: layer_types must name {self.num_hidden_layers} layers, each one of "
                             f"{', '.join(LAYER_TYPES)}; got {list(self.layer_types)}")
        if "sliding" in self.layer_types and self.sliding_window <= 0:
            raise UserError("model config: sliding layers need sliding_window > 0")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise UserError(f"model config: rotary_dim must be even and in 2..head_dim ({self.head_dim}), "
                             f"got {self.rotary_dim}")
        self.rope_scaling.check_dim(self.rotary_dim)
        self._check_layer_widths()

    def _check_layer_widths(self) -> None:
        group = self.num_attention_heads // self.num_key_value_heads
        for name in ("layer_heads", "layer_kv_heads", "layer_intermediate"):
            values = tuple(int(v) for v in getattr(self, name))
            object.__setattr__(self, name, values)
            if values and (len(values) != self.num_hidden_layers or min(values) < 1):
                raise UserError(f"model config: {name} must give {self.num_hidden_layers} values >= 1, got {list(values)}")
        if bool(self.layer_heads) != bool(self.layer_kv_heads):
            raise UserError("model config: layer_heads and layer_kv_heads come together")
        for i, (q, kv) in enumerate(zip(self.layer_heads, self.layer_kv_heads)):
            if q != kv * group:
                raise UserError(f"model config: layer {i} has {q} query heads for {kv} KV heads; every layer keeps "
                                 f"{group} query heads per KV head")

    @property
    def uniform(self) -> bool:
        """Every layer has the same head counts and MLP width."""
        return not (self.layer_heads or self.layer_intermediate)

    def heads(self, layer: int) -> int:
        """Query heads of layer `layer`."""
        return self.layer_heads[layer] if self.layer_heads else self.num_attention_heads

    def kv_heads(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_key_value_heads

    def intermediate(self, layer: int) -> int:
        """MLP width of layer `layer`."""
        return self.layer_intermediate[layer] if self.layer_intermediate else self.intermediate_size

    def layer_params(self, layer: int) -> int:
        """Linear weights of one layer (q, k, v, o and the gated MLP)."""
        hd, hidden = self.head_dim, self.hidden_size
        return hidden * hd * (2 * self.heads(layer) + 2 * self.kv_heads(layer)) + 3 * hidden * self.intermediate(layer)

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else "full"

    def window(self, layer: int) -> int:
        """How many of the latest positions layer `layer` attends to; 0: all of them."""
        return self.sliding_window if self.layer_type(layer) == "sliding" else 0

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


KV_LAYOUTS = ("paged", "virtual")
STREAM_PASS_QUANTIZATIONS = ("int8", "int4")  # Speculative Streaming's pass copies (speculative/streaming.py)


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache. `kv_layout` "paged": a pool of fixed-size blocks, allocated whole at
    start-up; "virtual": one contiguous row of reserved address space per sequence, backed by
    physical memory only as tokens arrive (vAttention; core/virtual_kv.py): the CPU on Linux, CUDA through
    its virtual memory management (cuda-python). The
    number of blocks (virtual: committed tiles of `block_size` tokens) is found at start-up from
    `num_kv_blocks` or `kv_cache_memory_gib` and handed to the cache manager as an argument."""

    block_size: int = 16
    num_kv_blocks: int | None = None  # None: size from kv_cache_memory_gib
    kv_cache_memory_gib: float = 2.0
    enable_prefix_caching: bool = True
    kv_layout: str = "paged"
    kv_huge_pages: bool = False  # virtual: back the rows with 2 MB transparent huge pages

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise UserError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_layout not in KV_LAYOUTS:
            raise UserError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")
        if self.kv_huge_pages and self.kv_layout != "virtual":
            raise UserError("kv_huge_pages applies to kv_layout='virtual' only")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise UserError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")

    def check_multi_process(self) -> None:
        """Tensor/pipeline parallel workers hold paged KV only."""
        if self.kv_layout != "paged":
            raise UserError("kv_layout='virtual' runs in a single process for now; use kv_layout='paged' "
                             "with tensor/pipeline parallelism")
        if self.kv_cache_memory_gib <= 0:
            raise UserError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step budget. `max_model_len` is the longest sequence (prompt + output) served."""

    max_num_batched_tokens: int = 512  # LLM(...) and the CLI take their defaults from here
    max_num_seqs: int = 64
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # Set (> 1): a step carrying running decodes gets only as many prompt tokens as keep it within
    # this factor of a decode-only step, learned from measured step times (core/step_cost.py).
    # Bounds inter-token latency under incoming prompts without hand-tuning the token budget.
    max_decode_slowdown: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_decode_slowdown is not None and not self.max_decode_slowdown > 1.0:
            raise UserError(f"max_decode_slowdown must be > 1 (e.g. 1.5), got {self.max_decode_slowdown}")
        if self.max_decode_slowdown is not None and not self.enable_chunked_prefill:
            raise UserError("max_decode_slowdown needs chunked prefill: prompts are cut into chunks to meet it")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise UserError(
                f"without chunked prefill a whole prompt must fit one step: max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )


QUANT_METHODS = ("int8", "int4", "w8a8", "ternary", "gguf", "sparse24", "sparse24_int8")  # one QuantMethod each in quant/methods.py (checked there)
QUANT_OPTIONS = ("group_size", "calibration", "calibration_tokens", "activations")
CALIBRATED_METHODS = ("int4", "w8a8", "sparse24", "sparse24_int8")
DEFAULT_GROUP = 64  # int4's columns per scale and offset unless the source file's own grid is kept
ACTIVATION_MODES = ("float", "int16", "int8")  # what int4 / gguf weights multiply (GroupLinear.activations)


@dataclass(frozen=True)
class QuantConfig:
    """How to quantize at load (`LLM(quantization=..., quantization_config={...})`, `-q`,
    `--quant-config '<json>'`). `group_size` applies to int4 (columns per scale and offset; None:
    the loader's choice, `group`: 32 for a GGUF whose layers are Q4_0 / Q4_1 blocks, whose grid int4
    g32 holds exactly, else 64);
    `calibration` drives GPTQ rounding (int4), SmoothQuant's outlier migration (w8a8) and SparseGPT
    (sparse24): a text file's path (its first `calibration_tokens` tokens), "self" (the default for
    those methods: `calibration_tokens` of the model's own answers to built-in prompts,
    loader/calibration.py) or "none" (round-to-nearest, no migration, magnitude 2:4). `activations` (int4, gguf):
    what the group-quantized weights multiply: "int16" rounds the activations to int16 per 32-column block
    (~1e-5 of the block's largest value; the same perplexity as float32 to 4 digits, measured in
    BENCHMARKS.md) and multiplies in integer dot products, "int8" does the same at 8 bits as
    llama.cpp does (as fast, a measured quality cost), "float" multiplies float32 activations (~15%
    slower decode); None: a saved checkpoint's choice, else "int16" (`act_mode`)."""

    method: str
    group_size: int | None = None
    calibration: str | None = None
    calibration_tokens: int = 4096
    activations: str | None = None

    def __post_init__(self) -> None:
        if self.method not in QUANT_METHODS:
            raise UserError(f"unknown quantization method {self.method!r}; available: {', '.join(QUANT_METHODS)}")
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size <= 0
                                            or self.group_size % 32):
            raise UserError(f"quantization group_size must be a positive multiple of 32 (32, 64, 128), "
                             f"got {self.group_size!r}")
        if not isinstance(self.calibration_tokens, int) or self.calibration_tokens < 16:
            raise UserError(f"calibration_tokens must be an integer >= 16, got {self.calibration_tokens!r}")
        if self.calibration is not None and not isinstance(self.calibration, str):
            raise UserError(f"calibration must be the path of a text file, got {self.calibration!r}")
        if self.activations is not None and self.activations not in ACTIVATION_MODES:
            raise UserError(f"activations must be one of {', '.join(ACTIVATION_MODES)}, got {self.activations!r}")
        if self.act_mode != "float" and self.method not in ("int4", "gguf"):
            raise UserError(f"activations {self.activations!r} applies to int4 and gguf weights, not {self.method}")
        if self.calibration is not None and self.method not in CALIBRATED_METHODS:
            raise UserError(f"calibration applies to int4 (GPTQ), w8a8 (SmoothQuant) and sparse24 / sparse24_int8 "
                             f"(SparseGPT's 2:4), not {self.method}")
        if self.calibration is None and self.method in CALIBRATED_METHODS:
            object.__setattr__(self, "calibration", "self")  # calibrated unless asked not to

    @property
    def group(self) -> int:
        """int4's columns per scale and offset: `group_size`, else the default."""
        return self.group_size or DEFAULT_GROUP

    @property
    def calibrated(self) -> bool:
        """Whether loading calibrates (GPTQ, SmoothQuant, SparseGPT): on a text file or the model's own text."""
        return self.calibration not in (None, "none")

    @classmethod
    def parse(cls, method: str, options: dict[str, Any] | str | None = None) -> QuantConfig:
        """From a method name and options given as a dict or a JSON object string."""
        if isinstance(options, str):
            try:
                options = json.loads(options)
            except json.JSONDecodeError as exc:
                raise UserError(f"quantization config is not valid JSON ({exc}): {options!r}") from None
        if not isinstance(options, (dict, type(None))):  # a user's value: ValueError, as everywhere here
            raise UserError(f"quantization config must be a JSON object, got {options!r}")  # noqa: TRY004
        options = dict(options or {})
        unknown = sorted(set(options) - set(QUANT_OPTIONS))
        if unknown:
            raise UserError(f"unknown quantization option(s) {', '.join(unknown)}; known: {', '.join(QUANT_OPTIONS)}")
        return cls(method=method, **options)

    @property
    def act_mode(self) -> str:
        """What the group-quantized weights multiply: `activations`; when unset, "int16" for int4 and
        gguf (the fast integer kernel at no measurable quality cost), "float" for the other methods."""
        return self.activations or ("int16" if self.method in ("int4", "gguf") else "float")

    def describe(self) -> str:
        """One line for logs and JSON: the method and the options that matter for it."""
        acts = {"float": "", "int8": " a8", "int16": " a16"}[self.act_mode]
        source = " self" if self.calibration == "self" else ""  # the calibration text: the model's own
        if self.method == "int4":
            return f"int4 g{self.group} {'gptq' + source if self.calibrated else 'rtn'}{acts}"
        if self.method == "gguf":
            return f"gguf{acts}"
        if self.method == "w8a8":
            return f"w8a8{' smoothquant' + source if self.calibrated else ''}"
        if self.method.startswith("sparse24"):
            return f"2:4 {'int8' if self.method.endswith('int8') else 'float32'} {'sparsegpt' + source if self.calibrated else 'magnitude'}"
        return self.method


PRUNE_METHODS = ("structured", "layers", "2:4", "probe")  # compress/prune.py; "probe": compress/probe.py
PRUNE_OPTIONS = ("method", "ratio", "calibration", "calibration_tokens", "multiple", "bias_compensation",
                 "probe_tokens", "probe_sequences", "dense_layers")


@dataclass(frozen=True)
class PruneConfig:
    """Static pruning (`brisk prune`, `LLM(pruning={...})`, `--pruning '<json>'`; compress/prune.py).

    "structured": whole KV groups of attention heads and MLP channels, `ratio` of the decoder
    layers' Linear weights removed, spread over the layers by FLAP's standardized fluctuation
    scores (MLP widths kept in multiples of `multiple`; every layer keeps >= 1 KV group and
    `multiple` channels; `bias_compensation`: the pruned channels' mean calibration output added
    to o_proj / down_proj as a bias). "layers": `ratio` of the layers removed, the ones whose
    output is most like their input (ShortGPT's block influence). "2:4": of every 4 input columns
    of every decoder Linear 2 are kept, chosen and updated by SparseGPT, stored packed
    (quant/sparse24.py; its ratio is 0.5, and with quantization "int8" the kept values are int8).
    "probe": Probe Pruning (compress/probe.py), decided per batch of prompts at run time: of every
    layer but the first `dense_layers`, `ratio` of its weights (whole KV groups, then MLP channels in
    multiples of `multiple`) go, chosen from a probe (the `probe_tokens` share of the tokens with the
    largest residual norm, of the `probe_sequences` share of the batch's sequences) fused with the
    calibration text's states; ratio 0 is the dense model.
    All score on the first `calibration_tokens` tokens of the text file `calibration`."""

    method: str
    ratio: float = 0.5
    calibration: str | None = None
    calibration_tokens: int = 8192
    multiple: int = 64
    bias_compensation: bool = True
    probe_tokens: float = 0.5  # "probe": Probe Pruning's defaults (Le et al.: half the tokens of 5% of the batch)
    probe_sequences: float = 0.05
    dense_layers: int = 3

    def __post_init__(self) -> None:
        if self.method not in PRUNE_METHODS:
            raise UserError(f"unknown pruning method {self.method!r}; available: {', '.join(PRUNE_METHODS)}")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or \
                not (0 <= self.ratio < 1 if self.method == "probe" else 0 < self.ratio < 1):
            bounds = "from 0 (the dense model) up to but not including 1" if self.method == "probe" else \
                "strictly between 0 and 1"
            raise UserError(f"pruning ratio must be a number {bounds} (0.25 removes a quarter), got {self.ratio!r}")
        for name in ("probe_tokens", "probe_sequences"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise UserError(f"pruning {name} is a share of the batch in (0, 1], got {value!r}")
        if isinstance(self.dense_layers, bool) or not isinstance(self.dense_layers, int) or self.dense_layers < 0:
            raise UserError(f"pruning dense_layers (first layers left whole) must be an integer >= 0, "
                             f"got {self.dense_layers!r}")
        if self.method == "2:4" and self.ratio != 0.5:
            raise UserError(f"2:4 sparsity keeps 2 of every 4 weights of a row: its ratio is 0.5, got {self.ratio!r}")
        if not self.calibration or not isinstance(self.calibration, str):
            raise UserError(f"pruning method {self.method!r} scores heads, channels and layers on calibration text: "
                             'give "calibration": the path of a text file (a few thousand tokens of the kind of '
                             "text the model will see)")
        if not isinstance(self.calibration_tokens, int) or self.calibration_tokens < 256:
            raise UserError(f"pruning calibration_tokens must be an integer >= 256, got {self.calibration_tokens!r}")
        if not isinstance(self.multiple, int) or self.multiple < 1 or self.multiple & (self.multiple - 1):
            raise UserError(f"pruning multiple must be a power of two (MLP widths are kept in multiples of it; "
                             f"64 suits int4 groups), got {self.multiple!r}")

    @classmethod
    def parse(cls, options: dict[str, Any] | str) -> PruneConfig:
        """From a dict or a JSON object string, as `--pruning` gives it."""
        if isinstance(options, str):
            try:
                options = json.loads(options)
            except json.JSONDecodeError as exc:
                raise UserError(f"pruning config is not valid JSON ({exc}): {options!r}") from None
        if not isinstance(options, dict):
            raise UserError(f"pruning config must be a JSON object, got {options!r}")  # noqa: TRY004
        unknown = sorted(set(options) - set(PRUNE_OPTIONS))
        if unknown:
            raise UserError(f"unknown pruning option(s) {', '.join(unknown)}; known: {', '.join(PRUNE_OPTIONS)}")
        if "method" not in options or ("ratio" not in options and options["method"] != "2:4"):
            raise UserError(f'pruning config needs "method" (one of {", ".join(PRUNE_METHODS)}) and "ratio"')
        return cls(**options)

    def describe(self) -> str:
        return self.method if self.method == "2:4" else f"{self.method} {self.ratio:g}"

    def sparse_quant(self, quant: QuantConfig | None) -> QuantConfig:
        """2:4: the weight format that holds it (quant/sparse24.py), int8 values under "int8"."""
        if quant is not None and quant.method != "int8":
            raise UserError(f"2:4 sparsity stores its kept weights as float32, or as int8 with quantization int8; "
                             f"it cannot combine with {quant.method}")
        return QuantConfig("sparse24_int8" if quant is not None else "sparse24", calibration=self.calibration,
                           calibration_tokens=self.calibration_tokens)


DISTILL_LOSSES = ("fkl", "rkl", "tvd")  # compress/distill.py


def _positive_int(what: str, value: Any, least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise UserError(f"distill {what} must be an integer >= {least}, got {value!r}")


@dataclass(frozen=True)
class DistillConfig:
    """Knowledge distillation (`brisk distill`, compress/distill.py): the student learns the
    teacher's next-token distributions on `batch_size` sequences of `seq_len` tokens a step.

    `loss`: "fkl" forward KL(teacher || student) (with `top_k` > 0, over the teacher's top k tokens
    renormalised), "rkl" reverse KL(student || teacher) (MiniLLM), "tvd" total variation distance.
    `on_policy`: the share of steps whose sequences the student writes itself (temperature 1, from
    the sequence's prompt, or the first `prompt_tokens` tokens of a text window), scored by the teacher (GKD,
    DistillSpec). AdamW at `lr` (linear warm-up over `warmup` steps, cosine decay to 10%), gradients
    clipped at `grad_clip`; `bf16`: bfloat16 autocast for the student's matmuls. The first
    `eval_tokens` tokens of the text are held out, scored every `eval_every` steps; a checkpoint
    every `checkpoint_every` steps. `store_teacher` (fkl over top_k <= 20): the teacher's top k at
    every training position computed once by the engine and stored, instead of its forward in every
    step on the corpus (1.35x faster steps; the one pass costs ~1.6 passes of in-loop teacher work)."""

    loss: str = "fkl"
    steps: int = 200
    batch_size: int = 4
    seq_len: int = 256
    lr: float = 5e-5
    warmup: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    temperature: float = 1.0
    top_k: int = 0
    on_policy: float = 0.0
    prompt_tokens: int = 32
    train_embeddings: bool = False
    bf16: bool = False
    eval_tokens: int = 8192
    eval_every: int = 50
    checkpoint_every: int = 100
    seed: int = 0
    store_teacher: bool = False

    def __post_init__(self) -> None:
        if self.loss not in DISTILL_LOSSES:
            raise UserError(f"unknown distillation loss {self.loss!r}; choose one of: {', '.join(DISTILL_LOSSES)}")
        for name in ("steps", "batch_size", "eval_every", "checkpoint_every", "prompt_tokens"):
            _positive_int(name, getattr(self, name))
        _positive_int("seq_len", self.seq_len, 8)
        _positive_int("eval_tokens", self.eval_tokens, 0)
        _positive_int("top_k", self.top_k, 0)
        _positive_int("warmup", self.warmup, 0)
        if self.top_k and self.loss != "fkl":
            raise UserError(f"top_k keeps the teacher's k most likely tokens, which only forward KL can use; "
                             f"drop top_k or use loss fkl (got loss {self.loss!r})")
        if self.store_teacher and not (self.loss == "fkl" and 1 <= self.top_k <= MAX_LOGPROBS and self.on_policy < 1):
            raise UserError(f"store_teacher keeps the teacher's top k tokens at every training position (k 1..."
                             f"{MAX_LOGPROBS}, what the engine's logprobs give) for forward KL over them: it needs loss "
                             f"fkl, top_k 1..{MAX_LOGPROBS} and some steps off-policy (got loss {self.loss!r}, top_k "
                             f"{self.top_k}, on_policy {self.on_policy:g})")
        if not 0 <= self.on_policy <= 1:
            raise UserError(f"distill on_policy is the share of steps on student-written text, in [0, 1]; "
                             f"got {self.on_policy!r}")
        if self.on_policy and self.prompt_tokens >= self.seq_len:
            raise UserError(f"distill prompt_tokens ({self.prompt_tokens}) must be below seq_len ({self.seq_len}): "
                             "the student writes the rest of each on-policy sequence")
        for name in ("lr", "temperature"):
            if not getattr(self, name) > 0:
                raise UserError(f"distill {name} must be > 0, got {getattr(self, name)!r}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise UserError("distill weight_decay and grad_clip must be >= 0 (grad_clip 0: no clipping)")


DRAFT_VOCAB_FILE = "draft_vocab.json"  # `brisk distill`'s token ranking beside a student (FR-Spec drafts)
MAX_LOGPROBS = 20  # most top-N logprobs a request may ask for (SamplingParams), so the most teacher
# tokens `store_teacher` keeps a position (the engine's logprobs give them)
SPEC_METHODS = ("ngram", "draft", "early_exit", "medusa", "streaming")  # speculative/ registers one proposer per name
SPEC_OPTIONS = ("method", "num_speculative_tokens", "max_speculative_tokens", "prompt_lookup_min",
                "prompt_lookup_max", "model", "quantization", "quantization_config", "exit_layer", "heads",
                "draft_vocab", "draft_vocab_file", "lookup_first")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (`LLM(speculative_config={...})`, `--speculative-config '<json>'`).

    `num_speculative_tokens`: draft tokens verified per step, or "auto": each request's length is
    chosen every step by Thompson sampling over its acceptance history, up to
    `max_speculative_tokens` (7), and may fall to 0 (plain decoding) when drafts stop being accepted.
    Per method: ngram `prompt_lookup_min` / `prompt_lookup_max` (n-gram sizes matched against the
    request's own tokens); draft `model` (+ `quantization`, `quantization_config`, and `draft_vocab`:
    draft among that many most frequent tokens of `draft_vocab_file`, by default the draft directory's
    draft_vocab.json that `brisk distill` writes: FR-Spec, lossless); early_exit
    `exit_layer` (layers the draft runs; None: a quarter of them) and optional `heads` (a file of
    trained exit head weights); medusa and streaming `heads` (written by `brisk train-heads`);
    streaming `quantization`: "int8" runs the stream pass (and its draft head) on int8 copies of the
    top layers' weights, a quarter of float32's bytes, "int4" on 4-bit copies (an eighth; the head
    int8); the target still verifies in its own weights.
    `lookup_first` (any method but ngram): prompt lookup drafts where it finds a match (with
    `prompt_lookup_min` / `prompt_lookup_max`), the method where it does not.
    """

    method: str
    num_speculative_tokens: int | str = "auto"
    max_speculative_tokens: int = 7  # 1 + 7 rows: the verify step stays on the exact small-GEMM path
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    quantization: str | None = None
    quantization_config: dict[str, Any] | None = None
    exit_layer: int | None = None
    heads: str | None = None
    draft_vocab: int | None = None
    draft_vocab_file: str | None = None
    lookup_first: bool = False

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise UserError(f"unknown speculative method {self.method!r}; available: {', '.join(SPEC_METHODS)}")
        k = self.num_speculative_tokens
        if k != "auto" and not (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 15):
            raise UserError(f"num_speculative_tokens must be an integer in 1..15 or \"auto\", got {k!r}")
        if not (isinstance(self.max_speculative_tokens, int) and 1 <= self.max_speculative_tokens <= 15):
            raise UserError(f"max_speculative_tokens must be an integer in 1..15, got {self.max_speculative_tokens!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise UserError(f"prompt_lookup_min and prompt_lookup_max must be integers with 1 <= min <= max, "
                             f"got {lo!r} and {hi!r}")
        if self.method == "draft" and not self.model:
            raise UserError('speculative method "draft" needs "model": the draft model (a name, path or .gguf)')
        if self.method != "draft" and (self.model or self.quantization_config or
                                       (self.quantization and self.method != "streaming")):
            raise UserError(f'"model" and "quantization" configure the draft model; method {self.method!r} has none'
                            + (' (streaming takes "quantization": "int8" or "int4" alone, for its stream pass)'
                               if self.method == "streaming" else ""))
        if self.method == "streaming" and self.quantization not in (None, *STREAM_PASS_QUANTIZATIONS):
            raise UserError(f'streaming\'s "quantization" is the stream pass\'s weights: "int8" or "int4" (lossless: '
                            f'the target verifies every draft), got {self.quantization!r}')
        if self.method in ("medusa", "streaming") and not self.heads:
            raise UserError(f'speculative method "{self.method}" needs "heads": a file written by '
                            f'`brisk train-heads --kind {self.method}`')
        if not isinstance(self.lookup_first, bool) or (self.lookup_first and self.method == "ngram"):
            raise UserError(f'"lookup_first" is true or false, for methods other than ngram (which is prompt lookup '
                            f'itself), got {self.lookup_first!r} with method {self.method!r}')
        if self.method in ("ngram", "draft") and self.heads:
            raise UserError(f'"heads" applies to early_exit, medusa and streaming, not {self.method}')
        if self.exit_layer is not None and (self.method != "early_exit" or not isinstance(self.exit_layer, int)
                                            or self.exit_layer < 1):
            raise UserError(f'"exit_layer" must be an integer >= 1 for method early_exit, got {self.exit_layer!r}')
        if (self.draft_vocab is not None or self.draft_vocab_file is not None) and self.method != "draft":
            raise UserError(f'"draft_vocab" applies to method draft (medusa and early_exit heads carry their own), '
                             f'not {self.method}')
        if self.draft_vocab_file is not None and self.draft_vocab is None:
            raise UserError('"draft_vocab_file" needs "draft_vocab": how many of its most frequent tokens to draft among')
        if self.draft_vocab is not None and (isinstance(self.draft_vocab, bool) or not isinstance(self.draft_vocab, int)
                                             or self.draft_vocab < 1):
            raise UserError(f'"draft_vocab" must be a number of tokens >= 1, got {self.draft_vocab!r}')
        if self.quantization is not None and self.method == "draft":
            QuantConfig.parse(self.quantization, self.quantization_config)  # the same checks as the target's
        elif self.quantization_config is not None:
            raise UserError('"quantization_config" needs "quantization" (e.g. "int4")')

    @property
    def auto(self) -> bool:
        return self.num_speculative_tokens == "auto"

    @property
    def max_tokens(self) -> int:
        """The most draft tokens one request verifies in a step."""
        return self.max_speculative_tokens if self.auto else int(self.num_speculative_tokens)

    @classmethod
    def parse(cls, options: dict[str, Any] | str) -> SpecConfig:
        """From a dict or a JSON object string, as `--speculative-config` gives it."""
        if isinstance(options, str):
            try:
                options = json.loads(options)
            except json.JSONDecodeError as exc:
                raise UserError(f"speculative config is not valid JSON ({exc}): {options!r}") from None
        if not isinstance(options, dict):
            raise UserError(f"speculative config must be a JSON object, got {options!r}")  # noqa: TRY004
        unknown = sorted(set(options) - set(SPEC_OPTIONS))
        if unknown:
            raise UserError(f"unknown speculative option(s) {', '.join(unknown)}; known: {', '.join(SPEC_OPTIONS)}")
        if "method" not in options:
            raise UserError(f'speculative config needs "method": one of {", ".join(SPEC_METHODS)}')
        return cls(**options)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor (`tensor_parallel_size` ranks share every layer) times pipeline
    (`pipeline_parallel_size` stages of contiguous layers) parallelism over torch.distributed.
    `timeout_s`: how long rank 0 waits on a worker in one step before calling it hung (a dead
    worker is noticed at once: its sockets close). `micro_batches`: pieces a step's batch is cut
    into so pipeline stages overlap (None: up to one per stage, of at least 64 tokens each)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    timeout_s: float = 120.0
    micro_batches: int | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UserError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not self.timeout_s > 0:
            raise UserError(f"parallel timeout_s must be > 0 seconds, got {self.timeout_s}")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise UserError(f"micro_batches must be >= 1, got {self.micro_batches}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def check_device(device: str) -> None:
    """A device brisk can run on, or a ValueError saying what to use instead."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"device {device!r} is not a device name: use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise UserError(f"device {device!r}: brisk runs on cpu or cuda")
    if not torch.cuda.is_available():
        raise UserError(f"device {device!r}: this torch sees no CUDA GPU (a CPU-only build, or no driver); "
                         "use --device cpu, or install a CUDA build of torch on a machine with a GPU")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UserError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")


@dataclass(frozen=True)
class EngineConfig:
    """What `LLM(...)` was asked for: the model reference and how to run it."""

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's context window
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise UserError(f"unsupported dtype {self.dtype!r}; choose one of: {', '.join(DTYPES)}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise UserError(f"max_model_len must be > 0, got {self.max_model_len}")
        check_device(self.device)
