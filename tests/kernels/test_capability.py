"""The kernel capability object: BRISK_CPU_ISA lowers the instruction set every C++ kernel uses,
refuses what the CPU cannot do, and the lowered paths give the native path's tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from brisk import kernels
from brisk.kernels.capability import (
    AMX_ENV,
    AVX_VNNI_ENV,
    ISA_ENV,
    LEVELS,
    requested_amx,
    requested_avx_vnni,
    requested_float_tiles,
    requested_isa,
)

ROOT = Path(__file__).resolve().parents[2]
LOWER = [level for level in LEVELS if LEVELS.index(level) < LEVELS.index(kernels.CAPS.cpu_isa)]


def _run(code: str, isa: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != ISA_ENV}
    if isa is not None:
        env[ISA_ENV] = isa
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True, check=False,
                          timeout=300)


def test_avx_vnni_is_on_where_the_cpu_has_it_unless_turned_off() -> None:
    assert requested_avx_vnni(True, {}) is True and requested_avx_vnni(False, {}) is False
    assert requested_avx_vnni(True, {AVX_VNNI_ENV: "0"}) is False and requested_avx_vnni(True, {AVX_VNNI_ENV: "1"})
    assert requested_avx_vnni(False, {AVX_VNNI_ENV: "0"}) is False
    with pytest.raises(ValueError, match=r"BRISK_AVX_VNNI=1 but this CPU has no AVX-VNNI; unset it"):
        requested_avx_vnni(False, {AVX_VNNI_ENV: "1"})
    with pytest.raises(ValueError, match=r"BRISK_AVX_VNNI='yes': use 0 \(maddubs \+ madd\) or 1 \(AVX-VNNI\)"):
        requested_avx_vnni(True, {AVX_VNNI_ENV: "yes"})
    if kernels.CAPS.built:  # what the extension reports agrees with the capability object
        want = requested_avx_vnni(bool(kernels._C.cpu_avx_vnni())) and kernels.CAPS.isa == "avx2"
        assert kernels.CAPS.avx_vnni == want


def test_amx_tiles_are_used_where_usable_unless_turned_off() -> None:
    assert requested_amx(True, {}) is True and requested_amx(False, {}) is False
    assert requested_amx(True, {AMX_ENV: "0"}) is False and requested_amx(True, {AMX_ENV: "1"}) is True
    with pytest.raises(ValueError, match=r"BRISK_AMX=1 but AMX-BF16 is not usable here \(CPU, OS or permission\)"):
        requested_amx(False, {AMX_ENV: "1"})
    with pytest.raises(ValueError, match=r"BRISK_AMX='on': use 0 \(integer prompt kernels\) or 1"):
        requested_amx(True, {AMX_ENV: "on"})
    if not kernels.CAPS.built:
        return
    has = bool(kernels._C.cpu_amx_bf16())
    assert kernels.CAPS.amx == (requested_amx(has) and kernels.CAPS.isa == "avx512")
    if has and kernels.CAPS.cpu_isa == "avx512":  # a lower level, or BRISK_AMX=0, keeps the integer kernels
        code = "from brisk import kernels; print(kernels.CAPS.amx, kernels.bf16_tiles_supported())"
        env = {k: v for k, v in os.environ.items() if k not in (ISA_ENV, AMX_ENV)}
        for extra, want in (({}, "True True"), ({ISA_ENV: "avx2"}, "False False"), ({AMX_ENV: "0"}, "False False")):
            out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, **extra}, capture_output=True,
                                 text=True, check=True, timeout=300).stdout.strip().splitlines()[-1]
            assert out == want, extra


def test_float_prompt_tiles_on_intel_cpus_unless_told() -> None:
    assert requested_float_tiles("intel", {}) is True and requested_float_tiles("amd", {}) is False
    assert requested_float_tiles("other", {}) is False and requested_float_tiles("intel", {"BRISK_FLOAT_PROMPT_TILES": "auto"})
    assert requested_float_tiles("amd", {"BRISK_FLOAT_PROMPT_TILES": "1"}) is True
    assert requested_float_tiles("intel", {"BRISK_FLOAT_PROMPT_TILES": "0"}) is False
    with pytest.raises(ValueError, match="BRISK_FLOAT_PROMPT_TILES='yes': use 1"):
        requested_float_tiles("intel", {"BRISK_FLOAT_PROMPT_TILES": "yes"})
    caps = kernels.CAPS
    assert caps.vendor in ("intel", "amd", "other")
    maker = ""
    if caps.built and Path("/proc/cpuinfo").is_file():
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            maker = next((line.split(":")[1].strip() for line in f if line.startswith("vendor_id")), "")
    if maker in ("GenuineIntel", "AuthenticAMD"):  # other makers' names differ between cpuid and GCC
        assert caps.vendor == {"GenuineIntel": "intel", "AuthenticAMD": "amd"}[maker]
    assert kernels.float_prompt_tiles() == (caps.float_tiles and kernels.block_dequantize_supported())
    if caps.built and caps.cpu_isa != "scalar":
        flip = "0" if caps.float_tiles else "1"
        code = "from brisk import kernels; print(kernels.float_prompt_tiles())"
        r = _run(code, None)
        env_run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False,
                                 timeout=300, env={**os.environ, "BRISK_FLOAT_PROMPT_TILES": flip})
        assert r.returncode == 0 and env_run.returncode == 0, r.stderr + env_run.stderr
        assert r.stdout.strip() == str(caps.float_tiles) and env_run.stdout.strip() == str(flip == "1")
        r = _run(code, "scalar")  # no block_dequantize at the scalar level: block_kgemm
        assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_requested_isa_never_exceeds_the_cpu() -> None:
    assert requested_isa("avx512", {}) == "avx512"
    assert requested_isa("avx512", {ISA_ENV: "AVX2"}) == "avx2"
    assert requested_isa("avx2", {ISA_ENV: "native"}) == "avx2"
    assert requested_isa("avx2", {ISA_ENV: "scalar"}) == "scalar"
    with pytest.raises(ValueError, match=r"BRISK_CPU_ISA=avx512 asks for more than this CPU offers \(avx2\); use "
                                         r"scalar or avx2"):
        requested_isa("avx2", {ISA_ENV: "avx512"})
    with pytest.raises(ValueError, match=r"'sse9' is not an instruction set brisk has: use one of scalar, avx2, "
                                         r"avx512"):
        requested_isa("avx512", {ISA_ENV: "sse9"})


def test_the_native_isa_is_the_cpus() -> None:
    if not kernels.CAPS.built:
        pytest.skip("the C++ kernels are not built")
    assert kernels.CAPS.isa == kernels.CAPS.cpu_isa == kernels.ISA
    assert kernels.CAPS.has("gemv") and not kernels.CAPS.has("no_such_kernel")


PROBE = """
import json
from brisk import kernels
from brisk.runtime.decode_plan import plan_supported
c = kernels.CAPS
print(json.dumps({"isa": c.isa, "cpu": c.cpu_isa, "ext": kernels._C.isa(), "vnni": c.vnni,
                  "small_gemm_rows": kernels.SMALL_GEMM_MAX_ROWS, "plan": plan_supported(),
                  "int8_dot": kernels.have_int8_dot(), "describe": c.describe()}))
