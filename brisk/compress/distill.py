"""Knowledge distillation (`brisk distill`): a student learns the teacher's next-token distributions.

    data (distill_data.py) ──► batch of sequences ──► teacher forward (no grad) ──┐
                                                  └─► student forward (autograd) ─┴─► loss per token
    loss: fkl KL(t || s) (top_k: the teacher's k likeliest tokens, renormalised), rkl KL(s || t)
          (MiniLLM), tvd; at temperature T (fkl scaled by T^2, as Hinton et al.)
    step: AdamW, linear warm-up then cosine to 10% of lr, gradients clipped; a tqdm bar with loss
          and tokens/s; held-out perplexity and KL to the teacher every eval_every steps
    checkpoints: every checkpoint_every steps (student, optimizer, step); `resume` continues bit
          for bit, since every batch and sample is fixed by (seed, step); a checkpoint from another
          run is refused; a non-finite loss stops the run with the last good checkpoint kept
    output: an HF directory (config.json saying how it was made, model.safetensors, tokenizer)
          that `--model DIR` and speculative "draft" load

The teacher's distributions are computed in the loop, every position in full: on this CPU its
forward is a third of a student step, and rkl / tvd need the whole distribution anyway. Forward KL
over the teacher's top k (k <= 20, what the engine's logprobs give) stores them instead: one pass
of brisk's engine over the training sequences (batched, prefix-cached; engine/distill_job.teacher_topk),
kept in OUT/teacher_topk.safetensors, and steps on the corpus skip the teacher's forward.
Both models run brisk's own model code; under autograd the layers take torch's ops (brisk's C++
kernels have no backward: model/layers.py `trains`), and attention is `WholeSequences` (no cache).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from brisk.compress.distill_data import (
    TOPK_FILE,
    Corpus,
    TeacherTopK,
    epoch_order,
    on_policy_step,
    sample_continuations,
    step_generator,
)
from brisk.config import DRAFT_VOCAB_FILE, DistillConfig
from brisk.errors import UserError
from brisk.loader.load import LoadedModel
from brisk.model.attention import WholeSequences
from brisk.model.base import CausalLM

DISTILL_KEY = "brisk_distill"  # config.json: how a distilled directory was made
_EVAL_ROWS = 512  # logit rows at a time in evaluation (a 49k vocabulary: 100 MB each)


def distill_loss(kind: str, student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0,
                 top_k: int = 0) -> torch.Tensor:
    """Mean over rows of the per-token divergence between [rows, vocab] logits."""
    if kind == "fkl" and top_k:
        values, index = teacher.topk(top_k, dim=-1)
        return fkl_top(student, index, values, temperature)
    s = F.log_softmax(student.float() / temperature, dim=-1)
    t = F.log_softmax(teacher.float() / temperature, dim=-1)
    if kind == "fkl":
        return (t.exp() * (t - s)).sum(-1).mean() * temperature ** 2
    if kind == "rkl":
        return (s.exp() * (s - t)).sum(-1).mean()
    if kind == "tvd":
        return 0.5 * (s.exp() - t.exp()).abs().sum(-1).mean()
    raise UserError(f"unknown distillation loss {kind!r}")


def fkl_top(student: torch.Tensor, index: torch.Tensor, values: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Forward KL over the teacher's top k tokens (`index`, with their logits or log-probabilities
    `values`: a row's shift cancels), renormalised among them, at `temperature`, mean over rows."""
    s = F.log_softmax(student.float() / temperature, dim=-1)
    p = F.log_softmax(values.float() / temperature, dim=-1)
    return (p.exp() * (p - s.gather(-1, index))).sum(-1).mean() * temperature ** 2


def logits_of(model: CausalLM, seqs: list[list[int]]) -> torch.Tensor:
    """[sum of lengths, vocab] float32 logits of every position of whole sequences (no KV kept;
    differentiable when gradients are on)."""
    device = model.device
    ids = torch.tensor([t for s in seqs for t in s], device=device)
    positions = torch.cat([torch.arange(len(s), device=device) for s in seqs])
    hidden = model(ids, positions, WholeSequences([len(s) for s in seqs], scale=model.config.attn_scale))
    return model.compute_logits(hidden)


