"""Load a model reference into a ready model + tokenizer."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from brisk.config import ModelConfig, QuantConfig
from brisk.errors import UserError
from brisk.loader.calibration import cached_state, calibration_ids, store_state
from brisk.loader.gguf_loader import (
    FLOAT_TYPE_NAMES,
    GGUFFile,
    gguf_blocks,
    gguf_model_config,
    gguf_tensor,
    gguf_weights,
    is_quantized,
    layer_weight_types,
    open_gguf,
    release_tensor,
)
from brisk.loader.hf_loader import check_hf_dir, hf_model_config, hf_weights
from brisk.loader.resolve import ModelSource, resolve_model
from brisk.loader.tokenizer import Tokenizer
from brisk.model.base import CausalLM
from brisk.model.layers import Linear
from brisk.model.registry import build_model

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    source: ModelSource
    quantization: QuantConfig | None = None  # how the weights are quantized (by the checkpoint or at load)


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise UserError(f"unsupported dtype {name!r}; choose one of: {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def read_checkpoint(source: ModelSource) -> tuple[ModelConfig, Tokenizer, Iterator[tuple[str, torch.Tensor]]]:
    """Config, tokenizer and a lazy stream of HF-named float tensors, whatever the format."""
    if source.kind == "gguf":
        file = open_gguf(source.path)
        cfg = gguf_model_config(file)
        return cfg, Tokenizer.from_gguf_metadata(file.metadata), gguf_weights(file, cfg)
    check_hf_dir(source.path)
    cfg = hf_model_config(source.path)
    return cfg, Tokenizer.from_hf_dir(source.path), hf_weights(source.path)


def _check_len(cfg: ModelConfig, max_model_len: int | None) -> None:
    if max_model_len is not None and max_model_len > cfg.max_position_embeddings:
        raise UserError(f"max_model_len {max_model_len} exceeds the model's context window "
                         f"({cfg.max_position_embeddings} tokens)")


def model_config_of(ref: str) -> ModelConfig:
    """The architecture config of `ref` without reading its weights (checks before a slow start)."""
    source = resolve_model(ref)
    if source.kind == "gguf":
        return gguf_model_config(open_gguf(source.path))
    check_hf_dir(source.path)
    return hf_model_config(source.path)


def _file_blocks(quant: QuantConfig | None) -> bool:
    """`quant` is a method whose weights are a file's own blocks (gguf: quant/methods.py)."""
    from brisk.quant import method

    return quant is not None and method(quant).from_file_blocks


def keeps_blocks(source: ModelSource, file: GGUFFile | None, quant: QuantConfig | None, dequantize: bool,
                 device: str) -> bool:
    """A quantized GGUF runs from its blocks (quant/gguf.py) unless told to dequantize or to
    quantize another way; on devices without the block kernels it is dequantized once."""
    if source.kind != "gguf" or file is None:
        return False
    if _file_blocks(quant) and dequantize:
        raise UserError("-q gguf keeps the file's blocks and --dequantize turns them into floats: choose one")
    if quant is not None and not _file_blocks(quant):
        return False  # int8 / int4 / ... quantize the dequantized weights
    return not dequantize and torch.device(device).type == "cpu" and is_quantized(file)


AS_STORED = "the file as stored, brisk's default without -q, runs them exactly"


