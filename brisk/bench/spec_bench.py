"""`brisk bench spec`: every speculative method beside plain decoding, on two workloads, batch 1.

- input_grounded: summarise, rewrite or extract from a passage given in the prompt, and edit code;
  the output copies spans of the input, which is where n-gram lookup shines.
- open_chat: questions with nothing to copy from (none of them among `brisk train-heads`' prompts).

Each prompt runs greedily through the plain engine and each speculative engine in turn (the same
loaded model; the order turns with each prompt so no engine always goes first), so every ratio is
measured side by side on one machine state; greedy outputs are
checked identical to plain decoding. Per method: tokens/s and its ratio to plain, acceptance rate
a, mean drafts and accepted tokens per verify step, and Leviathan et al.'s predicted tokens per
step from the measured a at the mean draft length k: (1 - a^(k+1)) / (1 - a).
"""

from __future__ import annotations

import platform
import time
from typing import Any

import torch

from brisk.engine.llm import LLM
from brisk.request import SamplingParams
from brisk.speculative.length import expected_tokens

PASSAGES = [
    ("The lighthouse at Point Arden was built in 1872 from granite quarried two miles inland. Its lamp, first "
    "fuelled by whale oil and later by kerosene, was converted to electricity in 1931. The last keeper, "
    "Margaret Hale, left in 1968 when the light was automated. Today the tower is a museum run by volunteers, "
    "and the original Fresnel lens is displayed in the keeper's cottage beside it."),
    ("Sourdough bread rises without commercial yeast. A starter of flour and water captures wild yeasts and "
    "lactic acid bacteria from the air and the flour itself. Bakers feed the starter daily, discarding part "
    "of it each time. The bacteria give the bread its sour taste, while the yeasts produce the carbon dioxide "
    "that lifts the dough. A loaf typically needs twelve to eighteen hours from mixing to baking."),
    ("The Arden City council voted on Tuesday to extend the tram line by four kilometres to the university "
    "campus. The project will cost 120 million dollars and add five new stops. Construction is planned to "
    "start in March and finish within three years. Council member Julia Ortiz said the extension would take "
    "about two thousand cars off the road every day."),
]
CODE = [
    "def average(values):\n    total = 0\n    for v in values:\n        total = total + v\n    return total / len(values)\n",
    ("class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def add(self, n):\n        self.count = self.count + n\n"
    "        return self.count\n"),
]
TASKS = [
    "Summarize the following text in two sentences.\n\n{p}",
    "Rewrite the following text in simpler words, keeping every fact.\n\n{p}",
    "List every number mentioned in the following text, each with what it refers to.\n\n{p}",
]
CODE_TASKS = [
    "Rename the variable `total` to `acc` in this Python code and show the whole function.\n\n{p}",
    "Add type hints to this Python code and show the whole code.\n\n{p}",
]
OPEN_CHAT = [
    "What makes a good friend?", "How do airplanes stay in the air?", "Tell me a fun fact about space.",
    "What should I pack for a weekend hiking trip?", "Why is the sky blue?",
    "Give me advice for my first job interview.", "How does a refrigerator keep food cold?",
    "Write a haiku about autumn leaves.",
]


def workloads() -> dict[str, list[str]]:
    grounded = [t.format(p=p) for p in PASSAGES for t in TASKS] + [t.format(p=c) for c in CODE for t in CODE_TASKS]
    return {"input_grounded": grounded, "open_chat": list(OPEN_CHAT)}


def _run(llm: LLM, ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    started = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    return out.outputs[0].token_ids, time.perf_counter() - started


def bench_spec(base: LLM, methods: dict[str, dict[str, Any]], max_tokens: int,
               workload_names: list[str]) -> dict[str, Any]:
    """`methods`: name -> speculative_config. Returns the JSON-ready report."""
    engines = {name: base.with_speculation(cfg) for name, cfg in methods.items()}
    tok = base.get_tokenizer()
    report: dict[str, Any] = {"model": base.model_name, "max_tokens": max_tokens, "batch": 1,
                              "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
                              "methods": methods, "workloads": {}}
    for wname in workload_names:
        prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in workloads()[wname]]
        times = {"plain": 0.0, **{m: 0.0 for m in engines}}
        tokens = dict.fromkeys(times, 0)
        identical = dict.fromkeys(engines, True)
        _run(base, prompts[0], 8)  # warm-up
        for m, llm in engines.items():
            _run(llm, prompts[0], 8)
        before = {m: _counters(llm) for m, llm in engines.items()}
        runs = [("plain", base), *engines.items()]
        for i, ids in enumerate(prompts):
            # the order turns with each prompt: whichever engine ran first after a change of prompt
            # measured faster (a plain engine that never speculated came out 1.16x "plain")
            outs = {}
            for name, llm in runs[i % len(runs):] + runs[:i % len(runs)]:
                outs[name], seconds = _run(llm, ids, max_tokens)
                times[name] += seconds
                tokens[name] += len(outs[name])
            for m in engines:
                identical[m] &= outs[m] == outs["plain"]
        plain_rate = tokens["plain"] / times["plain"]
        result: dict[str, Any] = {"prompts": len(prompts), "plain_tokens_per_s": round(plain_rate, 2), "methods": {}}
        for m, llm in engines.items():
            rate = tokens[m] / times[m]
            result["methods"][m] = {"tokens_per_s": round(rate, 2), "speedup": round(rate / plain_rate, 3),
                                    "identical_to_plain": identical[m],
                                    **_acceptance(before[m], _counters(llm))}
        report["workloads"][wname] = result
    return report


def _counters(llm: LLM) -> tuple[int, int, int]:
    s = llm.engine.spec.stats
    return s.num_verify_steps, s.num_draft_tokens, s.num_accepted_tokens


def _acceptance(before: tuple[int, int, int], after: tuple[int, int, int]) -> dict[str, Any]:
    steps, drafted, accepted = (b - a for a, b in zip(before, after))
    if not steps:
        return {"verify_steps": 0}
    a = accepted / drafted if drafted else 0.0
    k = drafted / steps
    return {"verify_steps": steps, "acceptance_rate": round(a, 3), "mean_drafts_per_step": round(k, 2),
            "mean_accepted_per_step": round(accepted / steps, 3),
            "tokens_per_step": round(1 + accepted / steps, 3),
            "leviathan_predicted_tokens_per_step": round(_leviathan(a, k), 3)}


def _leviathan(a: float, k: float) -> float:
    """(1 - a^(k+1)) / (1 - a) at a fractional k: interpolated between the neighbouring integers."""
    lo = int(k)
    return expected_tokens(a, lo) + (k - lo) * (expected_tokens(a, lo + 1) - expected_tokens(a, lo))