@dataclasses.dataclass
class EvalScore:
    ppl: float
    teacher_ppl: float
    kl: float  # mean KL(teacher || student) per token
    tokens: int
    top1: float = 0.0  # share of positions where the student's argmax is the teacher's (a greedy draft's acceptance)
    accept: float = 0.0  # mean 1 - TVD(teacher, student): a draft's acceptance when sampling at temperature 1


@torch.no_grad()
def evaluate(student: CausalLM, teacher: CausalLM, windows: list[list[int]]) -> EvalScore:
    """The student's and the teacher's perplexity on held-out windows, and the student's KL to the
    teacher there, with the two per-token acceptance rates a draft of this student would get."""
    nll, t_nll, kl, same, accept, n = 0.0, 0.0, 0.0, 0, 0.0, 0
    for w in windows:
        targets = torch.tensor(w[1:], device=student.device)
        s_logits, t_logits = logits_of(student, [w])[:-1], logits_of(teacher, [w])[:-1]
        for start in range(0, len(targets), _EVAL_ROWS):
            rows = slice(start, start + _EVAL_ROWS)
            s = F.log_softmax(s_logits[rows], dim=-1)
            t = F.log_softmax(t_logits[rows], dim=-1)
            nll -= float(s.gather(-1, targets[rows, None]).sum())
            t_nll -= float(t.gather(-1, targets[rows, None]).sum())
            kl += float((t.exp() * (t - s)).sum())
            same += int((s.argmax(-1) == t.argmax(-1)).sum())
            accept += float(torch.minimum(s.exp(), t.exp()).sum())
        n += len(targets)
    d = max(1, n)
    return EvalScore(math.exp(nll / d), math.exp(t_nll / d), kl / d, n, same / d, accept / d)


@dataclasses.dataclass
class Run:
    """What makes two runs the same run (a checkpoint resumes only its own)."""

    teacher: str
    student: str
    student_shape: dict[str, Any]
    data: str
    config: DistillConfig

    def fingerprint(self) -> dict[str, Any]:
        cfg = dataclasses.asdict(self.config)
        # a resumed run may go further, look more often, or store the teacher (a speed option)
        for free in ("steps", "eval_every", "checkpoint_every", "store_teacher"):
            cfg.pop(free)
        return {"teacher": self.teacher, "student": self.student, "student_shape": self.student_shape,
                "data": self.data, "config": cfg}


