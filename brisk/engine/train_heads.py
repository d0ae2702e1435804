"""`brisk train-heads`: generate self-distillation text with the target, train heads, save them.

The prompts are chat questions built from topic x template (or a file, one prompt per line); the
target answers them greedily in one batched run, and speculative/train.py fits the heads on its answers.
The benchmark's open-chat prompts (bench/spec_bench.py) are written separately and no topic here
is one of theirs (no friendship, space, hiking, job interviews or flight), so the figures measure
heads on questions they never saw.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from brisk.engine.llm import LLM
from brisk.engine.prompts_file import read_prompts_file
from brisk.errors import UserError
from brisk.request import SamplingParams
from brisk.speculative.heads import save_heads
from brisk.speculative.train import HeadTraining, features, train_heads
from brisk.speculative.streaming import StreamAdapter, load_streams, save_streams
from brisk.speculative.train_streams import StreamTraining, stream_features, train_streams

TOPICS = [
    "volcanoes", "the water cycle", "photosynthesis", "the Roman Empire", "black holes", "vaccines",
    "electric cars", "the stock market", "coral reefs", "the printing press", "machine learning",
    "climate change", "the human heart", "honey bees", "the moon landing", "jazz music", "chess",
    "recycling", "earthquakes", "the Great Wall of China", "solar panels", "sleep", "dinosaurs",
    "the internet", "coffee", "rainforests", "the French Revolution", "antibiotics", "gravity",
    "the Olympic Games", "penguins", "bread baking", "the immune system", "wind turbines",
    "ancient Egypt", "time management", "the periodic table", "hurricanes", "public speaking",
    "the Renaissance", "cryptography", "tea", "glaciers", "the stock exchange", "bicycles",
    "meditation", "democracy", "plate tectonics", "octopuses", "saving money",
    "the Industrial Revolution", "nuclear energy", "gardening", "the ocean tides",
    "smartphones", "the Silk Road", "exercise", "languages",
    "volunteering", "board games", "the human brain", "street food", "libraries", "thunderstorms",
    "photography", "the Amazon river", "robots", "marathons", "castles", "mushrooms", "elections",
    "video games", "deserts", "kindness", "origami", "trains", "whales", "the printing of money",
    "cooking pasta", "learning to swim", "moving to a new city", "writing a resume", "birthdays",
    "music lessons", "pets", "traffic", "snow", "the first day of school", "museums",
    "vegetarian food", "social media", "lighthouses", "volcanic islands", "fairy tales",
    "the alphabet", "bridges", "picnics", "recycling plastic", "spiders", "clocks", "rain",
    "negotiating a salary", "learning math", "budget travel", "houseplants",
    "farming", "chocolate", "sharks", "teamwork", "pottery",
]
TEMPLATES = [
    "Explain {t} to a ten-year-old.", "Write a short paragraph about {t}.", "What are the most important facts about {t}?",
    "Give me three tips related to {t}.", "Describe the history of {t} in a few sentences.",
    "Why does {t} matter?", "Write a short poem about {t}.", "What are common misconceptions about {t}?",
    "Tell me a story involving {t}.", "How would you teach someone about {t}?", "List pros and cons of {t}.",
    "What is your opinion on {t}?", "Write a tweet about {t}.", "Summarize what people should know about {t}.",
    "Answer briefly: what is {t}?", "Write an email to a friend about {t}.",
]


def training_prompts(count: int, seed: int = 0) -> list[str]:
    pairs = [t.format(t=topic) for topic in TOPICS for t in TEMPLATES]
    random.Random(seed).shuffle(pairs)
    return pairs[:count]


def run_train_heads(model: str, kind: str, out: Path, num_heads: int = 4, exit_layer: int | None = None,
                    num_prompts: int = 480, max_tokens: int = 256, epochs: int = 3, prompts_file: Path | None = None,
                    draft_vocab: int = 8192, sequences_file: Path | None = None, sequential: bool = True,
                    stream_layers: int = 4, lora_rank: int = 8, token_rank: int | None = None, bf16: bool = False,
                    log: Callable[[dict[str, Any]], None] = lambda _: None, init: Path | None = None) -> dict[str, Any]:
    """Generate, train, save; returns the report (also what the CLI prints as JSON). `sequences_file`:
    where the generated answers are kept (read instead of generating when it exists); `init`
    (streaming): a streams file to continue training from, whose shape then sets the streams',
    layers' and ranks' counts."""
    from brisk.loader.load import model_config_of

    llm = LLM(model, max_model_len=min(2048, model_config_of(model).max_position_embeddings))
    layers = llm.model_config.num_hidden_layers
    start = None
    if kind == "streaming" and init is not None:  # read before hours of generation, not after
        start = load_streams(init, llm.model)[0]
        num_heads, stream_layers, lora_rank, token_rank = (start.num_streams, layers - start.first_layer,
                                                           start.rank, start.token_a.shape[0])
    if kind == "early_exit":
        exit_layer = exit_layer or layers // 2
        if not 1 <= exit_layer < layers:
            raise UserError(f"--exit-layer must be between 1 and {layers - 1}, got {exit_layer}")
    if kind == "streaming" and not 1 <= stream_layers < layers:
        raise UserError(f"--stream-layers must be between 1 and {layers - 1} for this {layers}-layer model, "
                        f"got {stream_layers}")
    started = time.perf_counter()
    prompts = (_read_prompts(prompts_file) if prompts_file else training_prompts(num_prompts))[:num_prompts]
    key = {"model": str(Path(model).resolve()) if Path(model).exists() else model, "max_tokens": max_tokens,
           "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest()}
    if sequences_file is not None and sequences_file.is_file():  # answers generated by an earlier run
        sequences = _read_sequences(sequences_file, key, llm.model_config.vocab_size)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=True)
        sequences = [(o.prompt_token_ids + o.outputs[0].token_ids, len(o.prompt_token_ids)) for o in outs]
        if sequences_file is not None:  # whole or not at all; a failed write loses the file, not the run
            tmp = sequences_file.with_name(sequences_file.name + ".tmp")
            try:
                tmp.write_text(json.dumps({"key": key, "sequences": sequences}), encoding="utf-8")
                os.replace(tmp, sequences_file)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                log({"warning": f"the answers were not kept in {sequences_file} ({exc.strerror or exc}); "
                                "training goes on"})
    generated = sum(len(ids) - n for ids, n in sequences)
    log({"generated_tokens": generated, "sequences": len(sequences), "seconds": round(time.perf_counter() - started, 1)})
    cut = max(1, len(sequences) // 10)  # the first tenth is held out
    vocab, coverage = _frequent_tokens(sequences[cut:], sequences[:cut], draft_vocab, llm.model_config.vocab_size)
    extra = {"sequences": str(len(sequences)), "generated_tokens": str(generated)}
    if kind == "streaming":
        return {"generated_tokens": generated, "draft_vocab": None if vocab is None else len(vocab),
                "held_out_vocab_coverage": coverage,
                **_train_streams(llm, sequences, cut, StreamTraining(num_heads, stream_layers, lora_rank, epochs,
                                                                      token_rank=token_rank, bf16=bf16),
                                 vocab, out, extra, log, start)}
    cfg = HeadTraining(kind=kind, num_heads=num_heads if kind == "medusa" else 1, exit_layer=exit_layer,
                       sequential=sequential, epochs=epochs)
    heads, report = train_heads(llm.model, features(llm.model, sequences[cut:], cfg),
                                features(llm.model, sequences[:cut], cfg), cfg, vocab, log)
    save_heads(out, heads, kind, llm.model_name, exit_layer if kind == "early_exit" else None, extra, vocab)
    return {"kind": kind, "out": str(out), "model": llm.model_name, "num_heads": heads.num_heads,
            "exit_layer": exit_layer, "generated_tokens": generated,
            "draft_vocab": None if vocab is None else len(vocab), "held_out_vocab_coverage": coverage,
            "generation_seconds": round(time.perf_counter() - started - float(report["seconds"]), 1), **report}


def _train_streams(llm: LLM, sequences: list[tuple[list[int], int]], cut: int, cfg: StreamTraining,
                   vocab: torch.Tensor | None, out: Path, extra: dict[str, str],
                   log: Callable[[dict[str, Any]], None], init: StreamAdapter | None = None) -> dict[str, Any]:
    """Speculative Streaming: features of the frozen model, then the streams and adapters."""
    model = llm.model
    started = time.perf_counter()
    first = model.config.num_hidden_layers - cfg.num_layers
    kv_dtype = torch.bfloat16 if cfg.bf16 else None
    train = stream_features(model, sequences[cut:], first, kv_dtype)
    held_out = stream_features(model, sequences[:cut], first, kv_dtype)
    log({"features_seconds": round(time.perf_counter() - started, 1), "train_sequences": len(train)})
    if not train or not held_out:
        raise UserError("too little text to train streams: need answers of at least 3 tokens in the training "
                        "and the held-out tenth (more --num-prompts or --max-tokens)")
    saved: list[int] = []

    def checkpoint(adapter: StreamAdapter, epoch: int) -> None:  # `out` holds the last whole epoch's streams,
        save_streams(out, adapter, llm.model_name, model.config, {**extra, "epochs_done": str(epoch)}, vocab)
        saved.append(epoch)  # the last one's the trained file

    try:
        adapter, report = train_streams(model, train, held_out, cfg, vocab, log, progress=True, init=init,
                                        on_epoch=checkpoint)
    except FloatingPointError as e:
        kept = (f"{out} holds the streams after epoch {saved[-1]}: continue from them with --init {out}"
                if saved else "nothing was written")
        raise UserError(f"stream training diverged ({e.args[0]}; that step was not taken); {kept}, at a lower "
                        "learning rate or in bfloat16 off") from None
    return {"kind": "streaming", "out": str(out), "model": llm.model_name, "num_streams": cfg.num_streams,
            "stream_layers": cfg.num_layers, "lora_rank": cfg.rank,
            "main_stream": "frozen: the adapters act on stream rows only, so the served model and its "
                           "perplexity are the original's", **report}


def _read_sequences(path: Path, key: dict[str, Any], vocab_size: int) -> list[tuple[list[int], int]]:
    """The answers an earlier run kept in `path`, if that run generated them as this one would (the
    same model, prompts and max_tokens); a file of another run is refused, not trained on. A file
    from before the key was written (a bare list) is taken if its tokens are this model's."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        kept = data.get("key") if isinstance(data, dict) else None
        rows = data["sequences"] if isinstance(data, dict) else data
        sequences = [(list(map(int, ids)), int(n)) for ids, n in rows]
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"--sequences {path} is not an answers file written by train-heads ({exc}); "
                        "delete it or name another file") from None
    if kept is not None and kept != key:
        differ = ", ".join(f"{k} {kept.get(k)!r} (this run: {v!r})" for k, v in key.items() if kept.get(k) != v)
        raise UserError(f"--sequences {path} holds answers of another run: {differ}; name another file (it is "
                        "written there), or run with the options that wrote it")
    if any(t < 0 or t >= vocab_size for ids, _ in sequences for t in ids):
        raise UserError(f"--sequences {path} holds token ids outside this model's {vocab_size}-token vocabulary: "
                        "answers of another model; name another file")
    return sequences


