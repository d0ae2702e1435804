"""GGUF files: metadata -> ModelConfig, tensors -> HF-named float tensors.

The file is memory-mapped (gguf_file.py reads its header); each tensor is dequantized straight
from the map into its final tensor, one at a time, so the weights never exist twice in memory, or
kept as the map's own bytes (`gguf_blocks`).

llama.cpp's converter permutes the rows of Q and K of Llama models so that its rotary kernel can
rotate adjacent pairs; brisk (like HF) rotates halves, so those rows are permuted back here.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from brisk.config import ModelConfig, RopeScaling
from brisk.errors import UserError
from brisk.loader.dequant import SUPPORTED, dequantize
from brisk.loader.gguf_file import GGUFHeader, TensorInfo, read_header
from brisk.model.base import rotary_layout
from brisk.model.registry import canonical_architecture
from brisk.model.rotary import partial_rotary_order

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms around attention and MLP both: llama.cpp's "ffn_norm" is the pre-MLP one there.
_GEMMA3_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3 stores q|k|v and gate|up fused, as its HF checkpoints do.
_PHI3_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_NAMES_BY_ARCH = {"gemma3": _GEMMA3_NAMES, "phi3": _PHI3_NAMES}
# Rotary frequency factors: part of the config (read by `_rope_scaling`), not weights.
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w; HF names hold w.
_NORM_SHIFTED = {"gemma3"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_FLOAT_TYPES = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
FLOAT_TYPE_NAMES = frozenset(t.name for t in _FLOAT_TYPES)  # as `layer_weight_types` names them
# Architectures whose Q/K llama.cpp permuted for its interleaved rotary.
_PERMUTED_QK = {"llama", "mistral"}


@dataclass
class GGUFFile:
    path: Path
    reader: GGUFHeader
    metadata: dict[str, Any]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "?"))


def open_gguf(path: Path) -> GGUFFile:
    """Open and validate a GGUF file; a corrupt or truncated file is a ValueError saying so."""
    try:
        reader = read_header(path)
        metadata = reader.fields
    except (ValueError, OSError, UnicodeDecodeError) as exc:
        raise UserError(
            f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}); "
            "it may be truncated or corrupt: download or convert it again"
        ) from None
    file = GGUFFile(Path(path), reader, metadata)
    canonical_architecture(file.architecture)
    _check_tensor_types(file)
    expected_end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if expected_end > path.stat().st_size:
        raise UserError(f"{path} is truncated: tensors need {expected_end} bytes, the file has "
                         f"{path.stat().st_size}; download or convert it again")
    return file


def _check_tensor_types(file: GGUFFile) -> None:
    """Fail before loading anything when a tensor type cannot be dequantized."""
    unsupported = sorted({gguf.GGMLQuantizationType(t.tensor_type).name for t in file.reader.tensors
                          if t.tensor_type not in SUPPORTED})
    if unsupported:
        names = ", ".join(sorted(t.name for t in SUPPORTED))
        raise UserError(f"{file.path} uses GGUF tensor type(s) {', '.join(unsupported)}, which brisk cannot "
                         f"load; supported: {names}. Use a file quantized to one of those")


def _rope_factors(reader: GGUFHeader) -> dict[str, tuple[float, ...]]:
    """The file's rotary factor tensors (float32 [head_dim / 2] each), by tensor name."""
    return {t.name: tuple(dequantize(t.data, t.tensor_type, (int(t.shape.prod()),)).tolist())
            for t in reader.tensors if t.name in _ROPE_TENSORS}


