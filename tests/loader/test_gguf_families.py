"""GGUF files of the new families, written in the test the way llama.cpp's converter lays them out
(its tensor names from the gguf package's own HF -> GGUF map, Gemma's norms stored as 1 + w,
Llama's Q/K rows permuted, Phi-3's fused qkv and gate|up, rotary factors as tensors), load into a
model whose logits equal HF transformers' on the same weights."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from brisk.loader.gguf_loader import gguf_model_config, gguf_weights, open_gguf
from brisk.model.base import forward_sequence
from brisk.model.registry import build_model

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 64, 6, 4, 2, 16  # Phi-3: head_dim = hidden / heads
CONTEXT, ORIGINAL = 128, 64  # Phi-3: LongRoPE's original window inside its context
SHORT = [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)]
LONG = [1.5 + 0.3 * i for i in range(HEAD_DIM // 2)]
# Llama 3.1's rope scaling with a window short enough that the test's positions reach the scaled
# frequencies (the real models use factor 8 over 8192 positions)
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
ARCH = {"qwen3": gguf.MODEL_ARCH.QWEN3, "gemma3": gguf.MODEL_ARCH.GEMMA3, "llama": gguf.MODEL_ARCH.LLAMA,
        "phi3": gguf.MODEL_ARCH.PHI3}


def _hf(arch: str, rotary: int = HEAD_DIM) -> torch.nn.Module:
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  max_position_embeddings=CONTEXT, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    if arch == "gemma3":  # llama.cpp's implicit facts: 5 local layers to 1 global, local base 10k
        cfg = transformers.Gemma3TextConfig(**common, sliding_window=8, query_pre_attn_scalar=HEAD_DIM,
                                            rope_theta=1e6, tie_word_embeddings=True)
        model = transformers.Gemma3ForCausalLM(cfg)
    elif arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_scaling=LLAMA3,
                                                                       rope_theta=10000.0))
    elif arch == "phi3":
        pairs = rotary // 2  # Phi-4-mini rotates 3/4 of each head: factors for its rotated pairs only
        cfg = transformers.Phi3Config(**common, original_max_position_embeddings=ORIGINAL, sliding_window=12,
                                      rope_scaling={"rope_type": "longrope", "short_factor": SHORT[:pairs],
                                                    "long_factor": LONG[:pairs]}, pad_token_id=0,
                                      partial_rotary_factor=rotary / HEAD_DIM)
        model = transformers.Phi3ForCausalLM(cfg)
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, tie_word_embeddings=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(-0.5, 0.5) if "norm" in name else p.normal_(0, 0.3)
    return model.float().eval()


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order for its interleaved rotary."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_factors() -> list[float]:
    """What llama.cpp's converter writes as rope_freqs.weight for LLAMA3 (its formula)."""
    freqs = 1.0 / (10000.0 ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM))
    old, factor = LLAMA3["original_max_position_embeddings"], LLAMA3["factor"]
    low, high = LLAMA3["low_freq_factor"], LLAMA3["high_freq_factor"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _write(model: torch.nn.Module, arch: str, path: Path, rotary: int = HEAD_DIM) -> None:
    w = gguf.GGUFWriter(path, arch)
    for key, value in (("context_length", CONTEXT), ("embedding_length", HIDDEN), ("block_count", LAYERS),
                       ("feed_forward_length", 96), ("attention.head_count", HEADS),
                       ("attention.head_count_kv", KV_HEADS), ("attention.key_length", HEAD_DIM),
                       ("attention.value_length", HEAD_DIM), ("vocab_size", VOCAB),
                       ("rope.dimension_count", rotary)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    # a small SentencePiece vocabulary, so the file loads whole (load_model reads its tokenizer)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"\u2581w{i}" for i in range(VOCAB - 3)])
    w.add_token_scores([0.0] * 3 + [-float(i) for i in range(VOCAB - 3)])
    w.add_token_types([2, 3, 3] + [1] * (VOCAB - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_float32(f"{arch}.rope.freq_base", 1e6 if arch == "gemma3" else 10000.0)
    if arch == "gemma3":
        w.add_uint32(f"{arch}.attention.sliding_window", 8)
    tensors = []
    if arch == "phi3":  # as the converter's Phi3MiniModel writes them
        w.add_uint32(f"{arch}.attention.sliding_window", 12)
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", ORIGINAL)
        w.add_float32(f"{arch}.rope.scaling.attn_factor", math.sqrt(1 + math.log(CONTEXT / ORIGINAL) / math.log(ORIGINAL)))
        tensors += [("rope_factors_long.weight", np.array(LONG[:rotary // 2], dtype=np.float32)),
                    ("rope_factors_short.weight", np.array(SHORT[:rotary // 2], dtype=np.float32))]
    if arch == "llama":
        tensors.append(("rope_freqs.weight", np.array(_llama3_factors(), dtype=np.float32)))
    names = gguf.get_tensor_name_map(ARCH[arch], LAYERS)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and arch == "gemma3":
            continue  # tied
        if "embed_scale" in name or "rotary" in name:
            continue
        arr = t.float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            arr = arr + 1.0  # llama.cpp's converter stores Gemma's 1 + w
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            arr = _permute(arr, HEADS if "q_proj" in name else KV_HEADS)
        tensors.append((names.get_name(name, try_suffixes=(".weight",)), np.ascontiguousarray(arr)))
    for name, arr in tensors:
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "llama", "phi3"])
def test_gguf_file_gives_hf_logits(arch: str, tmp_path: Path) -> None:
    hf = _hf(arch)
    path = tmp_path / f"{arch}.gguf"
    _write(hf, arch, path)
    file = open_gguf(path)
    cfg = gguf_model_config(file)
    assert cfg.head_dim == HEAD_DIM and cfg.qk_norm == (arch in ("qwen3", "gemma3"))
    if arch == "gemma3":
        assert cfg.layer_types == ("sliding",) * 5 + ("full",) and cfg.sliding_window == 8
    if arch == "phi3":
        assert cfg.layer_types == ("sliding",) * LAYERS and cfg.rope_scaling.rope_type == "longrope"
    if arch == "llama":
        assert cfg.rope_scaling.freq_factors[-1] == LLAMA3["factor"]
    # within Phi-3's original window: its short factors, as HF picks them for a 30-token sequence
    model = build_model(cfg, torch.float32, max_positions=ORIGINAL)
    with torch.no_grad():
        model.load_weights(gguf_weights(file, cfg))
    ids = [int(i) for i in torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(2))]
    got = model.compute_logits(forward_sequence(model, ids))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, ref, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("rotary", [HEAD_DIM, 12], ids=["whole", "partial"])
def test_phi3_gguf_runs_from_its_blocks(tmp_path: Path, rotary: int) -> None:
    """A quantized Phi-3 file keeps its fused qkv / gate|up tensors as blocks (one segment each):
    no Linear falls back to floats, and the logits match the dequantized model's. Partial rotary
    (Phi-4-mini's rope.dimension_count below head_dim): the q / k block rows reordered like the
    float weights, and the float file gives HF's logits."""
    from brisk.loader.load import load_model
    from brisk.quant.gguf import BlockLinear, GroupLinear

    hf = _hf("phi3", rotary)
    f32 = tmp_path / "phi3-f32.gguf"
    _write(hf, "phi3", f32, rotary)
    if rotary != HEAD_DIM:
        floats32 = load_model(str(f32), max_model_len=ORIGINAL).model
        assert floats32.config.rotary_dim == rotary
        ids = [int(i) for i in torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(2))]
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(floats32.compute_logits(forward_sequence(floats32, ids)), ref, atol=5e-5, rtol=1e-4)
    q8 = tmp_path / "phi3-q8_0.gguf"
    _requantize(f32, q8)
    blocks = load_model(str(q8), max_model_len=ORIGINAL).model
    floats = load_model(str(q8), max_model_len=ORIGINAL, dequantize=True).model
    attn = blocks.layers[0].self_attn
    assert isinstance(attn.qkv_proj, (BlockLinear, GroupLinear)) and isinstance(blocks.layers[0].mlp.gate_up_proj,
                                                                                 (BlockLinear, GroupLinear))
    ids = [int(i) for i in torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(4))]
    got, ref = (m.compute_logits(forward_sequence(m, ids)) for m in (blocks, floats))
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    torch.testing.assert_close(got, ref, atol=0.15, rtol=0.05)  # int8 activations against float ones


def _requantize(src: Path, dst: Path) -> None:
    """Every 2-D weight of `src` as Q8_0 (the gguf package's own quantizer), the rest as stored."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, "phi3")
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        arr = np.asarray(t.data).reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
        if arr.ndim == 2 and "norm" not in t.name:
            w.add_tensor(t.name, gguf.quantize(arr, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(t.name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