def _frequent_tokens(train: list[tuple[list[int], int]], held_out: list[tuple[list[int], int]], n: int,
                     vocab_size: int) -> tuple[torch.Tensor | None, float | None]:
    """The n tokens most frequent in the training answers (None: n is 0 or covers the vocabulary),
    and the share of held-out answer tokens among them."""
    if n <= 0 or n >= vocab_size:
        return None, None
    counts = torch.zeros(vocab_size)
    for ids, prompt_len in train:
        counts += torch.bincount(torch.tensor(ids[prompt_len:]), minlength=vocab_size)[:vocab_size]
    vocab = counts.argsort(descending=True)[:n]
    keep = torch.zeros(vocab_size, dtype=torch.bool)
    keep[vocab] = True
    tokens = torch.tensor([t for ids, p in held_out for t in ids[p:]], dtype=torch.long)
    return vocab, round(float(keep[tokens].float().mean()), 4) if len(tokens) else None


def _read_prompts(path: Path) -> list[str]:
    """The prompts of a prompts file (engine/prompts_file.py): plain lines or JSON lines with
    "prompt"; train-heads answers single prompts, so a "messages" line is refused."""
    prompts = []
    for number, item in read_prompts_file(path):
        prompt = item.get("prompt")
        if not isinstance(prompt, str):
            raise UserError(f"prompts file {str(path)!r} line {number}: a JSON line needs a \"prompt\" string "
                            "(train-heads answers single prompts, not \"messages\" conversations)")
        if prompt.strip():
            prompts.append(prompt.strip())
    if not prompts:
        raise UserError(f"prompts file {str(path)!r} has no prompts (one per line)")
    return prompts
