"""GGUF files of the new families, written in the test the way llama.cpp's converter lays them out
(its tensor names from the gguf package's own HF -> GGUF map, Gemma's norms stored as 1 + w, no
Q/K permutation), load into a model whose logits equal HF transformers' on the same weights."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from brisk.loader.gguf_loader import gguf_model_config, gguf_weights, open_gguf
from brisk.model.base import forward_sequence
from brisk.model.registry import build_model

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 48, 6, 4, 2, 16


def _hf(arch: str) -> torch.nn.Module:
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=80, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  max_position_embeddings=128, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    if arch == "gemma3":  # llama.cpp's implicit facts: 5 local layers to 1 global, local base 10k
        cfg = transformers.Gemma3TextConfig(**common, sliding_window=8, query_pre_attn_scalar=HEAD_DIM,
                                            rope_theta=1e6, tie_word_embeddings=True)
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, tie_word_embeddings=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(-0.5, 0.5) if "norm" in name else p.normal_(0, 0.3)
    return model.float().eval()


def _write(model: torch.nn.Module, arch: str, path: Path) -> None:
    w = gguf.GGUFWriter(path, arch)
    for key, value in (("context_length", 128), ("embedding_length", HIDDEN), ("block_count", LAYERS),
                       ("feed_forward_length", 80), ("attention.head_count", HEADS),
                       ("attention.head_count_kv", KV_HEADS), ("attention.key_length", HEAD_DIM),
                       ("attention.value_length", HEAD_DIM), ("vocab_size", VOCAB)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", 1e6 if arch == "gemma3" else 10000.0)
    if arch == "gemma3":
        w.add_uint32(f"{arch}.attention.sliding_window", 8)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3 if arch == "gemma3" else gguf.MODEL_ARCH.QWEN3, LAYERS)
    tensors = []
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and arch == "gemma3":
            continue  # tied
        if "embed_scale" in name or "rotary" in name:
            continue
        arr = t.float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            arr = arr + 1.0  # llama.cpp's converter stores Gemma's 1 + w
        tensors.append((names.get_name(name, try_suffixes=(".weight",)), np.ascontiguousarray(arr)))
    for name, arr in tensors:
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_gguf_file_gives_hf_logits(arch: str, tmp_path: Path) -> None:
    hf = _hf(arch)
    path = tmp_path / f"{arch}.gguf"
    _write(hf, arch, path)
    file = open_gguf(path)
    cfg = gguf_model_config(file)
    assert cfg.qk_norm and cfg.head_dim == HEAD_DIM
    if arch == "gemma3":
        assert cfg.layer_types == ("sliding",) * 5 + ("full",) and cfg.sliding_window == 8
    model = build_model(cfg, torch.float32, max_positions=128)
    with torch.no_grad():
        model.load_weights(gguf_weights(file, cfg))
    ids = [int(i) for i in torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(2))]
    got = model.compute_logits(forward_sequence(model, ids))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, ref, atol=5e-5, rtol=1e-4)
