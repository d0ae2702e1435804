"""`brisk distill`'s driver (engine room: it runs brisk's engine for the teacher's side): load the
teacher and the student, build the training corpus, let the teacher write or score text with the
engine where the job asks, then run compress/distill.py's loop and write the student.

    --text FILE          compress/distill_data.text_corpus: windows of the file
    --prompts-file F     prompts_corpus: the teacher's sampled continuations, batched by the engine
    --store-teacher      teacher_topk: the teacher's top k at every training position, scored once
                         by the engine (prompt logprobs) instead of its forward in every step
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from brisk.compress.distill import Distiller, Run, check_bf16, run_training
from brisk.compress.distill_data import (
    TOPK_FILE,
    Corpus,
    TeacherTopK,
    check_tokenizers,
    derived_student,
    describe_student,
    text_corpus,
)
from brisk.config import CacheConfig, DistillConfig, check_device
from brisk.engine.llm import LLM
from brisk.engine.prompts_file import read_prompts_file  # the one prompts-file format
from brisk.errors import UserError
from brisk.loader.load import load_model, model_config_of
from brisk.loader.tokenizer import Tokenizer
from brisk.request import SamplingParams


@dataclasses.dataclass(frozen=True)
class DistillJob:
    """`brisk distill`'s arguments: who teaches whom, on what, into which directory."""

    teacher: str
    out: Path
    student: str | None = None  # a model reference; None: derived from the teacher
    student_layers: list[int] | None = None
    student_mlp: int | None = None
    text: Path | None = None
    prompts_file: Path | None = None
    resume: Path | None = None
    chat: bool = False  # the prompts file's lines are user turns for the teacher's chat template
    device: str = "cpu"  # where teacher and student run (the same code on CUDA)


def distill(job: DistillJob, cfg: DistillConfig, progress: bool = True) -> dict[str, Any]:
    """Run the job; write the student to `job.out`; return the report (also in its config.json)."""
    _check_job(job)
    check_device(job.device)
    check_bf16(cfg.bf16, torch.device(job.device))
    teacher = load_model(job.teacher, dtype="float32", device=job.device, dequantize=True)
    if job.student is not None:
        student = load_model(job.student, dtype="float32", device=job.device, dequantize=True)
        check_tokenizers(teacher, student)
    else:
        student = derived_student(teacher, job.student_layers, job.student_mlp)
    text = text_corpus(teacher.tokenizer, job.text, cfg) if job.text is not None else None
    corpus = text if job.prompts_file is None else prompts_corpus(
        job.teacher, teacher.tokenizer, job.prompts_file, cfg, text.held_out if text is not None else None, job.chat,
        job.out / "teacher_sequences.json", job.device)
    assert corpus is not None
    student_name = job.student or f"derived from {job.teacher}: layers {job.student_layers or 'all'}, " \
                                   f"mlp {job.student_mlp or 'as the teacher'}"
    run = Run(job.teacher, student_name, describe_student(student.config), corpus.source, cfg)
    trainer = Distiller(teacher, student, corpus, run, job.out)
    if job.resume is not None:
        trainer.load_checkpoint(job.resume)
    if cfg.store_teacher:  # forward KL over the top k: the teacher's, once, instead of in every step
        trainer.stored = teacher_topk(job.teacher, corpus.train, cfg.top_k, job.device, job.out / TOPK_FILE)
    return run_training(trainer, progress)


def _check_job(job: DistillJob) -> None:
    if job.text is None and job.prompts_file is None:
        raise UserError("distill needs training text: --text FILE (windows of it) and/or --prompts-file F (the "
                         "teacher's continuations of its prompts)")
    if job.chat and job.prompts_file is None:
        raise UserError("--chat renders the lines of --prompts-file as chat turns: give --prompts-file too")
    if job.student is not None and (job.student_layers is not None or job.student_mlp is not None):
        raise UserError("--student names a model to train; --student-layers / --student-mlp derive one from the "
                         "teacher instead: give one or the other")
    if job.out.exists() and not job.out.is_dir():
        raise UserError(f"--out {job.out} exists and is not a directory")
    for role, ref in (("--teacher", job.teacher), ("--student", job.student)):
        if ref is not None and Path(ref).is_dir() and Path(ref).resolve() == job.out.resolve():
            raise UserError(f"--out {job.out} is the {role} model's directory: the student would overwrite it; "
                             "write it to another directory")


