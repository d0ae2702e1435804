"""Where a CUDA decode step's time goes: a SmolLM2-135M-shaped model with random weights (the timing does not
depend on the values, so no weights need to travel), one engine, batch 1 and batch 32.

    python3 .ci/gpu_profile.py [--device cuda] [--dtype float32|bfloat16] [--weights float|blocks|sparse24] [--eager]
                               [--out DIR]

Decode steps replay CUDA graphs (runtime/decode_graphs.py) unless `--eager`.

`--weights blocks` puts every decoder Linear in GGUF blocks as a Q4_K_M file has them (Q4_K where the
width is a multiple of 256, else Q5_0; random block bytes with moderate scales): what keeping a
file's blocks on a GPU would cost with today's BlockLinear (a dequantize per forward). The loader does
not do that: on CUDA a GGUF file loads dequantized; this row says whether a GPU block kernel would pay.
`sparse24` prunes each to 2:4 (torch's semi-structured tensors on the GPU for a 16-bit model).

Prints, per batch size, decode tokens/s, wall time per step, GPU kernel time per step and kernel launches per
step (from torch.profiler), and the operators that spend the most host time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: brisk need not be installed

from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from brisk.config import CacheConfig, ModelConfig, SchedulerConfig
from brisk.engine.llm_engine import LLMEngine
from brisk.loader.tokenizer import Tokenizer
from brisk.model.llama import LlamaForCausalLM
from brisk.request import SamplingParams

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      rope_theta=100000.0, tie_word_embeddings=True)


def random_blocks(qtype: int, rows: int, cols: int) -> torch.Tensor:
    """uint8 [rows, row bytes] of random GGUF blocks whose fp16 d (the first field of Q4_K and Q5_0
    blocks; Q4_K's dmin next) are small and finite."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    b = torch.randint(0, 256, (rows * cols // block, size), dtype=torch.uint8)
    b[:, 0:4] = (torch.randn(b.shape[0], 2) * 0.001).half().view(torch.uint8)
    return b.reshape(rows, -1)


def swap_linears(model: torch.nn.Module, weights: str, dtype: torch.dtype) -> None:
    """Every decoder Linear as GGUF blocks or 2:4 sparse (`weights`); the embedding / tied head stay."""
    from gguf import GGMLQuantizationType as T

    from brisk.model.layers import Linear
    from brisk.quant.gguf import BlockLinear
    from brisk.quant.sparse24 import Sparse24Linear

    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear):
            continue
        if weights == "blocks":
            qtype = int(T.Q4_K if module.in_features % 256 == 0 else T.Q5_0)
            rows = sum(module.output_sizes)
            new: torch.nn.Module = BlockLinear([(qtype, random_blocks(qtype, rows, module.in_features))],
                                               module.in_features, None, module.output_sizes, dtype)
        else:
            new = Sparse24Linear.from_linear(module, None)
            new.dtype = dtype
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, new)


def build_engine(device: str, dtype: torch.dtype, weights: str = "float", eager: bool = False) -> LLMEngine:
    torch.manual_seed(0)
    model = LlamaForCausalLM(SMOLLM2, dtype=torch.float32, max_positions=2048)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    if weights != "float":
        swap_linears(model, weights, dtype)
    model = model.to(device=device, dtype=dtype).eval()
    backend = Backend(models.WordLevel({"w0": 0, "w1": 1}, unk_token="w1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = Tokenizer(backend, bos_token_id=None, eos_token_id=0, add_bos=False, chat_template=None)
    return LLMEngine(model, tok, CacheConfig(block_size=16, num_kv_blocks=1024),
                     SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=2048),
                     eager=eager)  # what LLM(enforce_eager=...) passes: no CUDA graphs either


def decode_steps(engine: LLMEngine, batch: int, new_tokens: int) -> list[float]:
    """Per-step wall seconds of the steps after every prompt is in (pure decode)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}-{time.monotonic_ns()}", torch.randint(2, 49152, (46,), generator=g).tolist(),
                           params)
    engine.step()  # the prompts (one step: 46 * batch <= 2048 tokens)
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def profile(engine: LLMEngine, batch: int, steps: int, device: str) -> dict[str, object]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{batch}-{i}", list(range(2, 48)), params)
    engine.step()
    with torch_profile(activities=acts) as prof:
        while engine.has_unfinished_requests():
            engine.step()
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    graph_launches = sum(e.count for e in events if e.key == "cudaGraphLaunch")
    syncs = {e.key: e.count for e in events if "Synchronize" in e.key or e.key in ("aten::item", "cudaMemcpyAsync")}
    table = events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50)
    return {"gpu_kernel_ms_per_step": round(kernel_us / 1000 / steps, 3), "launches_per_step": launches / steps,
            "graph_launches_per_step": graph_launches / steps,
            "syncs_per_step": {k: v / steps for k, v in syncs.items()}, "table": table}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--weights", default="float", choices=["float", "blocks", "sparse24"])
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs: every decode step launches its kernels")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    engine = build_engine(args.device, getattr(torch, args.dtype), args.weights, args.eager)
    mode = "eager" if args.eager else "graphs"
    for batch in (int(b) for b in args.batches.split(",")):
        decode_steps(engine, batch, 8)  # warm-up
        times = sorted(decode_steps(engine, batch, 64))
        step = times[len(times) // 2]
        prof = profile(engine, batch, 16, args.device)
        table = prof.pop("table")
        (args.out / f"profile-{args.weights}-{args.dtype}-{mode}-b{batch}.txt").write_text(str(table))
        graphs = getattr(engine.runner, "graphs", None)
        print(json.dumps({"device": args.device, "dtype": args.dtype, "weights": args.weights, "mode": mode,
                          "graphs_disabled": graphs.disabled if graphs is not None else None, "batch": batch,
                          "step_ms_p50": round(step * 1000, 2), "decode_tok_s": round(batch / step, 1), **prof}),
              flush=True)
        print(table, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
