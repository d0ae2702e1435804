"""`brisk` command line: generate | serve | convert | quantize | prune | distill | eval | bench | train-heads | env.

Bad input (a missing model, an empty prompt, an invalid sampling value) prints one line
`brisk: error: ...` and exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from brisk.cli_bench import add_bench_parsers, run_bench
from brisk.cli_distill import add_distill_parser, cmd_distill
from brisk.cli_common import (
    QUANT_CONFIG_HELP,
    QUANT_HELP,
    add_device,
    add_engine,
    add_model,
    add_quant,
    engine_kwargs,
    quant_kwargs,
)
from brisk.config import PRUNE_METHODS, PruneConfig
from brisk.errors import UserError
from brisk.loader.resolve import DEFAULT_MODEL
from brisk.server.tools import FORMATS as TOOL_FORMATS

EXIT_USAGE = 2


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = off")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not included in the output")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="brisk", description="brisk: fast exact-attention LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_generate_parser, _eval_parser, _serve_parser, _env_parser,
                _quantize_parser, _prune_parser, _convert_parser,
                add_bench_parsers, _add_train_heads, add_distill_parser):
        add(sub)
    return parser


def _generate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]

    gen = sub.add_parser("generate", help="generate text from a prompt, streaming it")
    add_model(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", "-p", help="the prompt text (streamed reply)")
    src.add_argument("--prompts-file", type=Path,
                     help="many prompts, batched: one per line, or JSONL with 'prompt' or 'messages'")
    gen.add_argument("--output", "-o", type=Path, default=None,
                     help="with --prompts-file: write JSONL results here (default: stdout)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    _add_sampling(gen)
    shape = gen.add_mutually_exclusive_group()  # structured outputs: one grammar enforced token by token
    shape.add_argument("--json-schema", default=None, metavar="FILE_OR_JSON",
                       help="output matches this JSON schema (a file, or the schema's JSON text)")
    shape.add_argument("--json-object", action="store_true", help="output is a JSON object")
    shape.add_argument("--regex", default=None, help="output matches this regular expression")
    shape.add_argument("--choice", action="append", default=None, help="output is one of these (repeatable)")
    add_engine(gen)


def _eval_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ev = sub.add_parser("eval", help="quality evaluations")
    esub = ev.add_subparsers(dest="eval", required=True)
    ppl = esub.add_parser("ppl", help="perplexity on a text file, with KL and top-1 agreement vs float32")
    ppl.add_argument("--model", "-m", default=DEFAULT_MODEL, help=f"model reference (default {DEFAULT_MODEL})")
    ppl.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    add_device(ppl)
    add_quant(ppl, "evaluate a quantized or pruned model")
    ppl.add_argument("--text", type=Path, required=True, help="UTF-8 text file, e.g. wikitext-2-raw/wiki.test.raw")
    ppl.add_argument("--window", type=int, default=1024, help="tokens per non-overlapping window (default 1024)")
    ppl.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of the text")
    ppl.add_argument("--score-from", type=int, default=1,
                     help="score each window's tokens from this position on; the ones before are context only "
                          "(default 1: all but the first). Under Probe Pruning they are also the prompt its decision "
                          "is made on, so no scored token is seen before it is predicted (the default decides on "
                          "the whole window, as the paper's perplexity does)")
    ppl.add_argument("--json", action="store_true", help="print only the JSON line")


def _serve_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)")
    add_model(srv)
    add_engine(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set BRISK_API_KEY)")
    srv.add_argument("--max-waiting", type=int, default=256,
                     help="requests allowed to wait for a slot; beyond it new ones get 503 + Retry-After")
    srv.add_argument("--max-connections", type=int, default=1024,
                     help="open HTTP connections; one more is answered 503 and closed (default 1024)")
    srv.add_argument("--request-timeout", type=float, default=30.0,
                     help="seconds a client has to send a request's head, and again its body (408 after; default 30)")
    srv.add_argument("--tool-call-parser", choices=sorted(TOOL_FORMATS), default=None,
                     help="how the model writes tool calls (default: read from its chat template; a template "
                          "without tools gets brisk's hermes-style default prompt)")


def _env_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    env = sub.add_parser("env", help="this machine and what brisk runs on it (ISA, kernels, threads, torch), for bug "
                                     "reports")
    env.add_argument("--json", action="store_true", help="one JSON line instead of aligned lines")
    env.add_argument("--no-bandwidth", action="store_true", help="skip the ~0.3 s memory-bandwidth measurement")


def _quantize_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    qz = sub.add_parser("quantize", help="write a quantized copy of a model that loads without re-quantizing")
    qz.add_argument("model", help="built-in name, .gguf file or HF directory")
    qz.add_argument("--method", required=True,
                    help=f"quantization method: int8, int4, w8a8 or ternary ({QUANT_HELP}; a .gguf file needs no "
                         "quantize step for gguf)")
    qz.add_argument("--quant-config", default=None, help=QUANT_CONFIG_HELP)
    qz.add_argument("--out", required=True, type=Path, help="output directory (load it with --model DIR)")
    qz.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the rest")


def _prune_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    pr = sub.add_parser("prune", help="write a pruned copy of a model (fewer heads, channels or layers) as a directory")
    pr.add_argument("model", help="built-in name, .gguf file or HF directory")
    pr.add_argument("--method", required=True, choices=[m for m in PRUNE_METHODS if m != "probe"],
                    help="structured: whole KV groups of attention heads and MLP channels, FLAP's standardized "
                         "fluctuation scores over all layers, bias compensation; layers: whole decoder layers, "
                         "ShortGPT's block influence; 2:4: 2 of every 4 weights of a row (SparseGPT), stored packed")
    pr.add_argument("--ratio", type=float, default=None,
                    help="structured: fraction of the decoder layers' weights removed; layers: fraction of the layers "
                         "(2:4: always 0.5)")
    pr.add_argument("--quantization", "-q", default=None, choices=["int8"],
                    help="2:4: keep the kept weights as int8 (one scale per row) instead of float32")
    pr.add_argument("--calibration", required=True, type=Path, help="text file the scores are measured on")
    pr.add_argument("--calibration-tokens", type=int, default=PruneConfig.calibration_tokens,
                    help=f"tokens of it used (default {PruneConfig.calibration_tokens})")
    pr.add_argument("--multiple", type=int, default=PruneConfig.multiple,
                    help=f"structured: MLP widths kept in multiples of this (default {PruneConfig.multiple}, "
                         "what int4 groups need)")
    pr.add_argument("--no-bias-compensation", action="store_true",
                    help="structured: do not add the pruned channels' mean output back as a bias")
    pr.add_argument("--out", required=True, type=Path, help="output directory (load it with --model DIR)")
    pr.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def _convert_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    conv = sub.add_parser("convert", help="write a model as an HF-format safetensors directory")
    conv.add_argument("model", help="built-in name, .gguf file or HF directory")
    conv.add_argument("--out", required=True, type=Path, help="output directory")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def _read_prompts(path: Path, chat: bool, system: str | None) -> list[dict[str, object]]:
    """Lines of text, or JSONL objects with "prompt" (text) or "messages" (a conversation)."""
    from brisk.engine.prompts_file import read_prompts_file

    items = [item for _, item in read_prompts_file(path)]
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


def _structured(args: argparse.Namespace) -> dict[str, object] | None:
    """`generate`'s grammar options as SamplingParams.structured (None: free text)."""
    if args.json_schema is not None:
        text = args.json_schema
        path = Path(text)
        if not text.lstrip().startswith("{") and path.is_file():
            text = path.read_text(encoding="utf-8")
        try:
            return {"json": json.loads(text)}
        except json.JSONDecodeError as e:
            raise UserError(f"--json-schema: neither a file nor valid JSON ({e})") from None
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    return {"choice": args.choice} if args.choice else None


