"""`brisk bench latency`: single-stream time to first token and decode tokens/s.

brisk and (with `--compare hf`) HF transformers run the same prompt ids on the same weights in the
same process, one after the other, so the ratio is measured side by side on one machine state.
`--compare plain` loads the same model without quantization or speculation beside brisk's and
interleaves their runs (the issue targets "int4 decode >= 4x float32" are such ratios).
Each figure is the median of `repeats` runs after one warm-up.
"""

from __future__ import annotations

import platform
import statistics
import time
from typing import Any

import torch

from brisk.engine.llm import LLM
from brisk.errors import UserError
from brisk.loader.load import torch_dtype
from brisk.request import SamplingParams

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _machine(device: str) -> str:
    cpu = platform.processor() or platform.machine()
    return f"{torch.cuda.get_device_name(device)} ({cpu} host)" if device.startswith("cuda") else cpu


def _brisk_run(llm: LLM, ids: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    m = out.metrics
    assert m.first_token_time is not None and m.finish_time is not None
    decode = (new_tokens - 1) / (m.finish_time - m.first_token_time)
    return m.first_token_time - m.arrival_time, decode, out.outputs[0].token_ids


def _hf_run(peer: Any, ids: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    _, ttft = peer.generate([ids], 1)
    tokens, total = peer.generate([ids], new_tokens)
    return ttft, (new_tokens - 1) / max(total - ttft, 1e-9), tokens[0]


def _summary(samples: list[tuple[float, float]]) -> dict[str, float]:
    return {"ttft_s": round(statistics.median(t for t, _ in samples), 4),
            "decode_tok_s": round(statistics.median(r for _, r in samples), 2)}


def _measure(run: Any, target: Any, ids: list[int], new_tokens: int, repeats: int) -> tuple[dict[str, float], list[int]]:
    return _interleaved([(run, target)], ids, new_tokens, repeats)[0]


def _interleaved(runs: list[tuple[Any, Any]], ids: list[int], new_tokens: int,
                 repeats: int) -> list[tuple[dict[str, float], list[int]]]:
    """Each (run, target)'s summary and tokens, their runs interleaved (a, b, a, b, ...) so that a
    noisy neighbour on the machine slows all alike; one warm-up each first (allocator, threads)."""
    for run, target in runs:
        run(target, ids, min(8, new_tokens))
    samples: list[list[tuple[float, float]]] = [[] for _ in runs]
    tokens: list[list[int]] = [[] for _ in runs]
    for _ in range(repeats):
        for i, (run, target) in enumerate(runs):
            ttft, rate, tokens[i] = run(target, ids, new_tokens)
            samples[i].append((ttft, rate))
    return [(_summary(s), t) for s, t in zip(samples, tokens)]


# llama.cpp's AMX backend (compiled in by GGML_NATIVE=ON on a CPU with AMX) segfaults in
# ggml_backend_amx_mul_mat on some Sapphire Rapids machines (ggml-org/llama.cpp#20824; seen on the
# Xeon of 2026-12-05 with every file): a build with the AVX-512 flags and AMX off runs.
LLAMACPP_NO_AMX_BUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON '
                         '-DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON '
                         '-DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" '
                         'pip install --no-cache-dir llama-cpp-python==0.3.36')


def _crash_hint(code: int) -> str:
    """What to do when the peer died of a segfault on a CPU with AMX (its AMX backend's known crash)."""
    from brisk.kernels import CAPS

    if code != -11 or not CAPS.cpu_amx:
        return ""
    return (". This CPU has AMX, whose llama.cpp backend crashes on some machines (ggml-org/llama.cpp#20824): "
            f"rebuild the peer's venv without it: {LLAMACPP_NO_AMX_BUILD}")


class LlamaCppPeer:
    """llama-cpp-python in its own venv (bench/llamacpp_peer.py), one JSON line per run."""

    def __init__(self, python: str, model: str, threads: int, n_ctx: int) -> None:
        import subprocess
        from pathlib import Path

        script = Path(__file__).with_name("llamacpp_peer.py")
        self.proc = subprocess.Popen([python, str(script), model, str(threads), str(n_ctx)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        ready = self._read()
        self.version = ready.get("version")

    def _read(self) -> dict[str, Any]:
        import json

        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"the llama.cpp peer exited (code {code}); see its stderr above" + _crash_hint(code))
        return json.loads(line)  # type: ignore[no-any-return]

    def ask(self, job: dict[str, Any]) -> dict[str, Any]:
        import json

        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _llamacpp_run(peer: LlamaCppPeer, ids: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    out = peer.ask({"op": "latency", "ids": ids, "new_tokens": new_tokens})
    return out["ttft_s"], out["decode_tok_s"], out["tokens"]


def bench_latency(model: str, dtype: str, prompt: str, chat: bool, new_tokens: int, repeats: int,
                  compare: list[str], options: dict[str, Any] | None = None,
                  llamacpp_python: str | None = None) -> dict[str, Any]:
    """`options`: more LLM(...) arguments (quantization, speculative_config, device).
    `llamacpp_python`: the venv python for `--compare llamacpp` (the same .gguf, threads and
    prompt ids; its runs interleaved with brisk's)."""
    device = str((options or {}).get("device", "cpu"))
    if compare and device != "cpu":
        raise UserError(f"--compare runs the peer on the CPU: drop it with --device {device}")
    t0 = time.perf_counter()
    # no prefix caching: every repeat processes its prompt afresh (time to first token is prompt work)
    llm = LLM(model, dtype=dtype, enable_prefix_caching=False, **(options or {}))
    load_s = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    ids = tok.encode_chat([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
    result: dict[str, Any] = {
        "bench": "latency", "model": model, "dtype": dtype, "device": device,
        "quantization": llm.quantization.describe() if llm.quantization else None,
        "speculative_config": (options or {}).get("speculative_config"),
        "prompt_tokens": len(ids), "new_tokens": new_tokens,
        "repeats": repeats, "threads": torch.get_num_threads(), "machine": _machine(device),
    }
    if "llamacpp" in compare:
        if not llamacpp_python:
            raise UserError("--compare llamacpp needs --llamacpp-python VENV/bin/python (a venv with "
                             "llama-cpp-python; env BRISK_LLAMACPP_PYTHON)")
        from brisk.loader.resolve import resolve_model

        path = str(resolve_model(model).path)
        if not path.endswith(".gguf"):
            raise UserError(f"--compare llamacpp runs a .gguf file; {model} is not one")
        peer = LlamaCppPeer(llamacpp_python, path, torch.get_num_threads(), max(2048, len(ids) + new_tokens + 8))
        try:
            (result["brisk"], brisk_tokens), (result["llamacpp"], cpp_tokens) = \
                _interleaved([(_brisk_run, llm), (_llamacpp_run, peer)], ids, new_tokens, repeats)
        finally:
            peer.close()
        result["llamacpp"]["version"] = peer.version
        result["decode_speedup_vs_llamacpp"] = round(result["brisk"]["decode_tok_s"] / result["llamacpp"]["decode_tok_s"], 3)
        result["ttft_ratio_vs_llamacpp"] = round(result["brisk"]["ttft_s"] / result["llamacpp"]["ttft_s"], 3)
        result["same_tokens_as_llamacpp"] = brisk_tokens == cpp_tokens
        result["brisk"]["load_s"] = round(load_s, 2)
        return result
    if "plain" in compare:  # the same weights without -q / speculation, interleaved
        plain = LLM(model, dtype=dtype, device=device, enable_prefix_caching=False)
        (result["brisk"], brisk_tokens), (result["plain"], plain_tokens) = \
            _interleaved([(_brisk_run, llm), (_brisk_run, plain)], ids, new_tokens, repeats)
        del plain
        result["decode_speedup_vs_plain"] = round(result["brisk"]["decode_tok_s"] / result["plain"]["decode_tok_s"], 3)
        result["same_tokens_as_plain"] = brisk_tokens == plain_tokens
    else:
        result["brisk"], brisk_tokens = _measure(_brisk_run, llm, ids, new_tokens, repeats)
    result["brisk"]["load_s"] = round(load_s, 2)
    if "hf" in compare:
        from brisk.bench.peers import HFPeer

        source = llm.model_name
        del llm  # free brisk's weights before loading the peer's copy
        from brisk.loader.resolve import resolve_model

        peer = HFPeer(resolve_model(source), torch_dtype(dtype))
        result["hf"], hf_tokens = _measure(_hf_run, peer, ids, new_tokens, repeats)
        result["decode_speedup_vs_hf"] = round(result["brisk"]["decode_tok_s"] / result["hf"]["decode_tok_s"], 3)
        result["ttft_ratio_vs_hf"] = round(result["brisk"]["ttft_s"] / result["hf"]["ttft_s"], 3)
        result["same_tokens_as_hf"] = brisk_tokens == hf_tokens
    return result
