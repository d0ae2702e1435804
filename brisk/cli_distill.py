"""`brisk distill`: its arguments and the command (compress/distill.py does the work)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from brisk.config import DISTILL_LOSSES, DistillConfig
from brisk.errors import UserError

_D = DistillConfig()
# DistillSpec (Zhou et al., 2024): a draft's acceptance rate is 1 - TVD(target, draft) per token,
# and on-policy data (the draft's own samples) aligns it where it will be used
FOR_DRAFT: dict[str, str | float] = {"loss": "tvd", "on_policy": 0.5}
ON_POLICY_FLAG = 0.5  # `--on-policy` alone: half the steps on the student's samples (DistillSpec's mix)


def add_distill_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ds = sub.add_parser("distill", help="train a student on a teacher's next-token distributions, write it as a directory")
    ds.add_argument("--teacher", required=True, help="built-in name, .gguf file or HF directory (run in float32)")
    ds.add_argument("--student", default=None,
                    help="the model to train: a directory of `brisk prune` (recovery) or any model with the teacher's "
                         "tokenizer; omit it to derive one from the teacher with --student-layers / --student-mlp")
    ds.add_argument("--student-layers", default=None, help="derive: the teacher layers kept, e.g. 0,2,4,6 or 0-9")
    ds.add_argument("--student-mlp", type=int, default=None,
                    help="derive: every kept layer's MLP narrowed to this many channels (largest weight norms)")
    ds.add_argument("--out", required=True, type=Path, help="output directory (load it with --model DIR)")
    ds.add_argument("--text", type=Path, default=None,
                    help="training text: windows of --seq-len tokens; its first --eval-tokens tokens are held out")
    ds.add_argument("--prompts-file", type=Path, default=None,
                    help="prompts as `brisk generate --prompts-file` reads them (one a line, or JSON lines with "
                         "'prompt' or 'messages', a conversation rendered by the teacher's chat template): the "
                         "teacher's sampled continuations to --seq-len tokens are the data")
    ds.add_argument("--chat", action="store_true",
                    help="each prompt of --prompts-file is a user turn rendered by the teacher's chat template "
                         "(for a chat model's draft)")
    ds.add_argument("--loss", default=None, choices=DISTILL_LOSSES,
                    help=f"fkl: KL(teacher||student); rkl: KL(student||teacher) (MiniLLM); tvd: total variation "
                         f"(default {_D.loss}; with --for-draft tvd)")
    ds.add_argument("--top-k", type=int, default=_D.top_k,
                    help="fkl over the teacher's k likeliest tokens only, renormalised (0: all)")
    ds.add_argument("--temperature", type=float, default=_D.temperature)
    ds.add_argument("--store-teacher", action="store_true",
                    help="with --top-k K <= 20: the teacher's top K at every training position computed once by "
                         "brisk's engine and kept in OUT/teacher_topk.safetensors, instead of its forward in every "
                         "step (steps 1.35x faster here; the pass costs ~1.6 passes of in-loop teacher work, so it "
                         "pays over longer runs)")
    ds.add_argument("--on-policy", type=float, default=None, nargs="?", const=ON_POLICY_FLAG, metavar="SHARE",
                    help=f"share of steps on the student's own samples, scored by the teacher (GKD; 0..1; the bare "
                         f"flag: {ON_POLICY_FLAG:g}; default {_D.on_policy:g}, with --for-draft "
                         f"{FOR_DRAFT['on_policy']:g})")
    ds.add_argument("--prompt-tokens", type=int, default=_D.prompt_tokens,
                    help="on-policy on --text windows: the student continues each from its first this many tokens "
                         "(a --prompts-file sequence: from its prompt)")
    ds.add_argument("--for-draft", action="store_true",
                    help="train a speculative draft (DistillSpec): total variation, whose complement is the "
                         "acceptance rate, on the student's own samples half the time, unless --loss / --on-policy say")
    ds.add_argument("--steps", type=int, default=_D.steps)
    ds.add_argument("--batch-size", type=int, default=_D.batch_size, help="sequences a step")
    ds.add_argument("--seq-len", type=int, default=_D.seq_len)
    ds.add_argument("--lr", type=float, default=_D.lr, help="AdamW peak learning rate (warm-up, then cosine to 10%%)")
    ds.add_argument("--warmup", type=int, default=_D.warmup)
    ds.add_argument("--weight-decay", type=float, default=_D.weight_decay)
    ds.add_argument("--grad-clip", type=float, default=_D.grad_clip, help="gradient norm clip (0: none)")
    ds.add_argument("--train-embeddings", action="store_true",
                    help="train the embedding too (with a tied head, the head as well); frozen by default")
    ds.add_argument("--bf16", action="store_true", help="bfloat16 autocast for the student (1.18x on an AVX-512 BF16 CPU; refused where "
                         "the CPU has no bfloat16 matrix instructions, as it would be many times slower)")
    ds.add_argument("--eval-tokens", type=int, default=_D.eval_tokens, help="tokens of --text held out")
    ds.add_argument("--eval-every", type=int, default=_D.eval_every, help="held-out perplexity and KL every N steps")
    ds.add_argument("--checkpoint-every", type=int, default=_D.checkpoint_every)
    ds.add_argument("--resume", type=Path, default=None,
                    help="continue a run from its checkpoint (a checkpoints/step-N directory or the run's --out)")
    ds.add_argument("--seed", type=int, default=_D.seed)
    ds.add_argument("--device", default="cpu", help="where teacher and student run: cpu, cuda or cuda:N (default cpu)")


def layer_list(spec: str | None) -> list[int] | None:
    """"0,2,4" or "0-9" or a mix ("0-3,8,10-11") as a sorted list; None for None."""
    if spec is None:
        return None
    layers: list[int] = []
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            layers.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
    except ValueError:
        raise UserError(f"--student-layers takes layer numbers like 0,2,4 or 0-9; got {spec!r}") from None
    return layers


def cmd_distill(args: argparse.Namespace) -> int:
    from brisk.engine.distill_job import DistillJob, distill

    preset = FOR_DRAFT if args.for_draft else {"loss": _D.loss, "on_policy": _D.on_policy}
    cfg = DistillConfig(
        loss=args.loss or str(preset["loss"]), steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        temperature=args.temperature, top_k=args.top_k, store_teacher=args.store_teacher,
        on_policy=float(preset["on_policy"]) if args.on_policy is None else args.on_policy,
        prompt_tokens=args.prompt_tokens,
        train_embeddings=args.train_embeddings, bf16=args.bf16, eval_tokens=args.eval_tokens,
        eval_every=args.eval_every, checkpoint_every=args.checkpoint_every, seed=args.seed)
    job = DistillJob(args.teacher, args.out, args.student, layer_list(args.student_layers), args.student_mlp,
                     args.text, args.prompts_file, args.resume, args.chat, args.device)
    report = distill(job, cfg)
    if report["eval"]:
        first, last = report["eval"][0], report["eval"][-1]
        print(f"wrote {args.out}: held-out perplexity {first['ppl']:.3f} -> {last['ppl']:.3f} (teacher "
              f"{report['teacher_held_out_ppl']:.3f}), KL to the teacher {first['kl']:.4f} -> {last['kl']:.4f}, "
              f"top-1 agreement {first['top1']:.3f} -> {last['top1']:.3f}",
              file=sys.stderr)
    else:
        print(f"wrote {args.out} (no held-out evaluation: --eval-tokens 0)", file=sys.stderr)
    print(json.dumps(report), flush=True)
    return 0