"""


@pytest.mark.parametrize("isa", LOWER)
def test_a_lowered_isa_reaches_every_kernel(isa: str) -> None:
    if not kernels.CAPS.built:
        pytest.skip("the C++ kernels are not built")
    r = _run(PROBE, isa)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert (got["isa"], got["ext"], got["cpu"]) == (isa, isa, kernels.CAPS.cpu_isa)
    # the small GEMM and the decode plan run at every level; the AVX512-VNNI kernels stand aside, W8A8's
    # integer kernel runs its AVX2 form (torch._int_mm at the portable level)
    assert got["small_gemm_rows"] == 32 and got["plan"] and not got["vnni"]
    assert got["int8_dot"] == (isa == "avx2")
    assert f"lowered by {ISA_ENV}" in got["describe"]


def test_a_bad_isa_stops_start_up_with_the_reason() -> None:
    r = _run("import brisk.kernels", "avx1024")
    assert r.returncode != 0 and "BRISK_CPU_ISA='avx1024' is not an instruction set brisk has" in r.stderr


GREEDY = """
import json, sys
from brisk import LLM, SamplingParams
q = sys.argv[1]
llm = LLM("smollm2-135m", max_model_len=512, num_kv_blocks=64, quantization=None if q == "float" else q,
          dequantize=q == "float")
prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
print(json.dumps([o.outputs[0].token_ids for o in outs]))
"""


# The portable level's `-q gguf` run (~24 s on an AVX2-only CPU) is a slow check: its group and block
# kernels are compared bit for bit with the native ones in-process (test_isa_paths.py, test_blocks.py).
@pytest.mark.parametrize("isa,quantization", [
    pytest.param(i, q, marks=pytest.mark.slow) if (i, q) == ("scalar", "gguf") else (i, q)
    for i in LOWER for q in ("float", "gguf")])
def test_lowered_paths_give_the_native_greedy_tokens(isa: str, quantization: str, gguf_path: Path) -> None:
    """The real model, batched, through the paths an AVX2 or a portable build takes (the file
    dequantized to float32: 8-lane GEMMs, a float sum order of their own; `-q gguf`: its 4-bit
    weights against int16 activations, bit-identical on every path): the same 24 greedy tokens as
    the native path."""
    native = _run(GREEDY, None, quantization)
    lowered = _run(GREEDY, isa, quantization)
    assert native.returncode == 0 and lowered.returncode == 0, native.stderr + lowered.stderr
    assert json.loads(lowered.stdout) == json.loads(native.stdout)


EXACTNESS = ["tests/model/test_kernels.py", "tests/model/test_reference.py::test_logits_match_hf_on_varied_prompts",
             "tests/runtime/test_decode_plan.py", "tests/quant/test_int8.py", "tests/quant/test_int4.py"]
# The portable path is ~4x slower: there the decode plan runs once per quantization (kernel-level
# cross-ISA checks are in test_isa_paths.py, in-process).
EXACTNESS_SKIP = {"avx2": "thread_count", "scalar": "thread_count or drops_the_plan or config or varied_prompts"}


# The portable level's run (~55 s) is a slow check: its greedy tokens are already compared with the
# native ones below (test_lowered_paths_give_the_native_greedy_tokens) and its kernels in-process.
@pytest.mark.parametrize("isa", [pytest.param(i, marks=pytest.mark.slow) if i == "scalar" else i for i in LOWER])
def test_exactness_tests_pass_under_a_lowered_isa(isa: str, gguf_path: Path) -> None:
    """The kernel tests (each kernel against its reference), the real model's logits against HF
    transformers, the decode plan against the module path and the int8 and 4-bit Linears, run again
    with every kernel at `isa` (~60 s each)."""
    env = {**os.environ, ISA_ENV: isa}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *EXACTNESS,
                        "-k", f"not ({EXACTNESS_SKIP[isa]})"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout.splitlines()[-1]


def _setup_py(block_torch: bool, allow: bool) -> subprocess.CompletedProcess[str]:
    """setup.py as an isolated build runs it (torch not importable when `block_torch`)."""
    code = ("import runpy, sys\n" + ("sys.modules['torch'] = None\n" if block_torch else "")
            + "sys.argv = ['setup.py', '--name']\nrunpy.run_path('setup.py', run_name='__main__')\n")
    env = {k: v for k, v in os.environ.items() if k != "BRISK_ALLOW_NO_KERNELS"}
    if allow:
        env["BRISK_ALLOW_NO_KERNELS"] = "1"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_a_build_without_torch_stops_and_says_what_to_run() -> None:
    r = _setup_py(block_torch=True, allow=False)
    assert r.returncode != 0
    assert "torch is not importable in this build environment" in r.stderr
    assert "pip install --no-build-isolation -e ." in r.stderr
    r = _setup_py(block_torch=True, allow=True)  # asked for: the pure-Python package, said out loud
    assert r.returncode == 0 and "installing without the C++ kernels" in r.stderr and "brisk-llm" in r.stdout
    assert _setup_py(block_torch=False, allow=False).returncode == 0


def test_missing_kernels_are_reported_once_on_stderr() -> None:
    code = ("import sys; sys.modules['brisk._C'] = None\nfrom brisk import kernels\n"
            "print(kernels.CAPS.built, kernels.HAVE_CPU_GEMV, kernels.SMALL_GEMM_MAX_ROWS)")
    r = _run(code, None)
    assert r.returncode == 0 and r.stdout.split() == ["False", "False", "1"]
    assert r.stderr.count("the C++ kernels are not available") == 1 and "--no-build-isolation" in r.stderr


def test_brisk_env_reports_the_isa_and_kernels() -> None:
    r = subprocess.run([sys.executable, "-m", "brisk.cli", "env", "--json", "--no-bandwidth"], cwd=ROOT,
                       env={**os.environ, ISA_ENV: "scalar"}, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    env = json.loads(r.stdout)
    assert env["isa_in_use"] == "scalar" and env["isa_env"] == "scalar" and env["isa_cpu"] == kernels.CAPS.cpu_isa
    assert env["kernels_built"] == kernels.CAPS.built and env["torch_threads"] >= 1 and env["torch"]
    assert env["avx_vnni_kernels"] is False  # the scalar level has none
    assert env["amx_prompt_tiles"] is False and env["amx_bf16_cpu"] == kernels.CAPS.cpu_amx  # below avx512: off
    assert env["kquant_prompt"] == "int8 block_kgemm"  # the scalar level: neither AMX nor float tiles
    assert env["cpu_vendor"] == kernels.CAPS.vendor
    if kernels.CAPS.built and sys.platform.startswith("linux"):
        from brisk.runtime.virtual_kv import residency_readable

        assert env["vmem_residency"].startswith("readable" if residency_readable() else "unreadable")
    if kernels.CAPS.built:
        assert "gemv" in env["kernels"] and "paged_attention" in env["kernels"]