class Distiller:
    """One run: the student's parameters trained toward the teacher on `corpus`."""

    def __init__(self, teacher: LoadedModel, student: LoadedModel, corpus: Corpus, run: Run, out: Path) -> None:
        self.teacher, self.student, self.corpus, self.run, self.out = teacher, student, corpus, run, out
        self.cfg = run.config
        for p in teacher.model.parameters():
            p.requires_grad_(False)
        self.params = [p for name, p in student.model.named_parameters()
                       if self.cfg.train_embeddings or not name.startswith("embed_tokens")]
        for p in self.params:
            p.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(self.params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self.step = 0
        self.resumed_from: Path | None = None  # the checkpoint this session started from
        self.history: list[dict[str, Any]] = []  # evaluations
        self.tokens_seen = 0
        self.train_seconds = 0.0  # in train_step, this session (evaluations and checkpoints not counted)
        self._orders: dict[int, list[int]] = {}
        self.stored: TeacherTopK | None = None  # the teacher's top k per training position (`store_teacher`)

    # ---------------------------------------------------------------------------- one step
    def indices(self, step: int) -> list[int]:
        """The training sequences step `step` draws: the next `batch_size` of the epoch's order."""
        cfg, n = self.cfg, len(self.corpus.train)
        out = []
        for j in range(cfg.batch_size):
            k = step * cfg.batch_size + j
            epoch = k // n
            if epoch not in self._orders:
                self._orders = {epoch: epoch_order(n, epoch, cfg.seed)}
            out.append(self._orders[epoch][k % n])
        return out

    def batch(self, step: int) -> list[list[int]]:
        """Step `step`'s sequences: its `indices`, or on on-policy steps the student's own
        continuations of their prompts (a prompts file's lines, else their first `prompt_tokens` tokens)."""
        cfg, lens = self.cfg, self.corpus.prompt_lens
        index = self.indices(step)
        seqs = [self.corpus.train[i] for i in index]
        cut = [lens[i] if lens is not None else cfg.prompt_tokens for i in index]
        if on_policy_step(cfg.seed, step, cfg.on_policy):
            prompts = [s[:c] for s, c in zip(seqs, cut)]
            seqs = sample_continuations(self.student.model, prompts, max(len(s) for s in seqs),
                                        step_generator(cfg.seed, step))
        return seqs

    def lr_at(self, step: int) -> float:
        cfg = self.cfg
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        done = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done))))

    def train_step(self) -> float:
        """One optimizer step; returns its loss. A non-finite loss raises before anything changes."""
        started = time.perf_counter()
        cfg, seqs = self.cfg, self.batch(self.step)
        stored = self.stored if self.stored is not None and not on_policy_step(cfg.seed, self.step, cfg.on_policy) \
            else None
        teacher = None
        if stored is None:  # on-policy sequences are new: the teacher scores them here
            with torch.no_grad():
                teacher = logits_of(self.teacher.model, seqs)
        autocast = torch.autocast(self.student.model.device.type, dtype=torch.bfloat16) if cfg.bf16 \
            else contextlib.nullcontext()
        with autocast:
            student = logits_of(self.student.model, seqs)
        if stored is not None:
            ids, logprobs = stored.rows(self.indices(self.step), student.device)
            loss = fkl_top(student, ids, logprobs, cfg.temperature)
        else:
            assert teacher is not None
            loss = distill_loss(cfg.loss, student, teacher, cfg.temperature, cfg.top_k)
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"a loss of {value}")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # a finite loss can still have infinite gradients (an overflow in backward): stepping on them
        # would make the weights NaN and the next checkpoint one that looks good
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip or math.inf))
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"a gradient norm of {norm}")
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        self.optimizer.step()
        self.step += 1
        self.tokens_seen += sum(len(s) for s in seqs)
        self.train_seconds += time.perf_counter() - started
        return value

    def evaluate(self) -> dict[str, Any] | None:
        """Score the student on the held-out windows (None: there are none, eval_tokens 0)."""
        if not self.corpus.held_out:
            return None
        score = evaluate(self.student.model, self.teacher.model, self.corpus.held_out)
        entry = {"step": self.step, "ppl": round(score.ppl, 4), "kl": round(score.kl, 5), "tokens": score.tokens,
                 "teacher_ppl": round(score.teacher_ppl, 4), "top1": round(score.top1, 4),
                 "accept": round(score.accept, 4)}
        self.history.append(entry)
        return entry

    # ------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Path:
        """checkpoints/step-N under `out`, written under a temporary name and renamed into place
        (a full disk leaves the previous checkpoint whole); only the last two are kept."""
        root = self.out / "checkpoints"
        final, tmp = root / f"step-{self.step:06d}", root / f".step-{self.step:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        weights = {k: v.detach().contiguous() for k, v in self.student.model.state_dict().items()
                   if not k.startswith("rope_")}
        state = {"step": self.step, "tokens_seen": self.tokens_seen, "history": self.history,
                 "run": self.run.fingerprint()}
        with _writing(f"checkpoint {final}", [tmp], "the checkpoints before it are whole: --resume from the last"):
            tmp.mkdir(parents=True)
            save_file(weights, str(tmp / "student.safetensors"))
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(p for p in root.glob("step-*") if p != final)[:-1]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load_checkpoint(self, path: Path) -> None:
        """Continue from `path` (a checkpoint directory, or a run's output directory: its latest)."""
        path = latest_checkpoint(path)
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
        mine = self.run.fingerprint()
        for key, theirs in state.get("run", {}).items():
            if theirs != mine.get(key):
                raise UserError(f"--resume {path} is a checkpoint of another run: its {key} is {theirs!r}, this "
                                 f"run's is {mine.get(key)!r}; resume with the options it was started with, or start "
                                 "afresh without --resume")
        weights = load_file(str(path / "student.safetensors"))
        missing, unexpected = self.student.model.load_state_dict(weights, strict=False)
        if unexpected or [m for m in missing if not m.startswith("rope_")]:
            raise UserError(f"--resume {path}: its student does not fit this student's shape")
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        self.step, self.tokens_seen, self.history = state["step"], state["tokens_seen"], state["history"]
        self.resumed_from = path