def _cmd_generate(args: argparse.Namespace) -> int:
    from brisk.engine.llm import LLM
    from brisk.request import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop, structured=_structured(args))
    if args.prompt is not None and not args.prompt.strip():
        raise UserError("the prompt is empty; pass some text with --prompt")
    if args.system is not None and not args.chat:
        raise UserError("--system needs --chat (a system message only exists in a chat template)")
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


def _cmd_quantize(args: argparse.Namespace) -> int:
    from brisk.config import QuantConfig
    from brisk.loader.convert import quantize_to_dir
    from brisk.loader.quantized import quantization_of

    quant = QuantConfig.parse(args.method, args.quant_config)
    out = quantize_to_dir(args.model, quant, args.out, args.dtype)
    print(f"wrote {out} ({(quantization_of(out) or quant).describe()})")  # as resolved for the source
    return 0


def _cmd_prune(args: argparse.Namespace) -> int:
    from brisk.compress.prune import prune_to_dir
    from brisk.config import QuantConfig

    if args.ratio is None and args.method != "2:4":
        raise UserError(f"--method {args.method} needs --ratio (e.g. 0.25)")
    pcfg = PruneConfig(args.method, 0.5 if args.ratio is None else args.ratio, str(args.calibration),
                       args.calibration_tokens, args.multiple, not args.no_bias_compensation)
    quant = None if args.quantization is None else QuantConfig(args.quantization)
    report = prune_to_dir(args.model, pcfg, args.out, args.dtype, quant=quant)
    print(f"wrote {args.out} ({pcfg.describe()}: {report['layer_weights_removed']:.1%} of the layer weights "
          f"removed, {report['params'] / 1e6:.1f}M of {report['params_dense'] / 1e6:.1f}M parameters kept)",
          file=sys.stderr)
    print(json.dumps(report), flush=True)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from brisk.engine.llm import LLM
    from brisk.server import serve
    from brisk.server.edge import EdgeLimits

    if not 0 < args.port < 65536 or args.max_waiting < 1:
        raise UserError("--port must be in 1..65535 and --max-waiting >= 1")
    if args.max_connections < 1 or not args.request_timeout > 0:
        raise UserError("--max-connections must be >= 1 and --request-timeout > 0")
    limits = EdgeLimits(body_timeout_s=args.request_timeout, head_timeout_s=args.request_timeout,
                        max_connections=args.max_connections)
    llm = LLM(args.model, dtype=args.dtype, **engine_kwargs(args))  # type: ignore[arg-type]
    print(f"brisk: serving {llm.model_name} on http://{args.host}:{args.port} (OpenAI API under /v1)", file=sys.stderr)
    serve(llm, args.host, args.port, args.api_key, args.max_waiting, limits=limits, tool_parser=args.tool_call_parser)
    return 0


