"""Small trained heads on the target's hidden states, shared by Medusa and early exit.

Each head is one residual block in front of the target's own (frozen) LM head:

    head_k(h) = h + SiLU(W_k h + b_k)          logits_k = lm_head(head_k(h))

(or its sequential form, which also reads the drafted tokens; see ResidualHeads).
W_k and b_k start at zero, so an untrained head is exactly the LM head. Sharing the LM head keeps
a head at hidden^2 parameters (0.33 M for SmolLM2-135M) instead of a vocabulary-sized matrix.
Medusa: K heads on the final hidden state, head k guessing the token k+1 places after the one the
LM head predicts. Early exit: one head on the normed hidden state after `exit_layer` layers.

Files (`brisk train-heads`) are safetensors with the kind, sizes and base model in the metadata,
checked on load against the model they are used with.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from brisk.config import DRAFT_VOCAB_FILE
from brisk.errors import UserError
from brisk.model.base import CausalLM

KINDS = ("medusa", "early_exit")


class ResidualHeads(nn.Module):
    """K residual blocks. Parallel (Medusa): head k reads the hidden state h alone. Sequential
    (Hydra-style, `sequential=True`): head k also reads the embedding of the token before the one
    it guesses and the previous head's output, so the chain knows which tokens were drafted:

        g_0 = h,   g_k = g_(k-1) + SiLU(W_k [g_(k-1); emb(x_(t+k))] + b_k),   logits_k = lm_head(g_k)
    """

    def __init__(self, hidden_size: int, num_heads: int, dtype: torch.dtype = torch.float32,
                 sequential: bool = False) -> None:
        super().__init__()
        self.sequential = sequential
        width = 2 * hidden_size if sequential else hidden_size
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size, width, dtype=dtype))  # [K, out, in]
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden_size, dtype=dtype))

    @property
    def num_heads(self) -> int:
        return self.weight.shape[0]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Parallel heads: [rows, hidden] -> [rows, K, hidden]."""
        assert not self.sequential, "sequential heads run one at a time (head())"
        inner = torch.einsum("rh,koh->rko", h, self.weight) + self.bias  # [rows, K, hidden]
        return h.unsqueeze(1) + F.silu(inner)

    def head(self, k: int, g: torch.Tensor, emb: torch.Tensor | None = None) -> torch.Tensor:
        """Head k on [rows, hidden] (+ the previous token's embedding [rows, hidden] when sequential)."""
        x = torch.cat([g, emb], dim=-1) if self.sequential else g  # [rows, in]
        assert emb is not None or not self.sequential
        return g + F.silu(F.linear(x, self.weight[k], self.bias[k]))