def latest_checkpoint(path: Path) -> Path:
    if (path / "state.json").is_file():
        return path
    found = sorted((path / "checkpoints").glob("step-*")) if path.is_dir() else []
    if not found:
        raise UserError(f"--resume {path}: no checkpoint there (a checkpoints/step-N directory of a distill run, "
                         "or a run's --out directory)")
    return found[-1]


# ------------------------------------------------------------------------------------- driver
def check_bf16(bf16: bool, device: torch.device) -> None:
    """bfloat16 autocast pays only where the hardware multiplies bfloat16 (AVX-512 BF16 or AMX on
    CPU): elsewhere torch's bfloat16 GEMM is a scalar loop on one thread."""
    if bf16 and device.type == "cpu" and not _cpu_bf16_matmul():
        raise UserError("--bf16: this CPU has no bfloat16 matrix instructions (AVX-512 BF16 or AMX), so torch "
                        "multiplies bfloat16 in a scalar fallback (measured on an AVX2 CPU: a training step took "
                        "296 s against 21 s in float32); drop --bf16")


def _cpu_bf16_matmul() -> bool:
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return True if probe is None else bool(probe())  # an unknown torch: let it run as asked


def run_training(trainer: Distiller, progress: bool) -> dict[str, Any]:
    """Train to `cfg.steps` (evaluating, checkpointing), then write the student: the report."""
    from tqdm import tqdm

    cfg, started, first, first_tokens = trainer.cfg, time.perf_counter(), trainer.step, trainer.tokens_seen
    if not trainer.history or trainer.history[-1]["step"] != trainer.step:
        trainer.evaluate()  # where the student starts
    bar = tqdm(total=cfg.steps, initial=trainer.step, desc="distill", disable=not progress, unit="step")
    last_good = trainer.resumed_from
    while trainer.step < cfg.steps:
        try:
            loss = trainer.train_step()
        except FloatingPointError as e:
            bar.close()
            kept = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was written yet"
            raise UserError(f"distillation stopped at step {trainer.step + 1}: {e.args[0]} (diverged; the weights "
                             f"were not updated); {kept}; lower --lr or use another loss, and --resume from it") from None
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{(trainer.tokens_seen - first_tokens) / trainer.train_seconds:.0f}",
                        refresh=False)
        if trainer.step % cfg.eval_every == 0 or trainer.step == cfg.steps:
            entry = trainer.evaluate()
            if entry is not None:
                bar.write(f"step {trainer.step}: held-out ppl {entry['ppl']:.3f}, KL to the teacher {entry['kl']:.4f}, "
                          f"top-1 agreement {entry['top1']:.3f}, 1 - TVD {entry['accept']:.3f}")
        if trainer.step % cfg.checkpoint_every == 0 or trainer.step == cfg.steps:
            last_good = trainer.save_checkpoint()
    bar.close()
    seconds = time.perf_counter() - started
    return write_student(trainer, seconds, trainer.tokens_seen - first_tokens)


