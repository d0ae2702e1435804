"""Write a GGUF file's float32 twin: the same metadata, every tensor dequantized to F32 in the
file's own layout. llama.cpp's quantizer reads it to write any mix of block types (Q4_K_M,
Q6_K, ...) of the same model, the test and benchmark files of brisk's block kernels."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from brisk.loader.dequant import dequantize

__all__ = ["write_f32_copy"]


def write_f32_copy(src: Path, dst: Path) -> None:
    """`src` with every tensor as F32 (general.file_type ALL_F32) written to `dst`."""
    reader = gguf.GGUFReader(src, "r")
    writer = gguf.GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer adds these itself
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.ALL_F32)
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)
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
