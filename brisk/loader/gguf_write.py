"""Write float32 GGUF files for llama.cpp's quantizer, which turns them into any mix of block types
(Q4_K_M, Q6_K, ...): the test and benchmark files of brisk's block kernels.

- `write_f32_copy`: a file's float32 twin, the same metadata, every tensor dequantized to F32.
- `write_synthetic`: a Llama of a chosen shape with random weights and another file's tokenizer:
  a model at a size no package ships (every width a multiple of 256, so a K-quant mix stores every
  Linear in a K-quant, as real 1-8B files do), for kernel speed only: its text is noise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from brisk.loader.dequant import dequantize

__all__ = ["write_f32_copy", "write_synthetic"]


def _copy_fields(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, overrides: dict[str, Any]) -> None:
    """Every metadata field of `reader` into `writer` (file type ALL_F32, `overrides` by key)."""
    overrides = {gguf.Keys.General.FILE_TYPE: int(gguf.LlamaFileType.ALL_F32), **overrides}
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer adds these itself
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, overrides.get(field.name, field.contents()), val_type, sub_type=sub_type)


def write_f32_copy(src: Path, dst: Path) -> None:
    """`src` with every tensor as F32 (general.file_type ALL_F32) written to `dst`."""
    reader = gguf.GGUFReader(src, "r")
    writer = gguf.GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    _copy_fields(reader, writer, {})
    floats = []
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        floats.append((t.name, dequantize(t.data, t.tensor_type, shape).numpy().astype(np.float32)))
    for name, arr in floats:
        writer.add_tensor_info(name, arr.shape, arr.dtype, arr.nbytes, gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, arr in floats:
        writer.write_tensor_data(arr)
    writer.close()


def write_synthetic(src: Path, dst: Path, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                    head_dim: int, seed: int = 0) -> None:
    """A Llama (`src` a Llama GGUF: its tokenizer, chat template and rope settings) of this shape with
    N(0, 0.02) weights, unit norms and a tied head, as F32 to `dst`: written a tensor at a time."""
    reader = gguf.GGUFReader(src, "r")
    arch = str(reader.fields["general.architecture"].contents())
    if arch != "llama":
        raise ValueError(f"write_synthetic takes a llama GGUF for its tokenizer, got architecture {arch!r}")
    writer = gguf.GGUFWriter(dst, arch)
    _copy_fields(reader, writer, {
        "llama.embedding_length": hidden, "llama.feed_forward_length": intermediate, "llama.block_count": layers,
        "llama.attention.head_count": heads, "llama.attention.head_count_kv": kv_heads,
        "llama.rope.dimension_count": head_dim, gguf.Keys.General.NAME: f"synthetic-llama-{hidden}x{layers}"})
    vocab = int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[-1])
    shapes: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, hidden))]
    for i in range(layers):
        shapes += [(f"blk.{i}.{name}.weight", shape) for name, shape in (
            ("attn_norm", (hidden,)), ("attn_q", (heads * head_dim, hidden)), ("attn_k", (kv_heads * head_dim, hidden)),
            ("attn_v", (kv_heads * head_dim, hidden)), ("attn_output", (hidden, heads * head_dim)),
            ("ffn_norm", (hidden,)), ("ffn_gate", (intermediate, hidden)), ("ffn_up", (intermediate, hidden)),
            ("ffn_down", (hidden, intermediate)))]
    shapes.append(("output_norm.weight", (hidden,)))
    for name, shape in shapes:
        writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4, gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, shape in shapes:
        norm = len(shape) == 1
        writer.write_tensor_data(np.ones(shape, np.float32) if norm else rng.standard_normal(shape, dtype=np.float32) * 0.02)
    writer.close()
