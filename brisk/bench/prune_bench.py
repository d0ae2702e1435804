"""`brisk bench prune`: pruned models beside their dense model, interleaved in one run.

Single-stream decode (a, b, c, a, b, c, ... so bandwidth swings hit all alike) and batched
throughput on one seeded workload, with each model's parameters and weight bytes; ratios are
against the first model (the dense one). Quality is `brisk eval ppl`'s job (it scores every
variant against the dense float32 model).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from brisk.bench.eval_ppl import weight_bytes
from brisk.bench.latency import DEFAULT_PROMPT, _brisk_run, _interleaved, _machine
from brisk.bench.throughput import make_workload, run_brisk
from brisk.compress.prune import model_params, pruning_of
from brisk.engine.llm import LLM
from brisk.loader.quantized import quantization_of


def _as_saved(engine: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint that holds its own format (a 2:4 directory) loads as saved: no -q on top."""
    return {k: v for k, v in engine.items() if k not in ("quantization", "quantization_config")}


def bench_prune(models: list[str], engine: dict[str, Any], new_tokens: int, repeats: int, batch: int,
                seed: int = 0) -> dict[str, Any]:
    """`models[0]` is the dense reference; every model gets the same `engine` options (a checkpoint in
    its own format, such as a 2:4 directory, without the quantization ones)."""
    llms = [LLM(m, **(engine if quantization_of(Path(m)) is None else _as_saved(engine))) for m in models]
    ids = llms[0].tokenizer.encode(DEFAULT_PROMPT, add_special_tokens=False)
    decode = _interleaved([(_brisk_run, llm) for llm in llms], ids, new_tokens, repeats)
    work = make_workload(batch, llms[0].model_config.vocab_size, seed, 128, new_tokens)
    batched: list[list[float]] = [[] for _ in llms]
    for llm in llms:
        run_brisk(llm, make_workload(2, llm.model_config.vocab_size, seed, 16, 4))  # warm-up
    for _ in range(repeats):
        for i, llm in enumerate(llms):
            batched[i].append(run_brisk(llm, work)["output_tokens_per_s"])
    rows = []
    for m, llm, (summary, _), tput in zip(models, llms, decode, batched):
        pruning = llm.pruning or pruning_of(Path(m))
        rows.append({
            "model": m, "pruning": None if pruning is None else f"{pruning['method']} {pruning['ratio']:g}",
            "layer_weights_removed": None if pruning is None else pruning["layer_weights_removed"],
            "params_m": round(model_params(llm.model_config) / 1e6, 2),
            "weight_mib": round(weight_bytes(llm.model) / 2**20, 1),
            "decode_tok_s": summary["decode_tok_s"], "batched_tok_s": round(statistics.median(tput), 2)})
    for row in rows:
        row["decode_vs_dense"] = round(row["decode_tok_s"] / rows[0]["decode_tok_s"], 3)
        row["batched_vs_dense"] = round(row["batched_tok_s"] / rows[0]["batched_tok_s"], 3)
    return {"bench": "prune", "machine": _machine(engine.get("device", "cpu")),
            "quantization": None if llms[0].quantization is None else llms[0].quantization.describe(),
            "new_tokens": new_tokens, "repeats": repeats, "batch": batch, "models": rows}