def keep_file_grid(quant: QuantConfig, file: GGUFFile) -> QuantConfig:
    """int4 with no group_size on a file whose layers are all Q4_0 / Q4_1 blocks, calibrated on the
    model's own text (the default) or not at all: groups of 32, round-to-nearest, which lands on
    blocks written by llama.cpp's quantizer exactly (`quantize_rtn_4bit`; `check_kept_grid` says
    where it did not). Groups of 64 would round those weights a second time (+9% perplexity on the
    default model's Q4_1 file even with GPTQ; BENCHMARKS.md), and calibrating cannot do better than
    the file. A given group_size or calibration text is kept as asked. Any other quantized file is
    rounded again, with a warning."""
    if quant.method != "int4":
        return quant
    types = layer_weight_types(file)
    if not types or not types <= {"Q4_0", "Q4_1"} or quant.group_size is not None or \
            quant.calibration not in ("self", "none"):  # a text of the user's: GPTQ on it, as asked
        if types - FLOAT_TYPE_NAMES:  # llama.cpp's quantize refuses this without --allow-requantize
            log.warning("int4 rounds this file's %s weights a second time (measured: +9%% perplexity on the "
                        "default model's Q4_1 file at g64, +17%% on Gemma 3 270M's Q4_K_M file, both GPTQ-"
                        "calibrated); %s", "/".join(sorted(types - FLOAT_TYPE_NAMES)), AS_STORED)
        return quant
    log.info("int4: the file's layers are %s blocks (4-bit groups of 32): kept on that grid (int4 g32 "
             "round-to-nearest, nothing to calibrate); give group_size to round them again",
             " and ".join(sorted(types)))
    return dataclasses.replace(quant, group_size=32, calibration="none")


def check_kept_grid(model: CausalLM, floats: dict[str, torch.Tensor]) -> None:
    """After `keep_file_grid`: warn where an int4 weight is not its file weight exactly (blocks whose
    scales llama.cpp chose by an importance matrix need not sit on the grid min/max or Q4_0's rule
    finds), naming how many Linears were rounded again."""
    from brisk.quant.grouped import GroupLinear

    moved = [name for name, m in model.named_modules()
             if isinstance(m, GroupLinear) and m.bits == 4 and name in floats
             and not torch.equal(m.dequantize(), floats[name].float())]
    if moved:
        log.warning("int4 rounded %d of the file's Q4 Linears again (first: %s): their blocks are not on the "
                    "grid brisk's int4 recovers (an importance-matrix quantization, or a dtype below float32 "
                    "that rounded them); %s", len(moved), moved[0], AS_STORED)


