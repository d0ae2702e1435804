"""`brisk bench structured`: what grammars cost a batch, in one process, runs interleaved.

The same chat prompts decode in one batch free and then under a JSON schema (a typical 20-field
record, long enough that every reply runs its full `max_tokens`, so both batches produce the same
number of tokens), alternately `repeats` times; tokens/s of each and their ratio, whole-run and
decode-only (after the last prompt's first token). Also the schema's compile time, first and
cached, and how many replies parse (those cut by max_tokens are not expected to).
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from brisk.engine.llm import LLM
from brisk.request import SamplingParams

TOPICS = ["a library", "a bakery", "a train station", "a museum", "a hospital", "a school", "a harbour",
          "a farm", "a theatre", "a hotel", "a zoo", "a stadium", "an airport", "a garden", "a factory", "a market"]


def record_schema(fields: int = 20) -> dict[str, Any]:
    """A flat record of `fields` typed fields: integers with ranges, bounded strings, booleans,
    enums, numbers; all required, no others."""
    kinds: list[dict[str, Any]] = [
        {"type": "integer", "minimum": 0, "maximum": 100000},
        {"type": "string", "minLength": 3, "maxLength": 40},
        {"type": "boolean"},
        {"enum": ["low", "medium", "high"]},
        {"type": "number", "minimum": 0, "maximum": 1000},
    ]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _run(llm: LLM, prompts: list[str], params: SamplingParams) -> dict[str, float]:
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    firsts = [o.metrics.first_token_time for o in outs if o.metrics.first_token_time is not None]
    ends = [o.metrics.finish_time for o in outs if o.metrics.finish_time is not None]
    decode_s = max(ends) - max(firsts) if firsts and ends else float("nan")
    parsed = 0
    for o in outs:
        try:
            json.loads(o.outputs[0].text)
            parsed += 1
        except ValueError:
            pass
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "decode_tok_s": (tokens - len(outs)) / decode_s if decode_s > 0 else float("nan"), "parsed": parsed}


def bench_structured(llm: LLM, batch: int, max_tokens: int, repeats: int, fields: int) -> dict[str, Any]:
    schema = record_schema(fields)
    grammars = llm.engine.grammars()  # the tokenizer's trie: built once, before anything is timed
    started = time.perf_counter()
    grammars.constraint({"json": schema})
    first_compile = time.perf_counter() - started
    started = time.perf_counter()
    grammars.constraint({"json": schema})
    cached_compile = time.perf_counter() - started
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} "
                                                   f"as a JSON record with {fields} fields."}])
               for i in range(batch)]
    free = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured={"json": schema})
    _run(llm, prompts[:2], free)  # warm-up of both paths
    _run(llm, prompts[:2], constrained)
    runs: dict[str, list[dict[str, float]]] = {"free": [], "constrained": []}
    for _ in range(repeats):  # interleaved: the machine's bandwidth drifts between runs
        runs["free"].append(_run(llm, prompts, free))
        runs["constrained"].append(_run(llm, prompts, constrained))

    def best(name: str, key: str) -> float:
        return max(r[key] for r in runs[name])

    ratios = [c["tok_s"] / f["tok_s"] for f, c in zip(runs["free"], runs["constrained"])]
    decode_ratios = [c["decode_tok_s"] / f["decode_tok_s"] for f, c in zip(runs["free"], runs["constrained"])]
    return {
        "bench": "structured", "model": llm.model_name, "batch": batch, "max_tokens": max_tokens, "fields": fields,
        "repeats": repeats, "compile_first_ms": round(first_compile * 1e3, 2),
        "compile_cached_ms": round(cached_compile * 1e3, 3),
        "free_tok_s": round(best("free", "tok_s"), 1), "constrained_tok_s": round(best("constrained", "tok_s"), 1),
        "constrained_over_free": [round(r, 3) for r in ratios],
        "median_constrained_over_free": round(statistics.median(ratios), 3),
        "decode_constrained_over_free": [round(r, 3) for r in decode_ratios],
        "tokens_free": runs["free"][-1]["tokens"], "tokens_constrained": runs["constrained"][-1]["tokens"],
        "constrained_replies_parsed": runs["constrained"][-1]["parsed"],
    }