def _rope_scaling(meta: dict[str, Any], arch: str, reader: GGUFHeader) -> RopeScaling:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    factors = _rope_factors(reader)
    if "rope_factors_long.weight" in factors:  # Phi-3's LongRoPE, as llama.cpp's converter writes it
        attn = meta.get(f"{arch}.rope.scaling.attn_factor")
        return RopeScaling(rope_type="longrope", original_max_position_embeddings=int(orig) if orig else None,
                           short_factor=factors["rope_factors_short.weight"],
                           long_factor=factors["rope_factors_long.weight"],
                           attention_factor=float(attn) if attn is not None else None)
    if "rope_freqs.weight" in factors:  # Llama 3.1's scaling, precomputed per frequency
        if kind not in ("none", None) and factor != 1.0:
            raise UserError(f"this GGUF has both rope_freqs.weight and rope scaling {kind!r}; brisk applies "
                             "one or the other, not both")
        return RopeScaling(freq_factors=factors["rope_freqs.weight"])
    if kind in ("none", None) or factor == 1.0:
        return RopeScaling()
    if kind not in ("linear", "yarn"):
        raise UserError(f"GGUF rope scaling type {kind!r} is not supported; supported: linear, yarn")
    return RopeScaling(rope_type=kind, factor=factor,
                       original_max_position_embeddings=int(orig) if orig else None)


def gguf_model_config(file: GGUFFile) -> ModelConfig:
    meta, arch = file.metadata, file.architecture

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise UserError(f"{file.path}: GGUF metadata lacks '{arch}.{key}'; the file is incomplete")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    names = {t.name for t in file.reader.tensors}
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, arch, file.reader),
        attention_bias="blk.0.attn_q.bias" in names,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rotary_dim=int(meta.get(f"{arch}.rope.dimension_count") or 0),  # Phi-4-mini rotates 3/4 of a head
        **_family_fields(meta, arch, hidden, heads),
    )


