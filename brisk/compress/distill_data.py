"""What `brisk distill` trains on, and the students it can start from (compress/distill.py runs the
loop; engine/distill_job.py drives a job, and holds what needs the engine: the teacher's
continuations of a prompts file and its stored top k).

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

from dataclasses import dataclass
from pathlib import Path

import torch

from brisk.config import DistillConfig, ModelConfig
from brisk.errors import UserError
from brisk.loader.load import LoadedModel, read_checkpoint
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