class DraftVocab:
    """The tokens drafts are chosen among (FR-Spec's frequency-ranked subset): the LM head rows of
    the most frequent tokens, copied once. A draft's projection then reads a fraction of the
    vocabulary matrix; verification still scores the full vocabulary, so a token outside the subset
    is simply never drafted (nothing is lost but acceptance). A group-quantized head (int4's and
    GGUF's 8-bit heads) keeps its rows in their stored format: the same values, N / vocab of the
    bytes; any other head is copied in float."""

    def __init__(self, token_ids: torch.Tensor, model: CausalLM, head: torch.nn.Module | None = None) -> None:
        """`head`: a module over these rows to project with (a quantized copy) instead of `head_subset`'s."""
        self.vocab_size = model.config.vocab_size
        self.cap = model.config.final_logit_softcapping
        self.token_ids = token_ids.to(model.device)  # [N] long
        self.head = head if head is not None else model.head_subset(self.token_ids)

    @property
    def nbytes(self) -> int:
        """What one projection reads."""
        return sum(t.numel() * t.element_size() for t in [*self.head.parameters(), *self.head.buffers()])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [rows, vocab] float32: the subset's logits, -inf for every other token
        (the argmax and the sampler's processing then need no index mapping)."""
        sub = self.head(hidden).float()  # [rows, N]; one row: brisk's streaming GEMV
        if self.cap:
            sub = torch.tanh(sub / self.cap) * self.cap
        full = sub.new_full((sub.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.token_ids, sub)


def read_draft_vocab(path: str | Path, size: int, model: CausalLM) -> DraftVocab:
    """The `size` most frequent tokens of a token ranking (`draft_vocab.json`, written by
    `brisk distill` from its training sequences) as `model`'s draft vocabulary; ValueError for a
    missing or foreign file."""
    path = Path(path)
    if path.is_dir():
        path = path / DRAFT_VOCAB_FILE
    if not path.is_file():
        raise UserError(f"draft vocabulary file {str(path)!r} not found: `brisk distill` writes one "
                         f"({DRAFT_VOCAB_FILE}) beside the student it trains; give its path as \"draft_vocab_file\"")
    try:
        ranked = torch.tensor(json.loads(path.read_text(encoding="utf-8"))["ranked"], dtype=torch.long)
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{str(path)!r} is not a draft vocabulary file written by `brisk distill` ({exc})") from None
    if ranked.dim() != 1 or len(ranked) != model.config.vocab_size or \
            not torch.equal(ranked.sort().values, torch.arange(len(ranked))):
        raise UserError(f"{str(path)!r} is not a ranking of this model's {model.config.vocab_size} tokens")
    if not 1 <= size <= len(ranked):
        raise UserError(f"draft_vocab must be 1..{len(ranked)} tokens, got {size}")
    return DraftVocab(ranked[:size].long().sort().values, model)


def save_heads(path: str | Path, heads: ResidualHeads, kind: str, base_model: str, exit_layer: int | None = None,
               extra: dict[str, str] | None = None, vocab: torch.Tensor | None = None) -> None:
    """`vocab`: the token ids drafts may use (DraftVocab), most frequent first; None: all."""
    assert kind in KINDS
    meta = {"kind": kind, "num_heads": str(heads.num_heads), "hidden_size": str(heads.weight.shape[1]),
            "sequential": str(int(heads.sequential)), "base_model": base_model, **({"exit_layer": str(exit_layer)} if exit_layer is not None else {}),
            **(extra or {})}
    tensors = {"weight": heads.weight.detach().float().contiguous(), "bias": heads.bias.detach().float().contiguous()}
    if vocab is not None:
        tensors["vocab"] = vocab.to(torch.int64).contiguous()
    write_safetensors(path, tensors, meta)


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """Write under a temporary name, then rename: a failed write (a full disk) leaves nothing
    half-written, neither under the real name nor the temporary one, and says so."""
    tmp = Path(f"{path}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(path)
    except (OSError, SafetensorError) as exc:
        tmp.unlink(missing_ok=True)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        raise UserError(f"writing {str(path)!r} failed ({reason}); nothing half-written was left; free space "
                        "or choose another --out, and run again") from None


def read_heads_file(path: Path, kind: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Metadata and tensors of a `brisk train-heads` file of `kind`; UserError for a missing or
    unreadable file or one of another kind."""
    if not path.is_file():
        raise UserError(f"heads file {str(path)!r} not found; write one with `brisk train-heads --kind {kind}`")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's to fix
        raise UserError(f"{str(path)!r} is not a heads file written by `brisk train-heads` ({exc})") from None
    if meta.get("kind") != kind:
        raise UserError(f"{str(path)!r} holds {meta.get('kind') or 'unknown'} heads, not {kind} heads "
                        f"(write them with `brisk train-heads --kind {kind}`)")
    return meta, tensors


def load_heads(path: str | Path, kind: str, model: CausalLM) -> tuple[ResidualHeads, dict[str, str],
                                                                             DraftVocab | None]:
    """Heads of `kind` for `model`, their metadata and their draft vocabulary (None: all tokens),
    from one read of the file; ValueError for a wrong file."""
    path = Path(path)
    meta, tensors = read_heads_file(path, kind)
    hidden_size = model.config.hidden_size
    weight, bias = tensors.get("weight"), tensors.get("bias")
    sequential = meta.get("sequential") == "1"
    width = 2 * hidden_size if sequential else hidden_size
    if weight is None or bias is None or weight.dim() != 3 or weight.shape[1:] != (hidden_size, width):
        raise UserError(f"{str(path)!r}: heads for hidden size {meta.get('hidden_size')}, this model has {hidden_size}")
    heads = ResidualHeads(hidden_size, weight.shape[0], model.dtype, sequential)
    with torch.no_grad():
        heads.weight.copy_(weight)
        heads.bias.copy_(bias)
    return heads.to(model.device).eval().requires_grad_(False), meta, stored_draft_vocab(path, tensors.get("vocab"), model)


def stored_draft_vocab(path: Path, ids: torch.Tensor | None, model: CausalLM) -> DraftVocab | None:
    """A heads file's `vocab` tensor as `model`'s draft vocabulary (None: the file has none)."""
    if ids is None:
        return None
    vocab_size = model.config.vocab_size
    if ids.dim() != 1 or not len(ids) or int(ids.max()) >= vocab_size or int(ids.min()) < 0:
        raise UserError(f"{str(path)!r}: its draft vocabulary does not fit a {vocab_size}-token model")
    return DraftVocab(ids, model)
