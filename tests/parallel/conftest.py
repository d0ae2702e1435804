"""A tiny Qwen2-shaped model (QKV bias, untied head: the paths the default model does not take)
and a tiny Gemma 3 (sliding and full layers: several KV groups) written as HF folders, so spawned
workers load them like any model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from brisk.config import ModelConfig
from brisk.loader.convert import write_tokenizer_files
from brisk.loader.hf_loader import hf_config_dict
from brisk.loader.tokenizer import Tokenizer
from brisk.model.registry import build_model

VOCAB = 64
TINY = ModelConfig(architecture="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, attention_bias=True,
                   eos_token_id=0)
# 3 sliding layers (window 6) and 1 full: 4 KV groups of one layer each
TINY_GEMMA = ModelConfig(architecture="gemma3", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=0, hidden_act="gelu_tanh",
                         layer_types=("sliding", "full", "sliding", "sliding"), sliding_window=6, qk_norm=True,
                         query_pre_attn_scalar=16.0, rope_local_theta=10000.0)


def write_tiny(out: Path, seed: int = 0, cfg: ModelConfig = TINY) -> Path:
    torch.manual_seed(seed)
    model = build_model(cfg, torch.float32, max_positions=256)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    tensors = {}
    for name, t in model.state_dict().items():
        if name.startswith("rope_"):
            continue
        tensors.update(_unstack(name, t, cfg))
    out.mkdir(parents=True, exist_ok=True)
    save_file({f"model.{k}" if k != "lm_head.weight" else k: v.contiguous() for k, v in tensors.items()},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    backend = Backend(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    write_tokenizer_files(Tokenizer(backend, bos_token_id=None, eos_token_id=0, add_bos=False, chat_template=None),
                          cfg, out)
    return out


def _unstack(name: str, t: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our stacked qkv / gate_up tensors back to HF's separate projections."""
    q, kv, i = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    if ".qkv_proj." in name:
        parts = t.split((q, kv, kv))
        return {name.replace("qkv_proj", p): x for p, x in zip(("q_proj", "k_proj", "v_proj"), parts)}
    if ".gate_up_proj." in name:
        parts = t.split((i, i))
        return {name.replace("gate_up_proj", p): x for p, x in zip(("gate_proj", "up_proj"), parts)}
    return {name: t}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("tiny_gemma") / "model", cfg=TINY_GEMMA)
