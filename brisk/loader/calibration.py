"""Calibration text for GPTQ (int4), SmoothQuant (w8a8) and SparseGPT (2:4) at load: a user's text
file, or by default the model's own answers to built-in prompts ("self"), so `-q int4` is
calibrated without asking the user for data.

Why the model's own text: it is the distribution the quantized model will be asked to produce, it
needs no download, and it covers whatever the model knows (prose, code, lists, dialogue) rather
than one corpus. Measured on SmolLM2-135M at g64, 8,192 tokens scored (BENCHMARKS.md, "Calibration
without a user's text"): against WikiText calibration it is worse on WikiText and better on code;
both are far better than round-to-nearest.

Calibrating costs minutes (the generation, then GPTQ's column sweep: ~90 s on the default model
here), so both are cached on disk (loader/disk_cache.py): the generated ids per model file, token
count and prompt set; the calibrated model's state per model file, quantization options and
calibration text. The second load of a model with the same options reads the state and skips the
float weights, the generation and the calibration.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

from brisk.config import QuantConfig
from brisk.errors import UserError
from brisk.loader.disk_cache import cache_dir, load_array, load_tensors, store_array, store_tensors
from brisk.loader.resolve import ModelSource
from brisk.loader.tokenizer import Tokenizer
from brisk.model.base import CausalLM, sample_batch

log = logging.getLogger(__name__)

# What the model is asked: prose, explanation, code, dialogue, lists, numbers, letters; in
# several registers, so that every Linear sees the inputs its usual work gives it.
PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how vaccines train the immune system.",
    "Write a Python function that merges two sorted lists, with comments and a short test.",
    "Describe the water cycle step by step.",
    "Write a dialogue between a customer returning a broken kettle and a shop assistant.",
    "What were the main causes of the French Revolution?",
    "Give me a recipe for pancakes with a list of ingredients and numbered steps.",
    "Explain recursion to a beginner programmer, with an example in JavaScript.",
    "Write a poem about autumn in a small town.",
    "Summarize the plot of a detective novel you invent, naming the characters.",
    "How does a four-stroke car engine work?",
    "Write a polite email asking a colleague for a meeting next week about the budget.",
    "What is the difference between a list and a tuple in Python? Show code.",
    "Describe a busy city market in the early morning.",
    "Solve step by step: a train travels 240 km in 3 hours; how long does it take to travel 400 km?",
    "Write a SQL query that returns the ten customers with the highest total orders, and explain it.",
    "Compare renewable and fossil energy sources in a table with their pros and cons.",
    "Write a letter from a soldier to his family in 1916.",
    "Give five tips for learning a new language, as a bulleted list.",
    "Explain what a black hole is to a ten-year-old.",
    "Write a product description for a waterproof hiking backpack.",
    "Translate into French and Spanish: 'The library opens at nine and closes at six.'",
    "What is photosynthesis, and why does it matter for life on Earth?",
    "Write a bash script that counts the lines of every .txt file in a folder.",
)
TEMPERATURE, TOP_P, SEED = 0.8, 0.95, 0  # varied text, without the unlikely tail of temperature 1
VERSION = 1  # bump when the prompts or the sampling change: cached texts are then made again
# bump when a calibrated method's rounding changes (quant/gptq.py, w8a8.py, sparse24.py): cached
# calibrated models are then made again
QUANT_VERSION = 2  # 2: GPTQ refits scales and offsets after its sweep


def calibration_ids(quant: QuantConfig, model: CausalLM, tokenizer: Tokenizer, source: ModelSource) -> list[int] | None:
    """The token ids `quant` calibrates on: a text file's first `calibration_tokens` tokens, the
    model's own generations ("self"), or None (uncalibrated: "none", or a method without calibration)."""
    if not quant.calibrated:
        return None
    if quant.calibration == "self":
        return self_generated(model, tokenizer, source, quant.calibration_tokens)
    path = _text_file(quant)
    text = path.read_text(encoding="utf-8", errors="replace")
    ids = tokenizer.encode(text, add_special_tokens=False)[:quant.calibration_tokens]
    if len(ids) < 16:
        raise UserError(f"calibration text {path} gives {len(ids)} tokens; at least 16 are needed "
                         f"(a few hundred are better)")
    return ids


def _text_file(quant: QuantConfig) -> Path:
    path = Path(str(quant.calibration))
    if not path.is_file():
        raise UserError(f"calibration text {path} is not a file (give a text file's path, \"self\" for the "
                         "model's own generations, or \"none\")")
    return path


