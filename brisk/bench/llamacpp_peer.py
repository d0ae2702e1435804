"""Run llama.cpp (llama-cpp-python) on a GGUF file, in its own Python environment.

llama-cpp-python is built per machine (`CMAKE_ARGS="-DGGML_NATIVE=ON" pip install
llama-cpp-python==0.3.36`), so it lives in a separate venv; `brisk bench latency --compare llamacpp
--llamacpp-python VENV/bin/python` starts this file there as a script (it imports nothing from
brisk) and talks to it in JSON lines, so its runs interleave with brisk's one by one:

    python llamacpp_peer.py MODEL.gguf THREADS N_CTX
    > {"op": "latency", "ids": [...], "new_tokens": 64}
    < {"ttft_s": ..., "decode_tok_s": ..., "tokens": [...]}
    > {"op": "throughput", "prompts": [[...], ...], "output_lens": [...]}
    < {"elapsed_s": ..., "output_tokens_per_s": ..., "mode": "sequential"}
    > {"op": "quantize", "src": "F32.gguf", "dst": "OUT.gguf", "ftype": 15}

Greedy decoding (argmax: top_k 1), the same prompt ids as brisk's, no prompt cache between runs.
The binding's high-level API runs one sequence at a time, so throughput is sequential: said in
the result ("mode").
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def _generate(llm: Any, ids: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    llm.reset()
    start = time.perf_counter()
    first = 0.0
    tokens: list[int] = []
    for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if not tokens:
            first = time.perf_counter()
        tokens.append(int(tok))
        if len(tokens) == new_tokens:
            break
    end = time.perf_counter()
    decode = (len(tokens) - 1) / max(end - first, 1e-9)
    return first - start, decode, tokens


def serve(model: str, threads: int, n_ctx: int) -> None:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512,
                          seed=0, verbose=False, logits_all=False)
    print(json.dumps({"ready": True, "version": llama_cpp.__version__}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        if job["op"] == "latency":
            ttft, decode, tokens = _generate(llm, job["ids"], job["new_tokens"])
            out: dict[str, Any] = {"ttft_s": ttft, "decode_tok_s": decode, "tokens": tokens}
        elif job["op"] == "throughput":
            start = time.perf_counter()
            generated = 0
            first_ids = []
            for ids, n in zip(job["prompts"], job["output_lens"]):
                tokens = _generate(llm, ids, n)[2]
                generated += len(tokens)
                first_ids.append(tokens[:8])
            elapsed = time.perf_counter() - start
            out = {"elapsed_s": round(elapsed, 2), "output_tokens_per_s": round(generated / elapsed, 2),
                   "mode": "sequential", "first_output_token_ids": first_ids[:4]}
        else:
            out = {"error": f"unknown op {job['op']!r}"}
        print(json.dumps(out), flush=True)


def quantize(src: str, dst: str, ftype: int, threads: int) -> int:
    """llama.cpp's quantizer: `src` (an F32/F16 GGUF) written as llama_ftype `ftype` (15 Q4_K_M, ...)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    return int(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params))


if __name__ == "__main__":
    if sys.argv[1] == "quantize":
        sys.exit(quantize(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]) if len(sys.argv) > 5 else 2))
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
