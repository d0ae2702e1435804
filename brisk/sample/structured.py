"""Structured outputs: a grammar (JSON schema, any JSON object, regex, choice, Lark/EBNF) enforced
token by token, through llguidance (llama.cpp's and vLLM's grammar engine).

Why llguidance and not xgrammar: both are made for this, but xgrammar's wheel requires
`transformers` and `triton` at run time (brisk keeps transformers out of the engine: it is only
the tests' reference), while llguidance needs nothing beyond its own Rust core and reads the
`tokenizers` JSON brisk's tokenizer already holds.

Per request a `Constraint` holds an `LLMatcher` over the grammar (compiled once per distinct
spec, cached). Each step the sampler asks every constrained row for its allowed-token bitmask and
sets the rest of its logits to -inf; the token drawn then advances the matcher. EOS is allowed only
where the grammar accepts. Logprobs of a constrained row are those of the masked distribution.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import Any

import torch

from brisk.errors import UserError
from brisk.kernels import apply_token_bitmask
from brisk.request import SamplingParams

# llguidance's JSON defaults allow any whitespace between tokens, which a small model can fill
# until max_tokens; OpenAI's structured outputs are compact JSON: the same here
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

def _grammar(spec_json: str) -> str:
    """llguidance's grammar text for one spec (given as its canonical JSON)."""
    import llguidance

    kind, value = next(iter(json.loads(spec_json).items()))
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else json.loads(value) if isinstance(value, str) else value
        if not isinstance(schema, dict):
            raise UserError("structured json must be a JSON schema object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)
    if kind == "regex":
        return llguidance.grammar_from("regex", value)
    if kind == "choice":
        return llguidance.grammar_from("choice", value)
    return llguidance.grammar_from("grammar", value)  # Lark, or llama.cpp's GBNF


class GrammarCompiler:
    """Grammars for one tokenizer: its llguidance tokenizer (built once, ~0.1-1 s for a large
    vocabulary) and every distinct spec's grammar, validated once and cached."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance
        import llguidance.torch

        self._ll, self._ll_torch = llguidance, llguidance.torch
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=eos_token_ids or None)
        self._lock = threading.Lock()  # the server compiles from its request threads
        self._compiled = functools.lru_cache(maxsize=256)(self._compile)
        # llguidance builds its token trie on the first mask (~2 s for 49k tokens): here, once,
        # rather than inside the first constrained request's step
        warm = self.constraint({"regex": "a"})
        warm.fill(self._ll_torch.allocate_token_bitmask(1, vocab_size), 0)

    def _compile(self, spec_json: str) -> str:
        grammar = _grammar(spec_json)
        is_error, messages = self._ll.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise UserError(f"structured output: the grammar does not compile: {messages[0]}")
        return grammar

    def constraint(self, spec: dict[str, Any]) -> Constraint:
        """A fresh matcher for `spec` (ValueError naming what is wrong when it cannot compile)."""
        SamplingParams(structured=spec)  # its shape, with the same message as at the API
        try:
            spec_json = json.dumps(spec, sort_keys=True)
        except TypeError as e:
            raise UserError(f"structured output: the spec is not JSON ({e})") from None
        with self._lock:
            try:
                grammar = self._compiled(spec_json)
            except UserError:
                raise
            except Exception as e:  # llguidance reports schema errors as its own exception types (or ValueError)
                raise UserError(f"structured output: {e}") from None
        return Constraint(self._ll.LLMatcher(self.tokenizer, grammar), self.vocab_size)


class Constraint:
    """One sequence's grammar state: the tokens it allows next, advanced by each token drawn.

    A mask can be computed ahead (`prefetch`, on the engine's mask thread while the forward runs)
    and is then reused by `fill` as long as the matcher has not moved since."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._moves = 0  # tokens consumed: the state a prefetched mask belongs to
        self._ahead: tuple[int, tuple[int, ...], torch.Tensor, int] | None = None  # (moves, drafts, rows, n)
        self._forced: tuple[int, list[int]] | None = None  # (moves, forced tokens from that state)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of an int32 [rows, ceil(vocab / 32)] bitmask: the allowed tokens' bits set."""
        ahead = self._ahead
        if ahead is not None and ahead[0] == self._moves:
            bitmask[row].copy_(ahead[2][0])
            return
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, bitmask, row)

    def fill_ahead(self, drafts: list[int]) -> tuple[torch.Tensor, int]:
        """Masks for speculative verification: ([n + 1, words] bitmask, n), n = how many of
        `drafts` the grammar accepts in a row; row j allows what may follow the first j drafts.
        The draft the grammar refuses (if any) is then refused by its row's mask. The matcher
        ends where it began."""
        ahead = self._ahead
        if ahead is not None and ahead[0] == self._moves and ahead[1] == tuple(drafts):
            return ahead[2], ahead[3]
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

        n = self.matcher.validate_tokens(drafts) if drafts else 0
        rows = allocate_token_bitmask(n + 1, self.vocab_size)
        for j in range(n + 1):
            fill_next_token_bitmask(self.matcher, rows, j)
            if j < n and not self.matcher.consume_token(drafts[j]):
                raise UserError(f"structured output: the grammar refused draft token {drafts[j]} it had validated")
        if n:
            self.matcher.rollback(n)
        return rows, n

    def prefetch(self, drafts: list[int] | None = None) -> None:
        """Compute the next mask (or, with drafts, the verification masks) now, for later use."""
        rows, n = self.fill_ahead(list(drafts or []))
        self._ahead = (self._moves, tuple(drafts or []), rows, n)

    def advance(self, token: int) -> None:
        """The sequence took `token`; ValueError when the grammar forbids it (a bug upstream)."""
        if not self.matcher.consume_token(token):
            reason = (self.matcher.get_error() or "rejected").splitlines()[0]  # the rest is a state dump
            raise UserError(f"structured output: token {token} does not fit the grammar ({reason})")
        self._moves += 1
        self._ahead = None

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces from here (the canonical tokens of the only
        bytes it allows: `{"address": ` after the object opens), without moving the matcher.
        Speculation drafts them: the target still verifies each, so nothing is assumed. Computed
        once per state (the engine asks when planning the step and again when filling drafts)."""
        if limit <= 0:
            return []
        if self._forced is None or self._forced[0] != self._moves:
            self._forced = (self._moves, list(self.matcher.compute_ff_tokens()))
        return self._forced[1][:limit]

    def allows_nothing(self) -> bool:
        """No token fits here, EOS included: the grammar reached a dead end (say, a rule limited
        to so many tokens, or text the vocabulary cannot spell)."""
        from llguidance.torch import allocate_token_bitmask

        if self.matcher.is_error():
            return True
        mask = allocate_token_bitmask(1, self.vocab_size)
        self.fill(mask, 0)
        return not bool(mask.any())

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (only EOS remains)."""
        return bool(self.matcher.is_stopped())


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] logits with every token a [rows, words] bitmask forbids at -inf (a copy)."""
    fast = apply_token_bitmask(logits, bitmask)
    if fast is not None:
        return fast
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32)
    # token t allowed iff bit t % 32 of word t // 32
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)[:, :vocab]
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def mask_logits(logits: torch.Tensor, constraints: list[Constraint | None]) -> torch.Tensor:
    """[rows, vocab] logits with every token a row's constraint forbids at -inf (a copy; rows
    without a constraint unchanged)."""
    from llguidance.torch import allocate_token_bitmask

    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return logits
    bitmask = allocate_token_bitmask(len(rows), logits.shape[-1])  # [len(rows), ceil(vocab / 32)] int32
    for j, i in enumerate(rows):
        constraints[i].fill(bitmask, j)  # type: ignore[union-attr]
    if len(rows) == logits.shape[0]:
        return apply_bitmask(logits, bitmask)
    out = logits.clone()
    index = torch.tensor(rows, device=logits.device)
    out[index] = apply_bitmask(logits[index], bitmask)
    return out


def mask_draft_rows(rows: torch.Tensor, constraint: Constraint, drafts: list[int]) -> torch.Tensor:
    """A request's [1 + k, vocab] verification logits with each row masked by the grammar state
    after the drafts before it. Rows after the first draft the grammar refuses are left as they
    are: verification rejects that draft (its probability is 0), so they are never read."""
    bitmask, n = constraint.fill_ahead(drafts)
    out = rows.clone()
    out[:n + 1] = apply_bitmask(rows[:n + 1], bitmask)
    return out
