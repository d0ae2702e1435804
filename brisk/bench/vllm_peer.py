"""Run a throughput job on vLLM, in vLLM's own Python environment.

vLLM pins its own torch and many packages, so it lives in a separate venv; `brisk bench
throughput --compare vllm --vllm-python VENV/bin/python` runs this file there as a script
(it imports nothing from brisk). The job is a JSON file: model directory, dtype, prompt token
ids, output lengths; the result is one JSON line on stdout, timed exactly like brisk's run.

    python vllm_peer.py JOB.json
"""

from __future__ import annotations

import json
import sys
import time


def main(job_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(job_path) as f:
        job = json.load(f)
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0,
              enable_prefix_caching=job.get("enable_prefix_caching", True))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in job["output_lens"]]
    warm = [TokensPrompt(prompt_token_ids=p[:16]) for p in job["prompts"][:2]]
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p in job["prompts"])
    import vllm

    print(json.dumps({
        "version": vllm.__version__, "elapsed_s": round(elapsed, 2),
        "requests_per_s": round(len(outs) / elapsed, 3),
        "output_tokens_per_s": round(generated / elapsed, 2),
        "total_tokens_per_s": round((generated + prompt_tokens) / elapsed, 2),
        "first_output_token_ids": [list(o.outputs[0].token_ids[:8]) for o in outs[:4]],
    }))


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this module
    main(sys.argv[1])