def _family_fields(meta: dict[str, Any], arch: str, hidden: int, heads: int) -> dict[str, Any]:
    """What llama.cpp knows about an architecture without writing it in the file (Gemma 3's
    layer pattern, local rotary base and attention scale), as its model loader sets it."""
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    if arch == "gemma3":
        layers = int(meta[f"{arch}.block_count"])
        pattern = int(meta.get(f"{arch}.attention.sliding_window_pattern") or 6)
        head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
        return {"hidden_act": "gelu_tanh", "sliding_window": window,
                "layer_types": tuple("sliding" if (i + 1) % pattern else "full" for i in range(layers)),
                "rope_local_theta": 10000.0,
                # the 27B model (62 layers) scales by hidden / heads, the others by head_dim
                "query_pre_attn_scalar": float(hidden // heads if layers == 62 else head_dim),
                "final_logit_softcapping": float(meta.get(f"{arch}.final_logit_softcapping") or 0.0)}
    if arch in ("mistral", "phi3") and 0 < window < int(meta[f"{arch}.context_length"]):
        # Mistral and Phi-3 slide every layer when the file gives a window (HF does too)
        return {"sliding_window": window, "layer_types": ("sliding",) * int(meta[f"{arch}.block_count"])}
    return {}


def _hf_name(name: str, arch: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")  # blk.N.attn_q.weight
    names = _NAMES_BY_ARCH.get(arch, _LAYER_NAMES)
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    raise UserError(f"GGUF tensor {name!r} has no place in a {arch} model")


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `permute`: rows (head, pair, half) -> (head, half, pair)."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def _float_tensor(file: GGUFFile, t: TensorInfo, name: str, cfg: ModelConfig) -> torch.Tensor:
    """One tensor dequantized to float32 in HF order (llama's q/k rows un-permuted); the pages of
    the map it was read from are let go (the float copy is what stays)."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    tensor = dequantize(t.data, t.tensor_type, shape)
    file.reader.release(t)
    if cfg.architecture in _PERMUTED_QK and name.endswith(("q_proj.weight", "q_proj.bias")):
        tensor = _unpermute(tensor, cfg.num_attention_heads)
    elif cfg.architecture in _PERMUTED_QK and name.endswith(("k_proj.weight", "k_proj.bias")):
        tensor = _unpermute(tensor, cfg.num_key_value_heads)
    elif cfg.architecture in _NORM_SHIFTED and name.endswith("norm.weight"):
        tensor = tensor - 1.0
    return tensor


def gguf_weights(file: GGUFFile, cfg: ModelConfig, skip: frozenset[str] = frozenset()
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) for every tensor not in `skip`, dequantized one at a time."""
    for t in file.reader.tensors:
        if t.name in _ROPE_TENSORS:
            continue
        name = _hf_name(t.name, cfg.architecture)
        if name not in skip:
            yield name, _float_tensor(file, t, name, cfg)


def gguf_tensor(file: GGUFFile, cfg: ModelConfig, hf_name: str) -> torch.Tensor | None:
    """The tensor of HF name `hf_name` as float32, None when the file has none."""
    for t in file.reader.tensors:
        if t.name not in _ROPE_TENSORS and _hf_name(t.name, cfg.architecture) == hf_name:
            return _float_tensor(file, t, hf_name, cfg)
    return None


def _byte_rows(t: TensorInfo) -> torch.Tensor:
    """A 2-D tensor's bytes as uint8 [rows, row bytes]: a view of the file's read-only memory map.
    Nothing may write to it (the kernels only read); torch warns about that, needlessly here."""
    arr = np.asarray(t.data).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(arr).view(int(t.shape[1]), -1)


def gguf_blocks(file: GGUFFile, cfg: ModelConfig) -> dict[str, tuple[int, torch.Tensor]]:
    """HF name -> (GGML type, uint8 [rows, row bytes]) of every block-quantized 2-D tensor, as the
    file stores it (a view of the map); q/k rows put in HF order like `gguf_weights` does (a copy,
    its pages of the map let go). Whoever copies a view for good calls `release_tensor` after."""
    permuted = cfg.architecture in _PERMUTED_QK
    out: dict[str, tuple[int, torch.Tensor]] = {}
    for t in file.reader.tensors:
        if len(t.shape) != 2 or t.tensor_type in _FLOAT_TYPES or t.name in _ROPE_TENSORS:
            continue
        name = _hf_name(t.name, cfg.architecture)
        rows = _byte_rows(t)
        if permuted and name.endswith("q_proj.weight"):
            rows = _unpermute(rows, cfg.num_attention_heads).contiguous()
            file.reader.release(t)
        elif permuted and name.endswith("k_proj.weight"):
            rows = _unpermute(rows, cfg.num_key_value_heads).contiguous()
            file.reader.release(t)
        if partial_rotary_order(cfg.head_dim, cfg.rotary_dim) is not None and name.endswith(
                ("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
            rows = rotary_layout(cfg, name, rows)  # a copy in the kernels' dim order
            file.reader.release(t)
        out[name] = (int(t.tensor_type), rows)
    return out


def release_tensor(file: GGUFFile, hf_name: str) -> None:
    """Let go of the map's pages of the tensor of HF name `hf_name` (it was copied)."""
    for t in file.reader.tensors:
        if t.name not in _ROPE_TENSORS and _hf_name(t.name, file.architecture) == hf_name:
            file.reader.release(t)


def is_quantized(file: GGUFFile) -> bool:
    """The file holds block-quantized tensors (not only F32 / F16 / BF16)."""
    return any(t.tensor_type not in _FLOAT_TYPES for t in file.reader.tensors)


def layer_weight_types(file: GGUFFile) -> set[str]:
    """The GGML type names of the decoder layers' 2-D weights (the Linears: `blk.N.*`)."""
    return {gguf.GGMLQuantizationType(t.tensor_type).name for t in file.reader.tensors
            if len(t.shape) == 2 and t.name.startswith("blk.")}


def tensor_types(file: GGUFFile) -> dict[str, int]:
    """How many tensors of each GGML type the file holds (for messages and `brisk info`)."""
    counts: dict[str, int] = {}
    for t in file.reader.tensors:
        key = gguf.GGMLQuantizationType(t.tensor_type).name
        counts[key] = counts.get(key, 0) + 1
    return counts


__all__ = ["FLOAT_TYPE_NAMES", "GGUFFile", "gguf_blocks", "gguf_model_config", "gguf_tensor", "gguf_weights",
           "is_quantized", "layer_weight_types", "open_gguf", "release_tensor", "tensor_types"]
