"""`brisk bench families`: every architecture's decode at one shape, side by side (issue 19's
"no family is a second-class citizen": each family's tokens/s per weight byte against Llama's).

Each family is built at the same shape (by default SmolLM2-135M's: 30 layers, hidden 576, 9 query
and 3 KV heads of 64, MLP 1536, vocabulary 49,152, tied head) with seeded random weights, so no
file is needed and every model has the same weight bytes; only what makes the family differs:
Qwen3's QK norms, Phi-3's LongRoPE tables, Mistral's window, Gemma 3's (1 + w) pre and post norms,
QK norms, GELU, embedding scale, two rotary bases and five sliding layers to one global. Rounds
alternate the families; the figure is the median decode tokens/s of a greedy request, the prompt
excluded, on the engine a user gets (C++ decode plan where it serves).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from brisk.config import CacheConfig, ModelConfig, RopeScaling, SchedulerConfig
from brisk.engine.llm_engine import LLMEngine
from brisk.errors import UserError
from brisk.loader.tokenizer import Tokenizer
from brisk.model.base import CausalLM
from brisk.model.registry import build_model
from brisk.request import SamplingParams

FAMILIES = ("llama", "qwen3", "phi3", "mistral", "gemma3")
SHAPE = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rope_theta=100000.0,
                    tie_word_embeddings=True)


def family_config(family: str, shape: ModelConfig = SHAPE) -> ModelConfig:
    """`shape` as `family` (module docstring); windows shorter than the run's context so they slide."""
    layers = shape.num_hidden_layers
    if family == "llama":
        return shape
    if family == "qwen3":
        return dataclasses.replace(shape, architecture="qwen3", qk_norm=True)
    if family == "phi3":
        dim = shape.head_dim // 2
        rope = RopeScaling.from_hf({"rope_type": "longrope", "short_factor": [1.0 + 0.01 * i for i in range(dim)],
                                    "long_factor": [1.5 + 0.1 * i for i in range(dim)],
                                    "original_max_position_embeddings": shape.max_position_embeddings // 2,
                                    "factor": 2.0})
        return dataclasses.replace(shape, architecture="phi3", rope_scaling=rope)
    if family == "mistral":
        return dataclasses.replace(shape, architecture="mistral", layer_types=("sliding",) * layers, sliding_window=64)
    if family == "gemma3":
        types = tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(layers))
        return dataclasses.replace(shape, architecture="gemma3", hidden_act="gelu_tanh", qk_norm=True,
                                   layer_types=types, sliding_window=64, query_pre_attn_scalar=float(shape.head_dim),
                                   rope_local_theta=10000.0, rope_theta=1_000_000.0)
    raise UserError(f"no such family {family!r}; known: {', '.join(FAMILIES)}")


def random_model(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    """`cfg`'s model in float32 with seeded random weights (norm weights near their identity)."""
    model = build_model(cfg, torch.float32, max_positions=cfg.max_position_embeddings)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma stores w of (1 + w): around 0 is around the identity there
                p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (0.0 if cfg.architecture == "gemma3" else 1.0))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.eval()


def _decode_tok_s(engine: LLMEngine, prompt: list[int], new_tokens: int, tag: str) -> float:
    engine.add_request(tag, prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompt and the first token
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - start)


def _tokenizer() -> Tokenizer:
    """Ids only: the engine detokenizes what it emits, random models emit anything (unknown ids decode empty)."""
    backend = Backend(models.WordLevel({"w0": 0, "w1": 1}, unk_token="w1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, bos_token_id=None, eos_token_id=0, add_bos=False, chat_template=None)


def bench_families(families: list[str], new_tokens: int, repeats: int, prompt_len: int = 64,
                   layers: int = SHAPE.num_hidden_layers) -> dict[str, Any]:
    """Decode tokens/s of each family at SHAPE (with `layers` layers), rounds interleaved; JSON-ready."""
    shape = dataclasses.replace(SHAPE, num_hidden_layers=layers)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families or len(set(families)) != len(families):
        raise UserError(f"--families takes some of {', '.join(FAMILIES)}, each once, got {','.join(families)!r}")
    if new_tokens < 2 or repeats < 1 or layers < 1:
        raise UserError("--new-tokens must be >= 2, --repeats >= 1 and --layers >= 1")
    engines, bytes_of, plan = {}, {}, {}
    for f in families:
        model = random_model(family_config(f, shape))
        bytes_of[f] = sum(p.numel() * p.element_size() for p in model.parameters())
        engines[f] = LLMEngine(model, _tokenizer(), CacheConfig(block_size=16, num_kv_blocks=64),
                               SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=4, max_model_len=512))
    prompt = torch.randint(2, SHAPE.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    runs: dict[str, list[float]] = {f: [] for f in families}
    for f in families:  # warm-up: the plan is built on the first decode step
        _decode_tok_s(engines[f], prompt, 4, f"warm-{f}")
        plan[f] = engines[f].runner.plans.current is not None
    for r in range(repeats):
        for f in (families if r % 2 == 0 else families[::-1]):
            runs[f].append(_decode_tok_s(engines[f], prompt, new_tokens, f"{f}-{r}"))
    base = families[0]
    out = []
    for f in families:
        tok_s = statistics.median(runs[f])
        per_byte = tok_s * bytes_of[f] / 1e9
        out.append({"family": f, "decode_tok_s": round(tok_s, 2), "runs": [round(v, 2) for v in runs[f]],
                    "weight_mb": round(bytes_of[f] / 1e6, 1), "weight_gb_per_s": round(per_byte, 2),
                    "decode_plan": plan[f],
                    f"per_byte_vs_{base}": round(per_byte / (statistics.median(runs[base]) * bytes_of[base] / 1e9), 3)})
    return {"bench": "families", "shape": {k: getattr(shape, k) for k in ("num_hidden_layers", "hidden_size",
                                                                        "num_attention_heads", "num_key_value_heads",
                                                                        "intermediate_size", "vocab_size")},
            "dtype": "float32", "threads": torch.get_num_threads(), "new_tokens": new_tokens, "prompt_len": prompt_len,
            "repeats": repeats, "families": out}