def load_model(ref: str, dtype: str = "float32", device: str = "cpu", max_model_len: int | None = None,
               quant: QuantConfig | None = None,
               before_quant: Callable[[CausalLM], None] | None = None,
               dequantize: bool = False) -> LoadedModel:
    """Resolve `ref`, build the architecture and stream the weights into it; quantize with `quant`.

    A quantized GGUF keeps its blocks (`quantization` "gguf") unless `dequantize` or another
    `quant` method asks for floats: its float model is never made (its Linears are built empty,
    which costs no memory until written, and swapped before any weight is read).
    A checkpoint written by `brisk quantize` loads as saved (`quant` must then be None or equal,
    but for `activations`, a run-time choice that `quant` may change).
    `before_quant` reshapes the float model first (tensor-parallel sharding: each shard is quantized)."""
    from brisk.loader.quantized import load_quantized_state, quantization_of
    from brisk.quant import method, set_activations

    source = resolve_model(ref)
    tdtype = torch_dtype(dtype)
    saved = quantization_of(source.path) if source.kind == "hf" else None
    if saved is not None:
        if quant is not None and (quant.method != saved.method
                                  or (method(quant).group_sized and quant.group_size not in (None, saved.group_size))):
            raise UserError(f"{ref} is already quantized ({saved.describe()}); drop the quantization option "
                             f"({quant.describe()}) or quantize the original model")
        check_hf_dir(source.path)
        cfg, tokenizer = hf_model_config(source.path), Tokenizer.from_hf_dir(source.path)
        _check_len(cfg, max_model_len)
        with torch.device(device):
            model = build_model(cfg, tdtype, max_positions=max_model_len or cfg.max_position_embeddings)
        load_quantized_state(model, source.path, saved)
        if quant is not None and quant.activations is not None:
            saved = dataclasses.replace(saved, activations=quant.activations)
        set_activations(model, saved.act_mode)
        if before_quant is not None:
            before_quant(model)
        return LoadedModel(model.eval(), tokenizer, cfg, source, saved)
    if _file_blocks(quant) and source.kind != "gguf":
        raise UserError(f"quantization gguf keeps a GGUF file's own blocks, but {ref} is not a .gguf file; "
                         "choose int8 or int4 for other models")
    file = open_gguf(source.path) if source.kind == "gguf" else None
    kept_grid = False  # int4 resolved to the file's Q4 grid (keep_file_grid): checked after quantizing
    if quant is not None and file is not None:
        asked, quant = quant, keep_file_grid(quant, file)
        kept_grid = quant != asked
    if keeps_blocks(source, file, quant, dequantize, device):
        assert file is not None
        return _load_blocks(file, source, tdtype, device, max_model_len, quant or QuantConfig("gguf"), before_quant)
    if _file_blocks(quant):
        raise UserError(f"{ref} holds no quantized blocks to keep (only float tensors) on {device}: load it "
                         "without -q gguf, or with int8 / int4")
    cfg, tokenizer, weights = read_checkpoint(source)
    _check_len(cfg, max_model_len)

    def build() -> CausalLM:
        with torch.device(device):
            return build_model(cfg, tdtype, max_positions=max_model_len or cfg.max_position_embeddings)

    model = build()
    if quant is not None and before_quant is None and (state := cached_state(quant, model, source)) is not None:
        from brisk.loader.quantized import fill_quantized_state

        try:  # calibrated at an earlier load: no float weights read, no calibration
            fill_quantized_state(model, state, quant, Path("the calibration cache entry"))
            set_activations(model, quant.act_mode)
            return LoadedModel(model.eval(), tokenizer, cfg, source, quant)
        except UserError as exc:  # written by another brisk version: calibrate again (and replace it)
            log.warning("ignoring a cached calibrated model: %s", exc)
            model = build()
    with torch.no_grad():
        model.load_weights(weights)
    if before_quant is not None:
        before_quant(model)
    if quant is not None:
        floats = {n: m.weight for n, m in model.named_modules() if isinstance(m, Linear)} if kept_grid else {}
        quantize_model(model, quant, source, cfg, tokenizer)
        if kept_grid:
            check_kept_grid(model, floats)
        if before_quant is None:  # a shard's or stage's state is not the model's
            store_state(quant, model, source)
        set_activations(model, quant.act_mode)
    return LoadedModel(model.eval(), tokenizer, cfg, source, quant)


def _load_blocks(file: GGUFFile, source: ModelSource, tdtype: torch.dtype, device: str, max_model_len: int | None,
                 quant: QuantConfig, before_quant: Callable[[CausalLM], None] | None) -> LoadedModel:
    """A quantized GGUF with its blocks kept: native modules first, then the float tensors left."""
    from brisk.quant import set_activations
    from brisk.quant.gguf import attach_blocks

    cfg = gguf_model_config(file)
    _check_len(cfg, max_model_len)
    tokenizer = Tokenizer.from_gguf_metadata(file.metadata)
    with torch.device(device):
        model = build_model(cfg, tdtype, max_positions=max_model_len or cfg.max_position_embeddings)
    def bias_of(weight_name: str) -> torch.Tensor | None:
        return gguf_tensor(file, cfg, weight_name.removesuffix(".weight") + ".bias")

    def release_rows(rows: torch.Tensor) -> None:  # rows of the map just copied (elsewhere: left alone)
        if rows.is_contiguous():
            file.reader.release_bytes(rows.data_ptr(), rows.numel() * rows.element_size())

    with torch.no_grad():
        served = attach_blocks(model, gguf_blocks(file, cfg), bias_of, lambda name: release_tensor(file, name),
                               release_rows)
        model.load_weights(gguf_weights(file, cfg, skip=frozenset(served)))
    if before_quant is not None:
        before_quant(model)
    set_activations(model, quant.act_mode)
    return LoadedModel(model.eval(), tokenizer, cfg, source, quant)


def quantize_model(model: CausalLM, quant: QuantConfig, source: ModelSource, cfg: ModelConfig,
              tokenizer: Tokenizer) -> None:
    from brisk.quant import apply

    calibration = calibration_ids(quant, model, tokenizer, source)
    apply(model, quant, calibration)
