"""Argument groups shared by `brisk` subcommands (cli.py, cli_bench.py) and their kwargs for LLM(...)."""

from __future__ import annotations

import argparse

from brisk.config import KV_LAYOUTS, CacheConfig, ParallelConfig, SchedulerConfig
from brisk.loader.resolve import BUILTIN_MODELS, DEFAULT_MODEL

# The methods are checked by brisk.config.QuantConfig before any model loads (importing quant here
# would pull torch into every `brisk --help`); this line only describes them.
QUANT_HELP = ("int8: weight-only per output channel; int4: weight-only, groups of group_size (default 64; 32 on a "
              "Q4_0 / Q4_1 .gguf, whose grid it keeps exactly), GPTQ-rounded on calibration text; "
              "w8a8: int8 weights and per-token int8 activations, "
              "SmoothQuant from calibration text; ternary: BitNet b1.58 absmean {-1,0,1} x scale, 2-bit "
              "(destroys a model not trained for it); gguf: a .gguf file's own blocks as stored, the default for quantized .gguf files")
QUANT_CONFIG_HELP = ('options as JSON: \'{"group_size": 64}\' (int4), \'{"calibration": "text.txt", '
                     '"calibration_tokens": 4096}\' (int4: GPTQ, w8a8: SmoothQuant; "calibration" defaults to '
                     '"self", the model\'s own answers to built-in prompts, calibrated once and cached in '
                     '~/.cache/brisk; "none": round-to-nearest), \'{"activations": "int8"}\' '
                     '(int4, gguf: what the group-quantized weights meet in integer dot products: int16 activations '
                     '(the default, no measurable quality cost), int8 (a small quality cost) or float (slower))')


def add_quant(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--quantization", "-q", default=None, help=f"{what} ({QUANT_HELP})")
    p.add_argument("--quant-config", default=None, help=QUANT_CONFIG_HELP)
    p.add_argument("--dequantize", action="store_true",
                   help="turn a quantized .gguf file's weights into floats at load instead of running its blocks "
                        "(the exactness reference; several times the memory, slower)")
    add_pruning(p)  # a load-time transform like quantization: every command that quantizes can prune


PRUNING_HELP = ('prune at load, as JSON: \'{"method": "structured", "ratio": 0.25, "calibration": "text.txt"}\' '
                '(whole KV groups of heads and MLP channels, FLAP scores; "multiple": MLP widths kept in multiples of '
                'it, default 64; "bias_compensation": default true) or \'{"method": "layers", "ratio": 0.2, '
                '"calibration": "text.txt"}\' (whole layers, ShortGPT block influence); "calibration_tokens" '
                '(default 8192). `brisk prune` writes the same model as a directory. Or \'{"method": "probe", '
                '"ratio": 0.4, "calibration": "text.txt"}\': Probe Pruning, heads and channels decided per batch of '
                'prompts from a probe of it ("probe_tokens" 0.5, "probe_sequences" 0.05, "dense_layers" 3; not '
                'with serve)')


def add_pruning(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pruning", default=None, metavar="JSON", help=PRUNING_HELP)


def add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"built-in name ({', '.join(BUILTIN_MODELS)}), .gguf file or HF directory "
                        f"(default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype (default float32)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context window to serve, in tokens (default: the model's own)")


def add_engine(p: argparse.ArgumentParser) -> None:
    sched, cache = SchedulerConfig, CacheConfig  # every default is defined once, in config.py
    p.add_argument("--max-num-batched-tokens", type=int, default=sched.max_num_batched_tokens,
                   help=f"tokens per step (default {sched.max_num_batched_tokens})")
    p.add_argument("--max-num-seqs", type=int, default=sched.max_num_seqs,
                   help=f"sequences per step (default {sched.max_num_seqs})")
    p.add_argument("--block-size", type=int, default=cache.block_size,
                   help=f"tokens per KV block (default {cache.block_size})")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (default: from --kv-cache-memory-gib)")
    p.add_argument("--kv-cache-memory-gib", type=float, default=cache.kv_cache_memory_gib,
                   help=f"KV cache size (default {cache.kv_cache_memory_gib:g} GiB)")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--kv-layout", choices=KV_LAYOUTS, default=cache.kv_layout,
                   help="paged: a block pool allocated at start-up (default); virtual: a contiguous row of reserved "
                        "address space per sequence, physical memory committed as tokens arrive (CPU on Linux, CUDA)")
    p.add_argument("--kv-huge-pages", action="store_true",
                   help="virtual KV layout: back the rows with 2 MB transparent huge pages")
    p.add_argument("--no-chunked-prefill", action="store_true", help="disable chunked prefill")
    add_quant(p, "quantize the model's linear layers at load")
    add_spec(p)
    p.add_argument("--no-pack-weights", action="store_true",
                   help="do not keep oneDNN-packed weight copies (saves memory as large as the weights; "
                        "slower prefill and batched decode)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step through the Python modules, without the C++ decode plan or (CUDA) CUDA "
                        "graphs (same numbers, slower decode; for debugging)")
    p.add_argument("--max-decode-slowdown", type=float, default=None,
                   help="size prompt chunks so a step with running decodes takes at most this many times "
                        "a decode-only step (e.g. 1.5; learned from step times; default: token budget only)")
    add_parallel(p)


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu; parallel ranks take cuda:LOCAL_RANK)")


def add_parallel(p: argparse.ArgumentParser) -> None:
    add_device(p)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split every layer over T processes (attention heads by KV group, MLP, vocabulary; default 1)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="split the layers into P stages, one process group each (default 1); T x P processes "
                        "are spawned here, or started by torchrun across machines (see README)")
    p.add_argument("--parallel-timeout", type=float, default=ParallelConfig.timeout_s,
                   help="seconds a parallel worker may stay silent in a step before it is reported hung "
                        f"(default {ParallelConfig.timeout_s:g})")


def parallel_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return {"device": args.device, "tensor_parallel_size": args.tensor_parallel_size,
            "pipeline_parallel_size": args.pipeline_parallel_size, "parallel_timeout_s": args.parallel_timeout}


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return {"max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
            "block_size": args.block_size, "num_kv_blocks": args.num_kv_blocks,
            "kv_cache_memory_gib": args.kv_cache_memory_gib, "max_model_len": args.max_model_len,
            "enable_prefix_caching": not args.no_prefix_caching,
            "kv_layout": args.kv_layout, "kv_huge_pages": args.kv_huge_pages,
            "enable_chunked_prefill": not args.no_chunked_prefill,
            "max_decode_slowdown": args.max_decode_slowdown,
            "pack_weights": not args.no_pack_weights, "enforce_eager": args.enforce_eager, **quant_kwargs(args), **spec_kwargs(args),
            **parallel_kwargs(args)}


def quant_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return {"quantization": args.quantization, "quantization_config": args.quant_config,
            "dequantize": args.dequantize, "pruning": args.pruning}




SPEC_HELP = ('lossless speculative decoding, as JSON: \'{"method": "ngram"}\' (prompt lookup), '
             '\'{"method": "draft", "model": "smollm2-135m", "quantization": "gguf"}\', '
             '\'{"method": "early_exit", "exit_layer": 15, "heads": "exit.safetensors"}\', '
             '\'{"method": "medusa", "heads": "medusa.safetensors"}\'; add "num_speculative_tokens": k '
             '(default "auto": chosen per request by Thompson sampling)')


def add_spec(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-config", default=None, help=SPEC_HELP)


def spec_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return {"speculative_config": args.speculative_config}