def write_student(trainer: Distiller, seconds: float, tokens_now: int) -> dict[str, Any]:
    """The student as an HF directory in `out` (files written under temporary names, then renamed),
    with the ranking of its training tokens a draft vocabulary is cut from (FR-Spec).
    `seconds`: this session's wall time; `tokens_now`: the tokens it trained on."""
    from brisk.compress.prune import PRUNING_KEY, model_params, pruning_of
    from brisk.loader.convert import write_tokenizer_files
    from brisk.loader.hf_loader import hf_config_dict

    cfg, student, out = trainer.cfg, trainer.student, trainer.out
    report = {
        "teacher": trainer.run.teacher, "student": trainer.run.student, "data": trainer.corpus.source,
        **dataclasses.asdict(cfg), "params": model_params(student.config),
        "teacher_params": model_params(trainer.teacher.config), "tokens_trained": trainer.tokens_seen,
        "seconds_this_session": round(seconds, 1), "train_seconds_this_session": round(trainer.train_seconds, 1),
        "train_tokens_per_s": round(tokens_now / trainer.train_seconds, 1) if trainer.train_seconds else None,
        "teacher_held_out_ppl": trainer.history[-1]["teacher_ppl"] if trainer.history else None,
        "teacher_top_k": _stored_report(trainer),
        "eval": trainer.history,
    }
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config_dict(student.config, "float32")
    config[DISTILL_KEY] = report
    cut = pruning_of(student.source.path) if student.source.kind == "hf" else None
    if cut is not None:  # a pruned student keeps its pruning report: `eval ppl` then compares with its source
        config[PRUNING_KEY] = cut
    names = ["model.safetensors", "config.json", DRAFT_VOCAB_FILE]
    tmps = [out / f".{name}.tmp" for name in names]
    tok_tmp = out / ".tokenizer.tmp"  # the tokenizer's files, written together, moved in after the rest
    shutil.rmtree(tok_tmp, ignore_errors=True)
    tensors, counts = student.model.hf_tensors(), token_counts(trainer.corpus, student.config.vocab_size)
    with _writing(f"the student in {out}", [*tmps, tok_tmp], f"the last checkpoint under {out / 'checkpoints'} is "
                  "whole: free space, then run again with --resume and the same --steps to write the student"):
        save_file(tensors, str(tmps[0]), metadata={"format": "pt"})
        tmps[1].write_text(json.dumps(config, indent=2) + "\n")
        write_draft_vocab(tmps[2], counts)
        tok_tmp.mkdir()
        write_tokenizer_files(student.tokenizer, student.config, tok_tmp)
    moves = [(tmp, out / name) for tmp, name in zip(tmps, names)] + [(f, out / f.name) for f in tok_tmp.iterdir()]
    for tmp, final in moves:  # every file whole before any replaces an older one
        os.replace(tmp, final)
    tok_tmp.rmdir()
    return report


def _stored_report(trainer: Distiller) -> dict[str, Any] | None:
    """What the stored top k holds and cost (None: the teacher ran in every step)."""
    stored = trainer.stored
    if stored is None:
        return None
    nbytes = stored.ids.numel() * 4 + stored.logprobs.numel() * 4  # as the file keeps them: int32, float32
    return {"k": stored.k, "positions": int(stored.ids.shape[0]), "mib": round(nbytes / 2**20, 2),
            "engine_seconds": round(stored.seconds, 1), "file": TOPK_FILE}


@contextlib.contextmanager
def _writing(what: str, tmps: list[Path], kept: str) -> Iterator[None]:
    """Writes under temporary names: a failed write (a full disk, a lost mount) removes them and
    becomes a UserError saying what was being written and what is still whole. The block only
    writes, so whatever its writers raise is a failed write: an OSError from Python's own files,
    a SafetensorError from safetensors, a RuntimeError from torch.save (both seen on a full disk)."""
    try:
        yield
    except (OSError, SafetensorError, RuntimeError) as exc:
        for tmp in tmps:
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        raise UserError(f"writing {what} failed ({reason}); nothing half-written was left: {kept}") from None


def write_draft_vocab(path: Path, counts: torch.Tensor) -> None:
    """Every token id, most frequent first (ties: lower id first), with its count: the ranking a
    draft vocabulary's N tokens are read from (speculative draft_vocab)."""
    values = counts.tolist()
    order = sorted(range(len(values)), key=lambda t: (-values[t], t))
    path.write_text(json.dumps({"ranked": order, "counts": values}), encoding="utf-8")


def token_counts(corpus: Corpus, vocab_size: int) -> torch.Tensor:
    """How often each token occurs in the training sequences (after their prompts, where known):
    what a draft trained on them will mostly be asked to write."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for i, seq in enumerate(corpus.train):
        start = corpus.prompt_lens[i] if corpus.prompt_lens is not None else 0
        counts += torch.bincount(torch.tensor(seq[start:], dtype=torch.int64), minlength=vocab_size)[:vocab_size]
    return counts