def _add_train_heads(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    th = sub.add_parser("train-heads", help="train Medusa, early-exit or Speculative Streaming heads on text the "
                                            "model generates itself")
    th.add_argument("--model", "-m", default=DEFAULT_MODEL, help=f"model reference (default {DEFAULT_MODEL})")
    th.add_argument("--kind", required=True, choices=["medusa", "early_exit", "streaming"],
                    help="streaming: stream embeddings + LoRA on the top layers, active on stream rows only (the "
                         "model's own tokens are unchanged)")
    th.add_argument("--out", required=True, type=Path, help="heads file to write (.safetensors)")
    th.add_argument("--num-heads", type=int, default=4,
                    help="medusa: heads; streaming: streams; one per draft token (default 4)")
    th.add_argument("--stream-layers", type=int, default=4, help="streaming: top layers the streams run (default 4)")
    th.add_argument("--lora-rank", type=int, default=8, help="streaming: rank of the top layers' adapters (default 8)")
    th.add_argument("--token-rank", type=int, default=None,
                    help="streaming: rank of the map that feeds x[t+1]'s embedding to the streams (default 64)")
    th.add_argument("--bf16", action="store_true",
                    help="streaming: bfloat16 autocast for training (CPUs with AMX or AVX-512 BF16, GPUs); the "
                         "frozen layers' keys and values are kept in bfloat16 too (half the memory)")
    th.add_argument("--init", type=Path, default=None,
                    help="streaming: continue training from this streams file (its streams, layers and ranks)")
    th.add_argument("--exit-layer", type=int, default=None, help="early_exit: layers the draft runs (default: half)")
    th.add_argument("--prompts-file", type=Path, default=None,
                    help="prompts, one per line, or JSON lines with \"prompt\" (default: built-in topic x "
                         "template questions)")
    th.add_argument("--num-prompts", type=int, default=480, help="prompts to answer (default 480)")
    th.add_argument("--max-tokens", type=int, default=256, help="tokens per answer (default 256)")
    th.add_argument("--epochs", type=int, default=3)
    th.add_argument("--parallel", action="store_true",
                    help="medusa: classic parallel heads (default: sequential, Hydra-style heads that also read "
                         "the tokens drafted before theirs)")
    th.add_argument("--sequences", type=Path, default=None,
                    help="JSON file keeping the generated answers: written on the first run, read (no generation) after")
    th.add_argument("--draft-vocab", type=int, default=8192,
                    help="draft among the N tokens most frequent in the training answers (FR-Spec; a fraction of "
                         "the LM head's cost per draft; lossless: verification scores every token); 0 = all")


def _cmd_train_heads(args: argparse.Namespace) -> int:
    from brisk.engine.train_heads import run_train_heads

    if args.num_heads < 1 or args.num_prompts < 10 or args.max_tokens < 8 or args.epochs < 1:
        raise UserError("need --num-heads >= 1, --num-prompts >= 10, --max-tokens >= 8, --epochs >= 1")
    if args.kind == "streaming" and not (args.num_heads <= 15 and args.stream_layers >= 1 and 1 <= args.lora_rank <= 256
                                         and (args.token_rank is None or args.token_rank >= 1)):
        raise UserError("streaming needs --num-heads (streams) <= 15, --stream-layers >= 1, --lora-rank 1..256, "
                        "--token-rank >= 1")
    if args.init is not None and args.kind != "streaming":
        raise UserError("--init continues a streams file: it applies to --kind streaming")
    if args.kind == "streaming" and args.bf16:
        import torch

        from brisk.compress.distill import check_bf16

        check_bf16(True, torch.device("cpu"))
    report = run_train_heads(args.model, args.kind, args.out, args.num_heads, args.exit_layer, args.num_prompts,
                             args.max_tokens, args.epochs, args.prompts_file, args.draft_vocab, args.sequences,
                             not args.parallel, args.stream_layers, args.lora_rank, args.token_rank, args.bf16,
                             log=lambda d: print(json.dumps(d), file=sys.stderr, flush=True), init=args.init)
    print(json.dumps(report), flush=True)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from brisk.bench.eval_ppl import eval_ppl

    if args.max_tokens is not None and args.max_tokens < 2:
        raise UserError("--max-tokens must be >= 2")
    result = eval_ppl(args.model, args.dtype, args.text, args.window, args.max_tokens, quant_kwargs(args),
                      device=args.device, score_from=args.score_from)
    if not args.json:
        print(f"perplexity {result['perplexity']} over {result['tokens_scored']} tokens "
              f"(KL vs float32 {result['kl_vs_float32']}, top-1 agreement {result['top1_agreement_vs_float32']})",
              file=sys.stderr)
    print(json.dumps(result), flush=True)
    return 0


def _torchrun_worker(args: argparse.Namespace) -> bool:
    """Under torchrun every rank runs the same brisk command; ranks other than 0 serve steps
    (engine/workers/) with the options rank 0's LLM gets, and return True when rank 0 stops them."""
    from brisk.engine.workers import WorkerArgs, run_worker, torchrun_rank

    rank = torchrun_rank()
    if rank is None or rank == 0:
        return False
    run_worker(WorkerArgs.of_llm(args.model, {"dtype": args.dtype, **engine_kwargs(args)}), rank, "env://")
    return True


def _cmd_env(args: argparse.Namespace) -> int:
    from brisk.bench.sysinfo import collect, render

    env = collect(measure_bandwidth=not args.no_bandwidth)
    print(json.dumps(env) if args.json else render(env))
    return 0


COMMANDS = {"generate": _cmd_generate, "convert": _cmd_convert, "bench": run_bench, "serve": _cmd_serve,
            "eval": _cmd_eval, "quantize": _cmd_quantize, "prune": _cmd_prune, "train-heads": _cmd_train_heads, "env": _cmd_env,
            "distill": cmd_distill}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command in ("generate", "serve") and _torchrun_worker(args):
            return 0
        return COMMANDS[args.command](args)
    except (ValueError, OSError) as exc:  # bad input, unreadable or unwritable paths
        print(f"brisk: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
