"""`brisk` command line: generate | convert | bench.

Bad input (a missing model, an empty prompt, an invalid sampling value) prints one line
`brisk: error: ...` and exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from brisk.loader.resolve import DEFAULT_MODEL

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
    gen.add_argument("--prompt", "-p", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    _add_sampling(gen)

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
    return parser


def _cmd_generate(args: argparse.Namespace) -> int:
    from brisk.engine.llm import LLM
    from brisk.request import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop)
    if not args.prompt.strip():
        raise ValueError("the prompt is empty; pass some text with --prompt")
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len)
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
    from brisk.bench.latency import DEFAULT_PROMPT, bench_latency

    compare = [c for c in args.compare.split(",") if c]
    unknown = set(compare) - {"hf"}
    if unknown:
        raise ValueError(f"unknown --compare peer(s): {', '.join(sorted(unknown))}; available: hf")
    if args.new_tokens < 2 or args.repeats < 1:
        raise ValueError("--new-tokens must be >= 2 and --repeats >= 1")
    dtypes = args.dtype_list.split(",") if args.dtype_list else [args.dtype]
    for dtype in dtypes:
        result = bench_latency(args.model, dtype, args.prompt or DEFAULT_PROMPT, not args.no_chat,
                               args.new_tokens, args.repeats, compare)
        print(json.dumps(result), flush=True)
    return 0


COMMANDS = {"generate": _cmd_generate, "convert": _cmd_convert, "bench": _cmd_bench}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"brisk: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