# ------------------------------------------------------------------------------------ the teacher's side
def prompts_corpus(teacher_ref: str, tokenizer: Tokenizer, path: Path, cfg: DistillConfig,
                   held_out: list[list[int]] | None, chat: bool = False, cache: Path | None = None,
                   device: str = "cpu") -> Corpus:
    """The teacher's sampled continuations of each prompt of `path` up to `seq_len` tokens, written
    by brisk's engine. `path` is a prompts file as `brisk generate` reads it (engine/prompts_file.py:
    a prompt a line, or JSON lines with "prompt" or "messages"; a conversation is rendered by the
    teacher's chat template, and so is every prompt under `chat`). `held_out`: evaluation windows
    from a text (else the last 5% of the sequences). `cache`: a JSON file keeping the continuations,
    reused when the teacher, prompts, template use, `seq_len` and seed are the same (a resumed run
    does not generate again)."""
    if not path.is_file():
        raise UserError(f"distill prompts file {path} is not a file")
    prompts = [item for _, item in read_prompts_file(path)]
    ids = [_prompt_ids(tokenizer, item, chat, path) for item in prompts]
    long = [i for i, p in enumerate(ids) if len(p) >= cfg.seq_len]
    if not prompts or long:
        raise UserError(f"distill prompts file {path}: " + (f"prompt {long[0] + 1} has {len(ids[long[0]])} tokens, "
                         f"not fewer than seq_len {cfg.seq_len}" if long else "no prompt in it (one a line)"))
    key = {"teacher": teacher_ref, "prompts": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
           "seq_len": cfg.seq_len, "seed": cfg.seed}
    kept = json.loads(cache.read_text(encoding="utf-8")) if cache is not None and cache.is_file() else None
    if kept is not None and kept.get("key") == key:
        seqs = kept["sequences"]
    else:
        seqs = _teacher_continuations(teacher_ref, ids, cfg, device)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(cache.name + ".tmp")
            tmp.write_text(json.dumps({"key": key, "sequences": seqs}), encoding="utf-8")
            os.replace(tmp, cache)
    lens = [len(p) for p in ids]
    if held_out is None:
        cut = max(1, len(seqs) // 20)
        if len(seqs) - cut < 1:
            raise UserError(f"distill prompts file {path} has {len(seqs)} prompt(s): give at least 2 (one is held "
                             "out for evaluation), or --text for the held-out text")
        seqs, held_out, lens = seqs[:-cut], seqs[-cut:], lens[:-cut]
    kind = "chat prompts" if chat else "prompts"
    return Corpus(seqs, held_out, f"{path} ({len(prompts)} {kind}, the teacher's continuations to {cfg.seq_len} tokens)",
                  lens)


def _prompt_ids(tokenizer: Tokenizer, item: dict[str, object], chat: bool, path: Path) -> list[int]:
    """One prompts-file item as token ids: raw text to continue, or a conversation (a "messages"
    line, or any prompt under `chat` as a user turn) rendered by the chat template."""
    messages = item.get("messages")
    if messages is None and not chat:
        return tokenizer.encode(str(item["prompt"]).strip())
    if tokenizer.chat_template is None:
        raise UserError(f"the prompts of {path} are conversations for the teacher's chat template (--chat, or "
                         "\"messages\" lines), and the teacher has none: give plain prompts without --chat "
                         "(each is then raw text to continue)")
    if messages is None:
        messages = [{"role": "user", "content": str(item["prompt"]).strip()}]
    return tokenizer.encode_chat(messages)  # type: ignore[arg-type]


def _teacher_continuations(teacher_ref: str, prompts: list[list[int]], cfg: DistillConfig,
                           device: str = "cpu") -> list[list[int]]:
    """Each prompt and the teacher's sampled continuation, `seq_len` tokens in all, batched by the engine."""
    llm = LLM(teacher_ref, max_model_len=cfg.seq_len, seed=cfg.seed, device=device)
    params = [SamplingParams(max_tokens=cfg.seq_len - len(p), temperature=1.0, seed=cfg.seed + i, ignore_eos=True)
              for i, p in enumerate(prompts)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    return [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]


_TOPK_BATCH = 32  # sequences a generate call: the engine's prompt logprobs are Python objects until stored


def teacher_topk(teacher_ref: str, seqs: list[list[int]], k: int, device: str = "cpu",
                 cache: Path | None = None) -> TeacherTopK:
    """Every position's top `k` of the teacher (dequantized, as the loop's teacher) over `seqs`: the
    engine's prompt logprobs for positions 0 .. L-2 and a one-token generation's logprobs for L-1.
    `cache`: a safetensors file keeping them, reused when the teacher, k and sequences are the same."""
    if not 1 <= k <= SamplingParams.MAX_LOGPROBS:
        raise UserError(f"the engine stores a teacher's top 1..{SamplingParams.MAX_LOGPROBS} tokens, got {k}")
    key = {"teacher": teacher_ref, "k": str(k), "sequences": hashlib.sha256(json.dumps(seqs).encode()).hexdigest()}
    if cache is not None and cache.is_file():
        try:
            with safe_open(str(cache), framework="pt") as f:
                if f.metadata() == key:
                    offsets = f.get_tensor("offsets").tolist()
                    return TeacherTopK(f.get_tensor("ids").long(), f.get_tensor("logprobs"), offsets)
        except (OSError, SafetensorError):  # unreadable (cut short by a full disk): computed again
            pass
    cfg = model_config_of(teacher_ref)
    longest = max(len(s) for s in seqs) + 1
    if longest > cfg.max_position_embeddings:
        raise UserError(f"store_teacher scores a sequence's last position by generating one token after it, so "
                         f"seq_len must be below the teacher's context window ({cfg.max_position_embeddings}); lower "
                         "seq_len or drop store_teacher")
    started = time.perf_counter()
    # a KV pool for one batch (and a quarter), not the default's gigabytes: its blocks are reused
    # batch after batch instead of a fresh page written for every token (a page fault each; 3.2 of
    # 14 s here when not)
    blocks = -(-longest // CacheConfig.block_size) * _TOPK_BATCH * 5 // 4
    llm = LLM(teacher_ref, max_model_len=longest, device=device, dequantize=True, enable_prefix_caching=False,
              num_kv_blocks=blocks)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=k, prompt_logprobs=k)
    ids: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for first in range(0, len(seqs), _TOPK_BATCH):
        batch = seqs[first:first + _TOPK_BATCH]
        for seq, out in zip(batch, llm.generate([{"prompt_token_ids": s} for s in batch], params, use_tqdm=False)):
            # entry p of the prompt logprobs is token p given tokens < p: the distribution at p - 1;
            # a missing entry would shift every later row onto another position, so none may be
            prompt = (out.prompt_logprobs or [])[1:]
            generated = out.outputs[0].logprobs or []
            if len(prompt) != len(seq) - 1 or any(lp is None for lp in prompt) or len(generated) != 1:
                raise RuntimeError(f"the engine returned {len(prompt)} prompt logprobs and {len(generated)} "
                                   f"generated for a {len(seq)}-token sequence")
            tops = [lp.top for lp in prompt] + [generated[0].top]  # type: ignore[union-attr]
            ids.append(torch.tensor([[t for t, _ in top] for top in tops], dtype=torch.long))
            values.append(torch.tensor([[v for _, v in top] for top in tops], dtype=torch.float32))
    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s))
    stored = TeacherTopK(torch.cat(ids), torch.cat(values), offsets, time.perf_counter() - started)
    del llm
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(cache.name + ".tmp")
        try:
            save_file({"ids": stored.ids.int(), "logprobs": stored.logprobs,
                       "offsets": torch.tensor(offsets, dtype=torch.int64)}, str(tmp), metadata=key)
            os.replace(tmp, cache)
        except (OSError, SafetensorError):  # a full disk: the run goes on from memory, and a later
            tmp.unlink(missing_ok=True)  # run computes them again
    return stored
