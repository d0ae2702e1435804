"""`brisk bench prune`: pruned models beside their dense model, interleaved in one run.

Single-stream decode (a, b, c, a, b, c, ... so bandwidth swings hit all alike) and batched
throughput on one seeded workload, with each model's parameters and weight bytes; ratios are
against the first model (the dense one). Quality is `brisk eval ppl`'s job (it scores every
variant against the dense float32 model).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from brisk.bench.eval_ppl import weight_bytes
from brisk.bench.latency import DEFAULT_PROMPT, _brisk_run, _interleaved, _machine
from brisk.bench.throughput import make_workload, run_brisk
from brisk.compress.prune import model_params, pruning_of
from brisk.engine.llm import LLM
from brisk.errors import UserError
from brisk.loader.quantized import quantization_of
from brisk.request import SamplingParams


def _as_saved(engine: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint that holds its own format (a 2:4 directory) loads as saved: no -q on top."""
    return {k: v for k, v in engine.items() if k not in ("quantization", "quantization_config")}


PROBE_PREFIX = "probe:"  # a --variants entry "probe:0.4": the dense model under Probe Pruning at that ratio


def _run(llm: LLM, ids: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    """`_brisk_run` with Probe Pruning's decision counted: time to first token from the call (the
    decision runs before the request is queued), and decode over the steps plus the decision."""
    if llm.pruning is None or llm.pruning["method"] != "probe":
        return _brisk_run(llm, ids, new_tokens)
    started = time.perf_counter()
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    m, decision = out.metrics, llm.last_probe
    assert m.first_token_time is not None and m.finish_time is not None and decision is not None
    steps = m.finish_time - m.first_token_time
    _DECISIONS.setdefault(id(llm), []).append((decision.seconds, (new_tokens - 1) / steps))
    return m.first_token_time - started, (new_tokens - 1) / (steps + decision.seconds), out.outputs[0].token_ids


# Probe Pruning runs: (decision seconds, decode tokens/s of the steps alone) per single-stream run, by LLM
_DECISIONS: dict[int, list[tuple[float, float]]] = {}


def _load(m: str, dense: str, engine: dict[str, Any], calibration: str | None) -> LLM:
    if m.startswith(PROBE_PREFIX):
        if calibration is None:
            raise UserError(f"variant {m!r} (Probe Pruning) needs --calibration: the text its history is scored on")
        try:
            ratio = float(m.removeprefix(PROBE_PREFIX))
        except ValueError:
            raise UserError(f"variant {m!r}: write Probe Pruning as probe:RATIO, e.g. probe:0.4") from None
        floats = {k: v for k, v in _as_saved(engine).items() if k != "dequantize"}  # probe always runs on floats
        return LLM(dense, **floats, pruning={"method": "probe", "ratio": ratio, "calibration": calibration})
    return LLM(m, **(engine if quantization_of(Path(m)) is None else _as_saved(engine)))


def bench_prune(models: list[str], engine: dict[str, Any], new_tokens: int, repeats: int, batch: int,
                seed: int = 0, calibration: str | None = None) -> dict[str, Any]:
    """`models[0]` is the dense reference; every model gets the same `engine` options (a checkpoint in
    its own format, such as a 2:4 directory, without the quantization ones). A model "probe:R" is
    `models[0]` under Probe Pruning at ratio R (history from `calibration`), its decision per
    batch counted in its decode and time-to-first-token figures."""
    if any(m.startswith(PROBE_PREFIX) for m in models) and engine.get("quantization"):
        raise UserError("Probe Pruning runs on float weights: drop -q, or compare static pruned directories")
    llms = [_load(m, models[0], engine, calibration) for m in models]
    ids = llms[0].tokenizer.encode(DEFAULT_PROMPT, add_special_tokens=False)
    decode = _interleaved([(_run, llm) for llm in llms], ids, new_tokens, repeats)
    work = make_workload(batch, llms[0].model_config.vocab_size, seed, 128, new_tokens)
    batched: list[list[float]] = [[] for _ in llms]
    for llm in llms:
        run_brisk(llm, make_workload(2, llm.model_config.vocab_size, seed, 16, 4))  # warm-up
    for _ in range(repeats):
        for i, llm in enumerate(llms):
            batched[i].append(run_brisk(llm, work)["output_tokens_per_s"])
    rows = []
    for m, llm, (summary, _), tput in zip(models, llms, decode, batched):
        pruning = llm.pruning or (None if m.startswith(PROBE_PREFIX) else pruning_of(Path(m)))
        rows.append({
            "model": m, "pruning": None if pruning is None else f"{pruning['method']} {pruning['ratio']:g}",
            "layer_weights_removed": None if pruning is None else pruning["layer_weights_removed"],
            "params_m": round(model_params(llm.model.config) / 1e6, 2),  # Probe Pruning: its compact model
            "weight_mib": round(weight_bytes(llm.model) / 2**20, 1),
            "decode_tok_s": summary["decode_tok_s"], "batched_tok_s": round(statistics.median(tput), 2),
            "ttft_s": summary["ttft_s"]})
        if llm.last_probe is not None:  # the decision of the batched run (its prompts are the batch)
            runs = _DECISIONS.pop(id(llm), [])[1:]  # past the warm-up
            rows[-1]["decision_s"] = round(statistics.median(d for d, _ in runs), 4)
            rows[-1]["decode_steps_tok_s"] = round(statistics.median(r for _, r in runs), 2)  # without the decision
            rows[-1]["batched_decision_s"] = round(llm.last_probe.seconds, 3)
    for row in rows:
        row["decode_vs_dense"] = round(row["decode_tok_s"] / rows[0]["decode_tok_s"], 3)
        if "decode_steps_tok_s" in row:
            row["decode_steps_vs_dense"] = round(row["decode_steps_tok_s"] / rows[0]["decode_tok_s"], 3)
        row["batched_vs_dense"] = round(row["batched_tok_s"] / rows[0]["batched_tok_s"], 3)
    return {"bench": "prune", "machine": _machine(engine.get("device", "cpu")),
            "quantization": None if llms[0].quantization is None else llms[0].quantization.describe(),
            "new_tokens": new_tokens, "repeats": repeats, "batch": batch, "models": rows}
