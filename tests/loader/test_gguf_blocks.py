"""Quantized GGUF files run from their blocks: files written by llama.cpp's own quantizer (the
`kquant_file` fixture) load with every block-quantized Linear native, in about the file's memory,
their blocks decode exactly as the gguf package decodes them, the decode plan gives the module
path's numbers, and a batch gives each request the tokens it gets alone."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf import quants as gq

from brisk import LLM, SamplingParams
from brisk.loader.dequant import dequantize
from brisk.runtime.decode_plan import plan_supported
from brisk.model.layers import Linear
from brisk.quant.gguf import BlockLinear
from brisk.quant.grouped import GroupLinear

MIXES = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "IQ4_XS"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "Water boils at"]


@pytest.mark.parametrize("mix", MIXES)
def test_every_tensor_decodes_as_the_gguf_package_does(mix: str, kquant_file: Callable[[str], Path]) -> None:
    reader = GGUFReader(str(kquant_file(mix)))
    seen = set()
    for t in reader.tensors:
        kind = GGMLQuantizationType(t.tensor_type)
        if kind in seen and kind != GGMLQuantizationType.F32:
            continue  # one real tensor per type keeps this quick
        seen.add(kind)
        rows = t.data if len(t.shape) == 1 else t.data[:256]
        shape = (int(t.shape[0]),) if len(t.shape) == 1 else (rows.shape[0], int(t.shape[0]))
        ours = dequantize(rows, kind, shape)
        ref = torch.from_numpy(np.array(gq.dequantize(rows, kind), dtype=np.float32)).reshape(shape)
        assert torch.equal(ours, ref), f"{mix} {t.name} {kind.name}"
    assert len(seen) >= 3


@pytest.mark.parametrize("mix", MIXES)
def test_every_quantized_linear_runs_from_its_blocks(mix: str, kquant_file: Callable[[str], Path]) -> None:
    path = kquant_file(mix)
    llm = LLM(str(path), max_model_len=256, num_kv_blocks=32)
    assert llm.quantization is not None and llm.quantization.method == "gguf"
    modules = list(llm.model.modules())
    assert not any(type(m) is Linear for m in modules), "a float Linear was kept"
    assert any(isinstance(m, BlockLinear) for m in modules)
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    # a near-tie decides the 3-bit mixes' greedy text: Q3_K_M's floats say "Paris", its int8-activation
    # blocks "the capital of the United States" (perplexity, within 0.3%, is the measure: BENCHMARKS.md)
    if mix in ("Q4_K_M", "Q6_K"):
        assert "Paris" in out[0].outputs[0].text


def test_blocks_are_the_file_bytes_and_the_head_is_native(kquant_file: Callable[[str], Path]) -> None:
    llm = LLM(str(kquant_file("Q4_K_M")), max_model_len=256, num_kv_blocks=32)
    down = llm.model.layers[0].mlp.down_proj
    assert isinstance(down, BlockLinear) and down.tiled_parts == [True]  # Q4_K or Q6_K, four rows a tile
    file_bytes = np.memmap(kquant_file("Q4_K_M"), dtype=np.uint8, mode="r").tobytes()
    assert file_bytes.find(down.file_blocks()[0][1][0].numpy().tobytes()) > 0, "untiled, the file's rows"
    qkvs = [layer.self_attn.qkv_proj for layer in llm.model.layers]
    assert all(isinstance(qkv, BlockLinear) and len(qkv.types) == 3 for qkv in qkvs)  # q | k | v, each its own type
    # a part with no tiles (Q8_0 v) is the file's bytes where they lie
    v = next(qkv.blocks[2] for qkv in qkvs if qkv.types[2] == int(GGMLQuantizationType.Q8_0))
    assert file_bytes.find(v[0].numpy().tobytes()) > 0
    assert isinstance(llm.model.lm_head, GroupLinear | BlockLinear)  # token_embd (Q8_0) is the tied head


@pytest.mark.skipif(not plan_supported(), reason="needs the AVX-512 kernels")
@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M", "Q3_K_M", "IQ4_XS"])  # tiles of Q5_0, Q5_1, Q4_0, IQ4_NL
def test_decode_plan_gives_the_module_path_numbers(mix: str, kquant_file: Callable[[str], Path]) -> None:
    llm = LLM(str(kquant_file(mix)), max_model_len=256, num_kv_blocks=64)
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2)

    def run(plan: bool) -> list:
        llm.engine.runner.plans.enabled = plan
        outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [(s.logprob, s.top) for s in o.outputs[0].logprobs]) for o in outs]

    with_plan = run(True)
    assert llm.engine.runner.plans.current, "the plan should serve a block-quantized model"
    assert with_plan == run(False)


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS"])
def test_batched_greedy_equals_one_at_a_time(mix: str, kquant_file: Callable[[str], Path]) -> None:
    llm = LLM(str(kquant_file(mix)), max_model_len=256, num_kv_blocks=128)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    alone = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert batched == alone


# VmHWM, this process image's peak RSS (getrusage's ru_maxrss survives exec: a child of a large
# pytest process would report the parent's peak)
_PEAK = """
def peak():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
"""
_RSS = _PEAK + """
import json, sys
from brisk import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=256, num_kv_blocks=16, pack_weights=False)
llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
print(json.dumps({"max_rss": peak()}))
"""
_BASE = _PEAK + """
import json
import torch, brisk.engine.llm
print(json.dumps({"max_rss": peak()}))
"""
_TOKENIZER = _PEAK + """
import json, sys
from pathlib import Path
import torch, brisk.engine.llm
from brisk.loader.gguf_loader import open_gguf
from brisk.loader.tokenizer import Tokenizer
Tokenizer.from_gguf_metadata(open_gguf(Path(sys.argv[1])).metadata)
print(json.dumps({"max_rss": peak()}))
"""


def _max_rss(script: str, *args: str) -> int:
    out = subprocess.run([sys.executable, "-c", script, *args], check=True, capture_output=True, text=True).stdout
    return int(json.loads(out.strip().splitlines()[-1])["max_rss"])


def check_peak_memory(path: Path) -> None:
    """Subprocesses measure their own peak RSS: above what torch and brisk take by themselves,
    loading and running the file costs under 1.3x its size plus what its tokenizer alone costs
    (built from the file's metadata: ~40 MiB for a 49k vocabulary, ~210 for Gemma's 262k; the KV
    cache here is ~1 MB). A copy a module keeps is made a chunk at a time with the file's pages
    let go behind it (quant/gguf.py COPY_CHUNK_BYTES), so no tensor counts twice."""
    with open("/proc/self/status") as f:
        if not any(line.startswith("VmHWM") for line in f):
            pytest.skip("this system's /proc/self/status has no VmHWM (as under gVisor): peak memory cannot be read")
    base = _max_rss(_BASE)
    tokenizer = _max_rss(_TOKENIZER, str(path)) - base
    used = _max_rss(_RSS, str(path)) - base
    size = path.stat().st_size
    assert used < 1.3 * size + tokenizer, (f"{used / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB file and a "
                                           f"{tokenizer / 2**20:.0f} MiB tokenizer")


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q3_K_M", "Q6_K"])
def test_peak_memory_is_about_the_file(mix: str, kquant_file: Callable[[str], Path]) -> None:
    check_peak_memory(kquant_file(mix))  # Q6_K's Q8_0 layers (GroupLinear copies): 1.37x before the chunks


def test_a_synthetic_model_of_any_width_loads_and_quantizes_to_k_quants(
        tmp_path: Path, gguf_path: Path, kquant_file: Callable[[str], Path]) -> None:
    """write_synthetic: a Llama of a chosen shape (widths multiples of 256, as real 1-8B models) with the
    default model's tokenizer. brisk reads its shape from the metadata; llama.cpp's Q4_K_M of it has
    every Linear in a K-quant, each run from four-row tiles, the decode plan giving the module path's
    numbers."""
    import os
    import subprocess

    from brisk import kernels
    from brisk.loader.gguf_write import write_synthetic

    f32 = tmp_path / "syn-f32.gguf"
    write_synthetic(gguf_path, f32, hidden=512, intermediate=768, layers=2, heads=4, kv_heads=2, head_dim=128)
    llm = LLM(str(f32), max_model_len=128, num_kv_blocks=16)
    cfg = llm.model.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (512, 768, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 128)
    q4km = tmp_path / "syn-Q4_K_M.gguf"
    peer = Path(__file__).resolve().parents[2] / "brisk" / "bench" / "llamacpp_peer.py"
    subprocess.run([os.environ["BRISK_LLAMACPP_PYTHON"], str(peer), "quantize", str(f32), str(q4km), "15"],
                   check=True, capture_output=True)
    llm = LLM(str(q4km), max_model_len=128, num_kv_blocks=16)
    blocks = [m for m in llm.model.modules() if isinstance(m, BlockLinear)]
    types = {t & ~kernels.TILED for m in blocks for t in m.types}
    assert types <= {int(GGMLQuantizationType.Q4_K), int(GGMLQuantizationType.Q6_K)} and len(types) == 2
    assert all(all(m.tiled_parts) for m in blocks), "every K-quant part runs from tiles"
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True)

    def run(plan: bool) -> list:
        llm.engine.runner.plans.enabled = plan
        out = llm.generate(PROMPTS[:2], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [s.logprob for s in o.outputs[0].logprobs]) for o in out]

    with_plan = run(True)
    assert llm.engine.runner.plans.current or not plan_supported()
    assert with_plan == run(False)
