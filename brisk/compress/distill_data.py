"""What `brisk distill` trains on, and the students it can start from (compress/distill.py runs the loop).

Data:
- `--text FILE`: the file's tokens cut into windows of `seq_len`; its first `eval_tokens` tokens
  are held out (scored, never trained on), so `brisk eval ppl --max-tokens N` on the same file
  with N <= eval_tokens measures held-out text.
- `--prompts-file F`: prompts as `brisk generate` reads them (a prompt a line, or JSON lines with
  "prompt" or "messages"); the teacher writes a sampled continuation of each with
  brisk's engine (batched, prefix-cached), prompt + continuation is a training sequence
  (sequence-level distillation, DistillSpec's data for drafts). With `--chat` each line is a user
  turn rendered by the teacher's chat template (a chat model's draft learns answers, not raw text).
  Without `--text` the last 5% of them (at least one) are held out.
- on-policy steps: the student samples the rest of a sequence from its prompt (a prompts file's
  line; in text windows the first `prompt_tokens` tokens) at temperature 1, the teacher scores what
  the student wrote (GKD).

Students: any model brisk loads (a `brisk prune` directory: recovery), or one derived from the
teacher: chosen teacher layers (`student_layers`) and, optionally, every layer's MLP narrowed to
`student_mlp` channels, kept by weight magnitude (the pruning code's slicer cuts them).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from brisk.config import DistillConfig, ModelConfig
from brisk.errors import UserError
from brisk.loader.load import LoadedModel, model_config_of, read_checkpoint
from brisk.loader.tokenizer import Tokenizer
from brisk.model.base import CausalLM, sample_batch
from brisk.model.registry import build_model

# Text whose tokens the teacher's and the student's tokenizers must agree on: letters, digits,
# code, whitespace runs, accents and CJK, emoji (byte fallback).
_PROBE_TEXT = "The quick brown fox, 1984 & co.\n\tdef f(x): return x**2  # naïve café 東京 🙂 ÅÄÖ"


@dataclass
class Corpus:
    """Training sequences and held-out ones (token ids); `source` says where they came from."""

    train: list[list[int]]
    held_out: list[list[int]]
    source: str
    prompt_lens: list[int] | None = None  # per training sequence, when it is a prompt and its continuation

    @property
    def train_tokens(self) -> int:
        return sum(len(s) for s in self.train)


def check_tokenizers(teacher: LoadedModel, student: LoadedModel) -> None:
    """The student must read and write the teacher's tokens: same vocabulary, same ids."""
    t, s = teacher.tokenizer, student.tokenizer
    problems = []
    if teacher.config.vocab_size != student.config.vocab_size:
        problems.append(f"logits over {student.config.vocab_size} tokens, the teacher's over {teacher.config.vocab_size}")
    if t.vocab_size != s.vocab_size:
        problems.append(f"a {s.vocab_size}-token vocabulary, the teacher's has {t.vocab_size}")
    elif t.encode(_PROBE_TEXT, add_special_tokens=False) != s.encode(_PROBE_TEXT, add_special_tokens=False):
        problems.append("another tokenization of the same text")
    if problems:
        raise UserError(f"the student's tokenizer differs from the teacher's ({'; '.join(problems)}): distillation "
                         "compares their distributions token by token, so the student must use the teacher's "
                         "tokenizer (derive one from the teacher with --student-layers / --student-mlp)")


def text_corpus(tokenizer: Tokenizer, path: Path, cfg: DistillConfig) -> Corpus:
    """Windows of `seq_len` tokens; the first `eval_tokens` tokens held out in windows of the same size."""
    if not path.is_file():
        raise UserError(f"distill text {path} is not a file")
    ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
    held, rest = ids[:cfg.eval_tokens], ids[cfg.eval_tokens:]
    train = _windows(rest, cfg.seq_len)
    if len(train) < cfg.batch_size:
        raise UserError(f"distill text {path} has {len(ids)} tokens: after the {len(held)} held out for evaluation "
                         f"(eval_tokens) it gives {len(train)} windows of {cfg.seq_len} tokens, fewer than one step's "
                         f"{cfg.batch_size}; give a longer text, or lower seq_len, batch_size or eval_tokens")
    held_windows = _windows(held, cfg.seq_len)
    if cfg.eval_tokens and not held_windows:
        raise UserError(f"eval_tokens {cfg.eval_tokens} holds out less than one window of seq_len {cfg.seq_len} "
                         f"tokens, so nothing would be evaluated: hold out at least {cfg.seq_len}, or 0 to train "
                         "without held-out evaluation")
    return Corpus(train, held_windows, f"{path} ({len(ids)} tokens, first {len(held)} held out)")


