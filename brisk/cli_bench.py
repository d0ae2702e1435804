"""`brisk bench ...`: the benchmark subcommands (each prints JSON), split from cli.py to keep it small."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from brisk.cli_common import (
    add_device,
    add_engine,
    add_model,
    add_quant,
    add_spec,
    engine_kwargs,
    quant_kwargs,
    spec_kwargs,
)
from brisk.errors import UserError


def add_bench_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = sub.add_parser("bench", help="benchmarks that print JSON")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for add in (_latency_parser, _throughput_parser, _serve_parser, _prefix_parser,
                _mixed_parser, _spec_parser, _structured_parser, _kv_parser,
                _prune_parser, _families_parser, _parallel_parser):
        add(bsub)


def _latency_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    lat = bsub.add_parser("latency", help="single-stream TTFT and decode tokens/s (optionally beside HF transformers)")
    add_model(lat)
    lat.add_argument("--dtype-list", default=None, help="comma-separated dtypes to run in one go, e.g. float32,bfloat16")
    lat.add_argument("--prompt", default=None, help="prompt text (default: a short story request)")
    lat.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    lat.add_argument("--new-tokens", type=int, default=128)
    lat.add_argument("--repeats", type=int, default=3)
    lat.add_argument("--compare", default="",
                     help="peers to run side by side: hf (on the CPU only); plain (the same model without "
                          "-q / --speculative-config, its runs interleaved with brisk's: decode_speedup_vs_plain); "
                          "llamacpp (llama-cpp-python on the same .gguf, in --llamacpp-python's venv, interleaved)")
    lat.add_argument("--llamacpp-python", default=os.environ.get("BRISK_LLAMACPP_PYTHON"),
                     help="python of a venv with llama-cpp-python, for --compare llamacpp (env BRISK_LLAMACPP_PYTHON)")
    add_device(lat)
    add_quant(lat, "quantize brisk's model at load")
    add_spec(lat)


def _throughput_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    thr = bsub.add_parser("throughput", help="offline batched throughput on a seeded chat-like workload")
    add_model(thr)
    add_engine(thr)
    thr.add_argument("--num-prompts", type=int, default=32)
    thr.add_argument("--input-len", type=int, default=None, help="fixed prompt length (default: chat-like 50-1000)")
    thr.add_argument("--output-len", type=int, default=None, help="fixed output length (default: chat-like 20-400)")
    thr.add_argument("--shared-prefix", type=int, default=0, help="tokens of a prefix common to every prompt")
    thr.add_argument("--seed", type=int, default=0)
    thr.add_argument("--compare", default="",
                     help="peers to run side by side: hf, vllm, llamacpp (comma-separated; llamacpp runs the same "
                          ".gguf sequentially, its binding's only mode)")
    thr.add_argument("--llamacpp-python", default=os.environ.get("BRISK_LLAMACPP_PYTHON"),
                     help="python of a venv with llama-cpp-python, for --compare llamacpp (env BRISK_LLAMACPP_PYTHON)")
    thr.add_argument("--vllm-python", default=os.environ.get("BRISK_VLLM_PYTHON"),
                     help="python of a venv with vllm installed, for --compare vllm (env BRISK_VLLM_PYTHON)")
    thr.add_argument("--hf-batch-size", type=int, default=None, help="HF generate() batch (default: all prompts)")
    thr.add_argument("--rounds", type=int, default=1,
                     help="brisk and the llama.cpp peer alternated this many times on the same workload (brisk's "
                          "prefix cache emptied before each); figures of the median round, speedup the median of "
                          "the rounds' ratios")


def _serve_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    srvb = bsub.add_parser("serve", help="Poisson load against any OpenAI-compatible server (brisk, vLLM, llama.cpp)")
    srvb.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    srvb.add_argument("--model", default=None, help="model name to send (default: none; brisk serves one)")
    srvb.add_argument("--request-rate", type=float, default=float("inf"),
                      help="mean requests per second, Poisson arrivals (default inf: all at once)")
    srvb.add_argument("--num-prompts", type=int, default=32)
    srvb.add_argument("--input-len", type=int, default=None, help="fixed prompt length (default: chat-like 50-1000)")
    srvb.add_argument("--output-len", type=int, default=None, help="fixed output length (default: chat-like 20-400)")
    srvb.add_argument("--vocab-size", type=int, default=49152, help="prompt token ids are drawn below this")
    srvb.add_argument("--seed", type=int, default=0, help="same seed as `bench throughput`: the same workload")
    srvb.add_argument("--api-key", default=os.environ.get("BRISK_API_KEY"))
    srvb.add_argument("--plot", type=Path, default=None, help="write a PNG of the latency distributions here")


def _prefix_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    pre = bsub.add_parser("prefix", help="time to first token with a cached long prefix vs a cold cache")
    add_model(pre)
    add_engine(pre)
    pre.add_argument("--prefix-len", type=int, default=1000)
    pre.add_argument("--suffix-len", type=int, default=32)
    pre.add_argument("--repeats", type=int, default=3)
    pre.add_argument("--seed", type=int, default=0)


def _mixed_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    mix = bsub.add_parser("mixed", help="inter-token latency of running decodes while long prompts arrive")
    add_model(mix)
    add_engine(mix)
    mix.add_argument("--decoders", type=int, default=16, help="running decode requests")
    mix.add_argument("--long-len", type=int, default=1000, help="tokens of each arriving prompt")
    mix.add_argument("--every", type=int, default=8, help="a long prompt arrives every N steps")
    mix.add_argument("--steps", type=int, default=40)
    mix.add_argument("--seed", type=int, default=0)


def _spec_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    spb = bsub.add_parser("spec", help="speculative decoding: every method beside plain decoding, batch 1")
    add_model(spb)
    add_quant(spb, "quantize the target at load")
    spb.add_argument("--methods", default="ngram,draft,early_exit,medusa",
                     help="comma-separated methods to run (default: four; medusa needs --medusa-heads, streaming "
                          "--streaming-heads)")
    spb.add_argument("--num-speculative-tokens", default="auto", help="k per step, or auto (default)")
    spb.add_argument("--draft-model", default=None, help="draft model of method draft (default: the target's name)")
    spb.add_argument("--draft-quantization", default="gguf",
                     help="quantization of the draft model (default gguf: the file's own 4-bit blocks)")
    spb.add_argument("--draft", action="append", default=[], metavar="NAME=JSON",
                     help="one more configuration run side by side, named NAME: the JSON object's options "
                          "(model, quantization, draft_vocab, ...) of method draft, e.g. "
                          "'distilled={\"model\": \"DIR\", \"quantization\": \"int4\", \"draft_vocab\": 8192}', "
                          "or of another method named by \"method\", e.g. 'stream8={\"method\": \"streaming\", "
                          "\"heads\": \"FILE\", \"quantization\": \"int8\"}'; repeatable")
    spb.add_argument("--medusa-heads", default=None, help="heads file from `brisk train-heads --kind medusa`")
    spb.add_argument("--streaming-heads", default=None,
                     help="streams file from `brisk train-heads --kind streaming` (method streaming)")
    spb.add_argument("--exit-heads", default=None, help="exit head from `brisk train-heads --kind early_exit`")
    spb.add_argument("--exit-layer", type=int, default=None, help="early_exit: layers the draft runs")
    spb.add_argument("--max-tokens", type=int, default=128, help="tokens per reply (default 128)")
    spb.add_argument("--workloads", default="input_grounded,open_chat", help="comma-separated workloads")


def _structured_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    stb = bsub.add_parser("structured", help="a batch under a JSON schema beside the same batch free, interleaved")
    add_model(stb)
    add_engine(stb)
    stb.add_argument("--batch", type=int, default=16, help="requests decoded together (default 16)")
    stb.add_argument("--max-tokens", type=int, default=128, help="tokens per reply (default 128)")
    stb.add_argument("--fields", type=int, default=20, help="fields of the record schema (default 20)")
    stb.add_argument("--repeats", type=int, default=3, help="free/constrained run pairs (default 3)")


def _kv_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    kvb = bsub.add_parser("kv", help="KV layouts side by side (paged blocks, virtual rows): prefill and decode "
                                     "tokens/s, committed vs used bytes, time spent committing pages per step, "
                                     "forwards that waited on page faults")
    add_model(kvb)
    kvb.add_argument("--layouts", default="paged,virtual",
                     help="comma-separated: paged, virtual, virtual_thp (virtual rows on 2 MB transparent huge "
                          "pages) (default paged,virtual)")
    kvb.add_argument("--batches", default="1,8,32", help="sequences per cell (default 1,8,32)")
    kvb.add_argument("--contexts", default="256,2048", help="prompt tokens per cell (default 256,2048)")
    kvb.add_argument("--decode-tokens", type=int, default=32, help="decode steps per cell (default 32)")
    kvb.add_argument("--kv-cache-memory-gib", type=float, default=4.0,
                     help="KV memory of each layout (default 4: batch 32 x 2k tokens of the default model fit)")
    kvb.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step (default 512)")
    kvb.add_argument("--block-size", type=int, default=16, help="tokens per KV block / tile (default 16)")
    add_device(kvb)
    add_quant(kvb, "quantize the model at load")


def _prune_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    prb = bsub.add_parser("prune", help="pruned models beside their dense model: decode and batched tokens/s, "
                                        "parameters and weight bytes, interleaved")
    add_model(prb)
    prb.add_argument("--variants", required=True,
                     help="comma-separated pruned models (directories written by `brisk prune`) measured beside "
                          "--model, the dense model they were cut from; probe:RATIO is --model under Probe Pruning "
                          "(decided per batch, its decision counted in its figures; needs --calibration)")
    prb.add_argument("--calibration", default=None, help="text file Probe Pruning variants score their history on")
    prb.add_argument("--new-tokens", type=int, default=64, help="tokens per decode and per batched request (default 64)")
    prb.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default 5)")
    prb.add_argument("--batch", type=int, default=16, help="requests of the batched workload (default 16)")
    add_quant(prb, "quantize every model at load (dense and pruned alike)")


def _families_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    fam = bsub.add_parser("families", help="every architecture at one shape with random weights: decode tokens/s "
                                           "per weight byte against Llama's, interleaved")
    fam.add_argument("--families", default="llama,qwen3,phi3,mistral,gemma3",
                     help="comma-separated, the first is the baseline (default llama,qwen3,phi3,mistral,gemma3)")
    fam.add_argument("--new-tokens", type=int, default=64, help="decode tokens per run (default 64)")
    fam.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default 5)")
    fam.add_argument("--layers", type=int, default=30, help="decoder layers of the shape (default 30: SmolLM2-135M's)")


def _parallel_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    par = bsub.add_parser("parallel", help="tensor x pipeline parallel grids beside one process: tokens/s, bytes/token")
    add_model(par)
    par.add_argument("--grid", default="1x1,2x1,3x1,1x2", help="TxP configurations (default 1x1,2x1,3x1,1x2)")
    par.add_argument("--batch", type=int, default=8, help="sequences of the batched workload (default 8)")
    par.add_argument("--max-tokens", type=int, default=64, help="tokens per sequence (default 64)")
    par.add_argument("--device", default="cpu", help="cpu or cuda (NCCL; each rank takes cuda:LOCAL_RANK)")
    par.add_argument("--num-kv-blocks", type=int, default=512)


def _bench_parallel(args: argparse.Namespace) -> int:
    from brisk.bench.parallel_bench import bench_parallel

    try:
        grid = [(int(t), int(p)) for t, p in (g.lower().split("x") for g in args.grid.split(",") if g)]
    except ValueError:
        raise UserError(f"--grid takes TxP pairs like 1x1,2x1,1x2, got {args.grid!r}") from None
    if args.batch < 1 or args.max_tokens < 2 or not grid:
        raise UserError("--batch must be >= 1, --max-tokens >= 2 and --grid non-empty")
    engine = {"dtype": args.dtype, "device": args.device, "max_model_len": args.max_model_len,
              "num_kv_blocks": args.num_kv_blocks}
    print(json.dumps(bench_parallel(args.model, grid, args.batch, args.max_tokens, engine)), flush=True)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    compare = [c for c in getattr(args, "compare", "").split(",") if c]
    peers = {"hf", "vllm", "llamacpp"} if args.bench == "throughput" else {"hf", "plain", "llamacpp"}
    unknown = set(compare) - peers
    if unknown:
        raise UserError(f"unknown --compare peer(s): {', '.join(sorted(unknown))}; available: {', '.join(sorted(peers))}")
    if args.bench == "throughput":
        return _bench_throughput(args, compare)
    if args.bench == "serve":
        return _bench_serve(args)
    if args.bench in ("prefix", "mixed"):
        return _bench_engine(args)
    if args.bench == "spec":
        return _bench_spec(args)
    if args.bench == "parallel":
        return _bench_parallel(args)
    if args.bench == "structured":
        return _bench_structured(args)
    if args.bench == "kv":
        return _bench_kv(args)
    if args.bench == "prune":
        return _bench_prune(args)
    if args.bench == "families":
        from brisk.bench.families_bench import bench_families

        print(json.dumps(bench_families([f for f in args.families.split(",") if f], args.new_tokens, args.repeats,
                                        layers=args.layers)), flush=True)
        return 0
    from brisk.bench.latency import DEFAULT_PROMPT, bench_latency

    if args.new_tokens < 2 or args.repeats < 1:
        raise UserError("--new-tokens must be >= 2 and --repeats >= 1")
    dtypes = args.dtype_list.split(",") if args.dtype_list else [args.dtype]
    for dtype in dtypes:
        result = bench_latency(args.model, dtype, args.prompt or DEFAULT_PROMPT, not args.no_chat,
                               args.new_tokens, args.repeats, compare,
                               {**quant_kwargs(args), **spec_kwargs(args), "device": args.device},
                               getattr(args, "llamacpp_python", None))
        print(json.dumps(result), flush=True)
    return 0


def _bench_engine(args: argparse.Namespace) -> int:
    from brisk.bench.serving_mix import bench_mixed, bench_prefix
    from brisk.engine.llm import LLM

    counts = ("decoders", "long_len", "every", "steps") if args.bench == "mixed" else ("prefix_len", "repeats")
    for name in counts:
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    llm = LLM(args.model, dtype=args.dtype, **engine_kwargs(args))  # type: ignore[arg-type]
    if args.bench == "prefix":
        result = bench_prefix(llm, args.prefix_len, args.suffix_len, args.repeats, args.seed)
    else:
        result = bench_mixed(llm, args.decoders, args.long_len, args.every, args.steps, args.seed)
    result.update(model=args.model, dtype=args.dtype)
    print(json.dumps(result), flush=True)
    return 0


def _bench_kv(args: argparse.Namespace) -> int:
    from brisk.bench.kv_bench import LAYOUTS, bench_kv

    def ints(name: str) -> list[int]:
        try:
            values = [int(v) for v in getattr(args, name).split(",") if v]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise UserError(f"--{name} takes comma-separated positive integers, got {getattr(args, name)!r}")
        return values

    layouts = [v for v in args.layouts.split(",") if v]
    if not layouts or set(layouts) - set(LAYOUTS):
        raise UserError(f"--layouts takes {', '.join(LAYOUTS)}, got {args.layouts!r}")
    if args.decode_tokens < 2:
        raise UserError("--decode-tokens must be >= 2")
    if args.device != "cpu" and "virtual_thp" in layouts:
        raise UserError("virtual_thp is the CPU's transparent huge pages; on a GPU compare paged,virtual")
    engine = {"dtype": args.dtype, "device": args.device, "kv_cache_memory_gib": args.kv_cache_memory_gib,
              "block_size": args.block_size,
              "max_num_batched_tokens": args.max_num_batched_tokens, **quant_kwargs(args)}
    print(json.dumps(bench_kv(args.model, layouts, ints("batches"), ints("contexts"), args.decode_tokens, engine)),
          flush=True)
    return 0


def _bench_prune(args: argparse.Namespace) -> int:
    from brisk.bench.prune_bench import bench_prune

    if args.new_tokens < 2 or args.repeats < 1 or args.batch < 1:
        raise UserError("--new-tokens must be >= 2, --repeats and --batch >= 1")
    if args.pruning is not None:
        raise UserError("--pruning would prune the dense reference too: give the pruned models as --variants")
    variants = [v for v in args.variants.split(",") if v]
    if not variants:
        raise UserError("--variants needs at least one pruned model")
    engine = {"dtype": args.dtype, "max_model_len": args.max_model_len or 1024, "num_kv_blocks": 1024,
              "quantization": args.quantization, "quantization_config": args.quant_config, "dequantize": args.dequantize}
    print(json.dumps(bench_prune([args.model, *variants], engine, args.new_tokens, args.repeats, args.batch,
                                 calibration=args.calibration)),
          flush=True)
    return 0


def _bench_structured(args: argparse.Namespace) -> int:
    from brisk.bench.structured_bench import bench_structured
    from brisk.engine.llm import LLM

    for name in ("batch", "max_tokens", "fields", "repeats"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    llm = LLM(args.model, dtype=args.dtype, **engine_kwargs(args))  # type: ignore[arg-type]
    print(json.dumps(bench_structured(llm, args.batch, args.max_tokens, args.repeats, args.fields)), flush=True)
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from brisk.bench.serving import bench_serve
    from brisk.bench.throughput import make_workload

    if args.num_prompts < 1 or not args.request_rate > 0:
        raise UserError("--num-prompts must be >= 1 and --request-rate > 0")
    work = make_workload(args.num_prompts, args.vocab_size, args.seed, args.input_len, args.output_len)
    result = bench_serve(args.url, args.model, work, args.request_rate, args.seed, args.api_key, args.plot)
    print(json.dumps(result), flush=True)
    return 0 if result["failed"] == 0 else 1


def _bench_throughput(args: argparse.Namespace, compare: list[str]) -> int:
    from brisk.bench.throughput import bench_throughput

    if args.num_prompts < 1:
        raise UserError("--num-prompts must be >= 1")
    result = bench_throughput(args.model, args.dtype, args.num_prompts, args.input_len, args.output_len,
                              args.seed, args.shared_prefix, compare, args.hf_batch_size, engine_kwargs(args),
                              args.vllm_python, args.llamacpp_python, args.rounds)
    print(json.dumps(result), flush=True)
    return 0


def spec_methods(args: argparse.Namespace, target: str) -> dict[str, dict[str, object]]:
    """Speculative configs of the methods asked for; medusa or streaming without heads is an error."""
    k: object = args.num_speculative_tokens if args.num_speculative_tokens == "auto" else int(args.num_speculative_tokens)
    configs: dict[str, dict[str, object]] = {}
    for method in [m for m in args.methods.split(",") if m]:
        cfg: dict[str, object] = {"method": method, "num_speculative_tokens": k}
        if method == "draft":
            cfg.update(model=args.draft_model or target, quantization=args.draft_quantization or None)
        elif method == "early_exit":
            cfg.update({"heads": args.exit_heads} if args.exit_heads else {})
            cfg.update({"exit_layer": args.exit_layer} if args.exit_layer else {})
        elif method == "medusa":
            if not args.medusa_heads:
                raise UserError("--methods includes medusa: give --medusa-heads (from `brisk train-heads --kind medusa`)")
            cfg["heads"] = args.medusa_heads
        elif method == "streaming":
            if not args.streaming_heads:
                raise UserError("--methods includes streaming: give --streaming-heads (from `brisk train-heads "
                                "--kind streaming`)")
            cfg["heads"] = args.streaming_heads
        configs[method] = cfg
    for entry in args.draft:
        name, _, options = entry.partition("=")
        try:
            extra = json.loads(options)
        except json.JSONDecodeError as exc:
            raise UserError(f"--draft {entry!r}: after NAME= comes a JSON object of draft options ({exc})") from None
        if not name or name in configs or not isinstance(extra, dict):
            raise UserError(f"--draft {entry!r}: give NAME=JSON with a new name and a JSON object, e.g. "
                             "'d8={\"model\": \"DIR\"}'")
        configs[name] = {"method": "draft", "num_speculative_tokens": k, **extra}
    return configs


def _bench_spec(args: argparse.Namespace) -> int:
    from brisk.bench.spec_bench import bench_spec, workloads
    from brisk.config import SpecConfig
    from brisk.engine.llm import LLM

    methods = spec_methods(args, args.model)
    for cfg in methods.values():
        SpecConfig.parse(cfg)  # every config checked before any model loads
    names = [w for w in args.workloads.split(",") if w]
    unknown = set(names) - set(workloads())
    if unknown or args.max_tokens < 2:
        raise UserError(f"unknown workload(s) {sorted(unknown)} (known: {', '.join(workloads())}) or --max-tokens < 2")
    base = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, **quant_kwargs(args))  # type: ignore[arg-type]
    print(json.dumps(bench_spec(base, methods, args.max_tokens, names)), flush=True)
    return 0