def self_generated(model: CausalLM, tokenizer: Tokenizer, source: ModelSource, tokens: int) -> list[int]:
    """`tokens` ids of the model's answers to PROMPTS (chat-rendered when the model has a chat
    template, else raw text to continue), sampled with a fixed seed; cached per model file."""
    key = _cache_key(source, model, tokens)
    cached = load_array("calibration", key)
    if cached is not None and cached.ndim == 1 and len(cached) == tokens:
        return cached.astype(np.int64).tolist()
    started = time.perf_counter()
    log.warning("quantization calibration: generating %d tokens of the model's own answers to %d built-in prompts, "
                "then calibrating (minutes, once per model and options: cached in %s). \"calibration\": \"none\" "
                "skips it; a text file's path calibrates on your own text.", tokens, len(PROMPTS), cache_dir())
    ids = generate(model, tokenizer, tokens)
    store_array("calibration", key, np.asarray(ids, dtype=np.int32))
    log.info("calibration text: %d tokens in %.1f s", len(ids), time.perf_counter() - started)
    return ids


def generate(model: CausalLM, tokenizer: Tokenizer, tokens: int, seed: int = SEED) -> list[int]:
    """Prompts and answers, concatenated until `tokens` ids: rounds over PROMPTS (each answer
    `tokens / len(PROMPTS)` new tokens at most; a round's seed is the last's + 1) until enough."""
    prompts = [_render(tokenizer, p) for p in PROMPTS]
    per_answer = math.ceil(tokens / len(PROMPTS))
    limit = model.max_positions
    prompts = [p[-max(1, limit - per_answer):] for p in prompts]  # a short-context model keeps the prompt's end
    stop = tokenizer.eos_token_ids
    ids: list[int] = []
    for round_ in range(8):  # answers that end early leave a shortfall: another round fills it
        generator = torch.Generator().manual_seed(seed + round_)
        answers = sample_batch(model, prompts, [min(per_answer, limit - len(p)) for p in prompts], generator,
                               TEMPERATURE, TOP_P, stop)
        for prompt, answer in zip(prompts, answers):
            ids += prompt + answer
        if len(ids) >= tokens:
            return ids[:tokens]
    if len(ids) < 16:
        raise UserError("the model's own generations gave fewer than 16 calibration tokens: give a calibration "
                         "text file (\"calibration\": \"text.txt\")")
    return ids


def _render(tokenizer: Tokenizer, prompt: str) -> list[int]:
    if tokenizer.chat_template is not None:
        return tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt + "\n\n")


def cached_state(quant: QuantConfig, model: CausalLM, source: ModelSource) -> dict[str, torch.Tensor] | None:
    """The state of `model` quantized by `quant` at an earlier load, when cached; None otherwise
    (and always for uncalibrated methods, which quantize in seconds)."""
    if not quant.calibrated:
        return None
    return load_tensors("quantized", _state_key(quant, model, source))


def store_state(quant: QuantConfig, model: CausalLM, source: ModelSource) -> None:
    """Cache `model`'s state after calibrated quantization (a no-op for uncalibrated methods)."""
    if quant.calibrated:
        store_tensors("quantized", _state_key(quant, model, source), dict(model.state_dict()))


def _state_key(quant: QuantConfig, model: CausalLM, source: ModelSource) -> str:
    """What the calibrated weights depend on: the model files, the options but `activations` (a
    run-time choice), the calibration text (a file by its bytes), the context the calibration
    forwards see (max positions), the dtype and device kind they ran in, the rounding's version."""
    text = quant.calibration if quant.calibration == "self" else \
        hashlib.sha256(_text_file(quant).read_bytes()).hexdigest()
    return _key({"files": _file_stats(source), "method": quant.method, "group_size": quant.group,
                 "calibration": text, "tokens": quant.calibration_tokens, "self": [VERSION, PROMPTS],
                 "positions": model.max_positions, "dtype": str(model.dtype), "device": model.device.type,
                 "version": QUANT_VERSION})


def _cache_key(source: ModelSource, model: CausalLM, tokens: int) -> str:
    """The model file(s) (`_file_stats`), what the sampled text depends on (positions, dtype,
    device kind), the token count and the prompt set."""
    return _key({"files": _file_stats(source), "positions": model.max_positions, "dtype": str(model.dtype),
                 "device": model.device.type, "tokens": tokens, "version": VERSION, "prompts": PROMPTS,
                 "sampling": [TEMPERATURE, TOP_P, SEED]})


def _file_stats(source: ModelSource) -> list[tuple[str, int, int]]:
    """The model file(s) by path, size and modification time (hashing gigabytes would cost more
    than the generation)."""
    files = sorted(p for p in source.path.iterdir() if p.is_file()) if source.path.is_dir() else [source.path]
    return [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def _key(parts: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]