def _windows(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i:i + size] for i in range(0, len(ids) - size + 1, size)]


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
    from brisk.engine.prompts_file import read_prompts_file  # the one prompts-file format

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
    from brisk.engine.llm import LLM
    from brisk.request import SamplingParams

    llm = LLM(teacher_ref, max_model_len=cfg.seq_len, seed=cfg.seed, device=device)
    params = [SamplingParams(max_tokens=cfg.seq_len - len(p), temperature=1.0, seed=cfg.seed + i, ignore_eos=True)
              for i, p in enumerate(prompts)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    return [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]


def sample_continuations(model: CausalLM, prompts: list[list[int]], total: int,
                         generator: torch.Generator) -> list[list[int]]:
    """Each prompt continued to `total` tokens by `model`, sampled at temperature 1 (on-policy
    data), through a contiguous KV cache (model.base.sample_batch)."""
    outs = sample_batch(model, prompts, [total - len(p) for p in prompts], generator)
    return [(list(p) + out)[:total] for p, out in zip(prompts, outs)]


def derived_student(teacher: LoadedModel, layers: list[int] | None, mlp: int | None) -> LoadedModel:
    """A student cut from the teacher: the teacher layers `layers` (all when None), each MLP
    narrowed to its `mlp` channels of largest weight norm (||gate_j|| ||up_j|| ||down_:j||); float32."""
    from brisk.compress.prune import Plan, pruned_config, slice_tensors

    cfg = teacher.config
    n = cfg.num_hidden_layers
    keep = list(range(n)) if layers is None else layers
    if not keep or sorted(set(keep)) != keep or keep[0] < 0 or keep[-1] >= n:
        raise UserError(f"--student-layers must be teacher layers in increasing order, each from 0 to {n - 1}; "
                         f"got {layers}")
    plan = Plan(keep, {}, {})
    if mlp is not None:
        widest = min(cfg.intermediate(i) for i in keep)
        if not 1 <= mlp <= widest:
            raise UserError(f"--student-mlp must be from 1 to the teacher's MLP width {widest}; got {mlp}")
        plan = Plan(keep, {i: list(range(cfg.kv_heads(i))) for i in keep},
                    {i: _strongest_channels(teacher.model, i, mlp) for i in keep})
    _, _, weights = read_checkpoint(teacher.source)
    tensors = slice_tensors(cfg, weights, plan, None, False)
    student_cfg = pruned_config(cfg, plan, False)
    model = build_model(student_cfg, torch.float32, max_positions=teacher.model.max_positions)
    with torch.no_grad():
        model.load_weights(tensors.items())
    return LoadedModel(model.to(teacher.model.device).eval(), teacher.tokenizer, student_cfg, teacher.source)


def _strongest_channels(model: CausalLM, layer: int, keep: int) -> list[int]:
    mlp = model.layers[layer].mlp  # type: ignore[index]
    gate, up = mlp.gate_up_proj.weight.float().chunk(2, dim=0)  # [inter, hidden] each
    score = gate.norm(dim=1) * up.norm(dim=1) * mlp.down_proj.weight.float().norm(dim=0)
    return sorted(score.topk(keep).indices.tolist())


def describe_student(cfg: ModelConfig) -> dict[str, object]:
    """The student's shape, for reports and the run's fingerprint."""
    return {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
            "mlp": sorted({cfg.intermediate(i) for i in range(cfg.num_hidden_layers)}),
            "kv_heads": sorted({cfg.kv_heads(i) for i in range(cfg.num_hidden_layers)})}


def epoch_order(n: int, epoch: int, seed: int) -> list[int]:
    """The training sequences' order in `epoch`: a permutation fixed by (seed, epoch), so a resumed
    run sees the same batches."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=gen).tolist()


def step_generator(seed: int, step: int) -> torch.Generator:
    """The on-policy sampler's generator for `step` (fixed by seed and step, for resume)."""
    return torch.Generator().manual_seed(seed * 7_919 + step * 104_729 + 1)


def on_policy_step(seed: int, step: int, share: float) -> bool:
    """Whether `step` trains on the student's own samples (a fixed draw per step, for resume)."""
    if share <= 0:
        return False
    gen = torch.Generator().manual_seed(seed * 31 + step * 65_537 + 2)
    return float(torch.rand(1, generator=gen)) < share


# ------------------------------------------------------------------------ the teacher's top k, stored
TOPK_FILE = "teacher_topk.safetensors"
_TOPK_BATCH = 32  # sequences a generate call: the engine's prompt logprobs are Python objects until stored


@dataclass
class TeacherTopK:
    """The teacher's k likeliest next tokens and their log-probabilities at every position of every
    training sequence, computed once by brisk's engine (batched, prefix-cached) instead of a teacher
    forward in every step: what forward KL over the top k needs, in memory and on disk."""

    ids: torch.Tensor  # [positions, k] int64
    logprobs: torch.Tensor  # [positions, k] float32, temperature 1, most likely first
    offsets: list[int]  # sequence i's positions are offsets[i] .. offsets[i + 1] - 1
    seconds: float = 0.0  # the engine's pass (0: read from the file)

    @property
    def k(self) -> int:
        return int(self.ids.shape[1])

    def rows(self, index: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of sequences `index`, in order (as logits_of lays their positions out)."""
        parts = [slice(self.offsets[i], self.offsets[i + 1]) for i in index]
        ids = torch.cat([self.ids[p] for p in parts]).to(device)
        return ids, torch.cat([self.logprobs[p] for p in parts]).to(device)


def teacher_topk(teacher_ref: str, seqs: list[list[int]], k: int, device: str = "cpu",
                 cache: Path | None = None) -> TeacherTopK:
    """Every position's top `k` of the teacher (dequantized, as the loop's teacher) over `seqs`: the
    engine's prompt logprobs for positions 0 .. L-2 and a one-token generation's logprobs for L-1.
    `cache`: a safetensors file keeping them, reused when the teacher, k and sequences are the same."""
    import time

    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file

    from brisk.engine.llm import LLM
    from brisk.request import SamplingParams

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
    # a KV pool for one batch, not the default's gigabytes: its blocks are reused batch after batch
    # instead of a fresh page written for every token (a page fault each; 3.2 of 14 s here when not)
    per_token = 2 * 4 * cfg.head_dim * sum(cfg.kv_heads(i) for i in range(cfg.num_hidden_layers))  # float32
    pool = 1.25 * _TOPK_BATCH * longest * per_token / 2**30
    llm = LLM(teacher_ref, max_model_len=longest, device=device, dequantize=True, enable_prefix_caching=False,
              kv_cache_memory_gib=max(pool, 0.01))
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
