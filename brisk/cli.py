"""`brisk` command line: generate | convert | bench.

Bad input (a missing model, an empty prompt, an invalid sampling value) prints one line
`brisk: error: ...` and exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from brisk.loader.resolve import DEFAULT_MODEL

# The methods are checked by brisk.config.QuantConfig before any model loads (importing quant here
# would pull torch into every `brisk --help`); this line only describes them.
QUANT_HELP = ("int8: weight-only per output channel; int4: weight-only, groups of group_size (default 64), "
              "AWQ-scaled given a calibration text; w8a8: int8 weights and per-token int8 activations, "
              "SmoothQuant given a calibration text; ternary: BitNet b1.58 absmean {-1,0,1} x scale, 2-bit "
              "(destroys a model not trained for it); gguf: a .gguf file's Q4_0/Q4_1/Q8_0 blocks as stored")
QUANT_CONFIG_HELP = ('options as JSON: \'{"group_size": 64}\' (int4), \'{"calibration": "text.txt", '
                     '"calibration_tokens": 4096}\' (int4: AWQ + GPTQ, w8a8: SmoothQuant)')


def _add_quant(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--quantization", "-q", default=None, help=f"{what} ({QUANT_HELP})")
    p.add_argument("--quant-config", default=None, help=QUANT_CONFIG_HELP)

EXIT_USAGE = 2


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = off")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not included in the output")


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"built-in name, .gguf file or HF directory (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype (default float32)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context window to serve, in tokens (default: the model's own)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="brisk", description="brisk: fast exact-attention LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt, streaming it")
    _add_model(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", "-p", help="the prompt text (streamed reply)")
    src.add_argument("--prompts-file", type=Path,
                     help="many prompts, batched: one per line, or JSONL with 'prompt' or 'messages'")
    gen.add_argument("--output", "-o", type=Path, default=None,
                     help="with --prompts-file: write JSONL results here (default: stdout)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    _add_sampling(gen)
    _add_engine(gen)

    ev = sub.add_parser("eval", help="quality evaluations")
    esub = ev.add_subparsers(dest="eval", required=True)
    ppl = esub.add_parser("ppl", help="perplexity on a text file, with KL and top-1 agreement vs float32")
    ppl.add_argument("--model", "-m", default=DEFAULT_MODEL, help=f"model reference (default {DEFAULT_MODEL})")
    ppl.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    _add_quant(ppl, "evaluate a quantized model")
    ppl.add_argument("--text", type=Path, required=True, help="UTF-8 text file, e.g. wikitext-2-raw/wiki.test.raw")
    ppl.add_argument("--window", type=int, default=1024, help="tokens per non-overlapping window (default 1024)")
    ppl.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of the text")
    ppl.add_argument("--json", action="store_true", help="print only the JSON line")

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)")
    _add_model(srv)
    _add_engine(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set BRISK_API_KEY)")
    srv.add_argument("--max-waiting", type=int, default=256,
                     help="requests allowed to wait for a slot; beyond it new ones get 503 + Retry-After")

    qz = sub.add_parser("quantize", help="write a quantized copy of a model that loads without re-quantizing")
    qz.add_argument("model", help="built-in name, .gguf file or HF directory")
    qz.add_argument("--method", required=True,
                    help=f"quantization method: int8, int4, w8a8 or ternary ({QUANT_HELP}; a .gguf file needs no "
                         "quantize step for gguf)")
    qz.add_argument("--quant-config", default=None, help=QUANT_CONFIG_HELP)
    qz.add_argument("--out", required=True, type=Path, help="output directory (load it with --model DIR)")
    qz.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the rest")

    conv = sub.add_parser("convert", help="write a model as an HF-format safetensors directory")
    conv.add_argument("model", help="built-in name, .gguf file or HF directory")
    conv.add_argument("--out", required=True, type=Path, help="output directory")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])

    bench = sub.add_parser("bench", help="benchmarks that print JSON")
    bsub = bench.add_subparsers(dest="bench", required=True)
    lat = bsub.add_parser("latency", help="single-stream TTFT and decode tokens/s (optionally beside HF transformers)")
    _add_model(lat)
    lat.add_argument("--dtype-list", default=None, help="comma-separated dtypes to run in one go, e.g. float32,bfloat16")
    lat.add_argument("--prompt", default=None, help="prompt text (default: a short story request)")
    lat.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    lat.add_argument("--new-tokens", type=int, default=128)
    lat.add_argument("--repeats", type=int, default=3)
    lat.add_argument("--compare", default="", help="peers to run side by side: hf")
    _add_quant(lat, "quantize brisk's model at load")

    thr = bsub.add_parser("throughput", help="offline batched throughput on a seeded chat-like workload")
    _add_model(thr)
    _add_engine(thr)
    thr.add_argument("--num-prompts", type=int, default=32)
    thr.add_argument("--input-len", type=int, default=None, help="fixed prompt length (default: chat-like 50-1000)")
    thr.add_argument("--output-len", type=int, default=None, help="fixed output length (default: chat-like 20-400)")
    thr.add_argument("--shared-prefix", type=int, default=0, help="tokens of a prefix common to every prompt")
    thr.add_argument("--seed", type=int, default=0)
    thr.add_argument("--compare", default="", help="peers to run side by side: hf, vllm (comma-separated)")
    thr.add_argument("--vllm-python", default=os.environ.get("BRISK_VLLM_PYTHON"),
                     help="python of a venv with vllm installed, for --compare vllm (env BRISK_VLLM_PYTHON)")
    thr.add_argument("--hf-batch-size", type=int, default=None, help="HF generate() batch (default: all prompts)")

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

    pre = bsub.add_parser("prefix", help="time to first token with a cached long prefix vs a cold cache")
    _add_model(pre)
    _add_engine(pre)
    pre.add_argument("--prefix-len", type=int, default=1000)
    pre.add_argument("--suffix-len", type=int, default=32)
    pre.add_argument("--repeats", type=int, default=3)
    pre.add_argument("--seed", type=int, default=0)

    mix = bsub.add_parser("mixed", help="inter-token latency of running decodes while long prompts arrive")
    _add_model(mix)
    _add_engine(mix)
    mix.add_argument("--decoders", type=int, default=16, help="running decode requests")
    mix.add_argument("--long-len", type=int, default=1000, help="tokens of each arriving prompt")
    mix.add_argument("--every", type=int, default=8, help="a long prompt arrives every N steps")
    mix.add_argument("--steps", type=int, default=40)
    mix.add_argument("--seed", type=int, default=0)
    return parser


def _add_engine(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step (default 512)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step (default 64)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (default: from --kv-cache-memory-gib)")
    p.add_argument("--kv-cache-memory-gib", type=float, default=2.0, help="KV cache size (default 2 GiB)")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--no-chunked-prefill", action="store_true", help="disable chunked prefill")
    _add_quant(p, "quantize the model's linear layers at load")
    p.add_argument("--no-pack-weights", action="store_true",
                   help="do not keep oneDNN-packed weight copies (saves memory as large as the weights; "
                        "slower prefill and batched decode)")
    p.add_argument("--max-decode-slowdown", type=float, default=None,
                   help="size prompt chunks so a step with running decodes takes at most this many times "
                        "a decode-only step (e.g. 1.5; learned from step times; default: token budget only)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return {"max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
            "block_size": args.block_size, "num_kv_blocks": args.num_kv_blocks,
            "kv_cache_memory_gib": args.kv_cache_memory_gib, "max_model_len": args.max_model_len,
            "enable_prefix_caching": not args.no_prefix_caching,
            "enable_chunked_prefill": not args.no_chunked_prefill,
            "max_decode_slowdown": args.max_decode_slowdown,
            "pack_weights": not args.no_pack_weights, **quant_kwargs(args)}


def quant_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return {"quantization": args.quantization, "quantization_config": args.quant_config}


def _read_prompts(path: Path, chat: bool, system: str | None) -> list[dict[str, object]]:
    """Lines of text, or JSONL objects with "prompt" (text) or "messages" (a conversation)."""
    try:
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    except OSError as exc:
        raise ValueError(f"cannot read --prompts-file {path}: {exc.strerror}") from None
    items: list[dict[str, object]] = []
    for i, line in enumerate(lines, 1):
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict) or not ({"prompt", "messages"} & obj.keys()):
                raise ValueError(f"{path}:{i}: a JSON line needs a 'prompt' or 'messages' field")
            if "messages" not in obj and not isinstance(obj["prompt"], str):
                raise ValueError(f"{path}:{i}: 'prompt' must be a string")
            items.append(obj)
        else:
            items.append({"prompt": line})
    if not items:
        raise ValueError(f"--prompts-file {path} has no prompts")
    for item in items:
        if "prompt" in item and chat:
            item["messages"] = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": item["prompt"]}]
    return items


def _generate_file(llm: object, args: argparse.Namespace, params: object, items: list[dict[str, object]]) -> int:
    from brisk.engine.llm import LLM

    assert isinstance(llm, LLM)
    tok = llm.get_tokenizer()
    prompts = [{"prompt": it.get("prompt"), "prompt_token_ids": tok.encode_chat(it["messages"])}
               if "messages" in it else str(it["prompt"]) for it in items]
    outs = llm.generate(prompts, params)  # type: ignore[arg-type]
    lines = [json.dumps({"index": i, "prompt": it.get("prompt"), "text": o.outputs[0].text,
                         "finish_reason": str(o.outputs[0].finish_reason),
                         "prompt_tokens": len(o.prompt_token_ids), "completion_tokens": len(o.outputs[0].token_ids)})
             for i, (it, o) in enumerate(zip(items, outs))]
    if args.output:
        args.output.write_text("\n".join(lines) + "\n", encoding="utf-8")
        print(f"wrote {len(lines)} results to {args.output}", file=sys.stderr)
    else:
        print("\n".join(lines))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from brisk.engine.llm import LLM
    from brisk.request import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop)
    if args.prompt is not None and not args.prompt.strip():
        raise ValueError("the prompt is empty; pass some text with --prompt")
    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat (a system message only exists in a chat template)")
    # a bad prompts file is reported before the model loads
    items = _read_prompts(args.prompts_file, args.chat, args.system) if args.prompts_file is not None else None
    llm = LLM(args.model, dtype=args.dtype, **engine_kwargs(args))  # type: ignore[arg-type]
    if items is not None:
        return _generate_file(llm, args, params, items)
    tok = llm.get_tokenizer()
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        prompt = {"prompt_token_ids": tok.encode_chat(messages)}
    else:
        prompt = args.prompt
    last = None
    for last in llm.stream(prompt, params):
        sys.stdout.write(last.outputs[0].delta)
        sys.stdout.flush()
    assert last is not None
    sys.stdout.write("\n")
    m, n = last.metrics, len(last.outputs[0].token_ids)
    rate = last.decode_tokens_per_second()
    print(f"[prompt {len(last.prompt_token_ids)} tokens | generated {n} tokens | "
          f"time to first token {m.ttft * 1000:.0f} ms | decode {rate or 0:.1f} tokens/s | "
          f"finish: {last.outputs[0].finish_reason}]", file=sys.stderr)
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from brisk.loader.convert import convert

    out = convert(args.model, args.out, args.dtype)
    print(f"wrote {out}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    compare = [c for c in getattr(args, "compare", "").split(",") if c]
    peers = {"hf", "vllm"} if args.bench == "throughput" else {"hf"}
    unknown = set(compare) - peers
    if unknown:
        raise ValueError(f"unknown --compare peer(s): {', '.join(sorted(unknown))}; available: {', '.join(sorted(peers))}")
    if args.bench == "throughput":
        return _bench_throughput(args, compare)
    if args.bench == "serve":
        return _bench_serve(args)
    if args.bench in ("prefix", "mixed"):
        return _bench_engine(args)
    from brisk.bench.latency import DEFAULT_PROMPT, bench_latency

    if args.new_tokens < 2 or args.repeats < 1:
        raise ValueError("--new-tokens must be >= 2 and --repeats >= 1")
    dtypes = args.dtype_list.split(",") if args.dtype_list else [args.dtype]
    for dtype in dtypes:
        result = bench_latency(args.model, dtype, args.prompt or DEFAULT_PROMPT, not args.no_chat,
                               args.new_tokens, args.repeats, compare, quant_kwargs(args))
        print(json.dumps(result), flush=True)
    return 0


def _bench_engine(args: argparse.Namespace) -> int:
    from brisk.bench.serving_mix import bench_mixed, bench_prefix
    from brisk.engine.llm import LLM

    counts = ("decoders", "long_len", "every", "steps") if args.bench == "mixed" else ("prefix_len", "repeats")
    for name in counts:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    llm = LLM(args.model, dtype=args.dtype, **engine_kwargs(args))  # type: ignore[arg-type]
    if args.bench == "prefix":
        result = bench_prefix(llm, args.prefix_len, args.suffix_len, args.repeats, args.seed)
    else:
        result = bench_mixed(llm, args.decoders, args.long_len, args.every, args.steps, args.seed)
    result.update(model=args.model, dtype=args.dtype)
    print(json.dumps(result), flush=True)
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from brisk.bench.serving import bench_serve
    from brisk.bench.throughput import make_workload

    if args.num_prompts < 1 or not args.request_rate > 0:
        raise ValueError("--num-prompts must be >= 1 and --request-rate > 0")
    work = make_workload(args.num_prompts, args.vocab_size, args.seed, args.input_len, args.output_len)
    result = bench_serve(args.url, args.model, work, args.request_rate, args.seed, args.api_key, args.plot)
    print(json.dumps(result), flush=True)
    return 0 if result["failed"] == 0 else 1


def _bench_throughput(args: argparse.Namespace, compare: list[str]) -> int:
    from brisk.bench.throughput import bench_throughput

    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    result = bench_throughput(args.model, args.dtype, args.num_prompts, args.input_len, args.output_len,
                              args.seed, args.shared_prefix, compare, args.hf_batch_size, engine_kwargs(args),
                              args.vllm_python)
    print(json.dumps(result), flush=True)
    return 0


def _cmd_quantize(args: argparse.Namespace) -> int:
    from brisk.config import QuantConfig
    from brisk.loader.convert import quantize_to_dir

    quant = QuantConfig.parse(args.method, args.quant_config)
    out = quantize_to_dir(args.model, quant, args.out, args.dtype)
    print(f"wrote {out} ({quant.describe()})")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from brisk.engine.llm import LLM
    from brisk.server import serve

    if not 0 < args.port < 65536 or args.max_waiting < 1:
        raise ValueError("--port must be in 1..65535 and --max-waiting >= 1")
    llm = LLM(args.model, dtype=args.dtype, **engine_kwargs(args))  # type: ignore[arg-type]
    print(f"brisk: serving {llm.model_name} on http://{args.host}:{args.port} (OpenAI API under /v1)", file=sys.stderr)
    serve(llm, args.host, args.port, args.api_key, args.max_waiting)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from brisk.bench.eval_ppl import eval_ppl

    if args.max_tokens is not None and args.max_tokens < 2:
        raise ValueError("--max-tokens must be >= 2")
    result = eval_ppl(args.model, args.dtype, args.text, args.window, args.max_tokens, quant_kwargs(args))
    if not args.json:
        print(f"perplexity {result['perplexity']} over {result['tokens_scored']} tokens "
              f"(KL vs float32 {result['kl_vs_float32']}, top-1 agreement {result['top1_agreement_vs_float32']})",
              file=sys.stderr)
    print(json.dumps(result), flush=True)
    return 0


COMMANDS = {"generate": _cmd_generate, "convert": _cmd_convert, "bench": _cmd_bench, "serve": _cmd_serve,
            "eval": _cmd_eval, "quantize": _cmd_quantize}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ValueError, OSError) as exc:  # bad input, unreadable or unwritable paths
        print(f"brisk: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
