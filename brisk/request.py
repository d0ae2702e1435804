"""Plain-Python request types: what a user asks for and why a generation ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar

from brisk.config import MAX_LOGPROBS
from brisk.errors import InvalidRequest


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached, or the context window is full
    GRAMMAR = "grammar"  # structured output: the grammar allows no token here (a dead end); the text so far

    def __str__(self) -> str:
        return self.value


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _structured_ok(spec: object) -> bool:
    """The shape of `SamplingParams.structured` (the grammar itself is checked when compiled)."""
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in STRUCTURED_KINDS:
        return False
    kind, value = next(iter(spec.items()))
    if kind == "choice":
        return isinstance(value, list) and bool(value) and all(isinstance(c, str) and c for c in value)
    if kind in ("regex", "grammar"):
        return isinstance(value, str) and bool(value)
    if kind == "json":
        return isinstance(value, (dict, str))
    return value is True


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Values are checked at construction (ValueError)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    min_p: float = 0.0  # drop tokens whose probability is below min_p * (the top token's probability)
    repetition_penalty: float = 1.0  # HF style, over prompt + output tokens; 1.0 = off
    presence_penalty: float = 0.0  # OpenAI style, over output tokens only
    frequency_penalty: float = 0.0  # OpenAI style, over output tokens only
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    logprobs: int | None = None  # return the sampled token's logprob, rank and the top-N; None = off
    prompt_logprobs: int | None = None  # same for every prompt token (given the tokens before it)
    n: int = 1  # completions per prompt; the engine fans a request out into n siblings
    # Output constrained to a grammar, token by token (sample/structured.py): exactly one of
    # {"json": schema}, {"json_object": True}, {"regex": str}, {"choice": [str, ...]}, {"grammar": Lark or GBNF}
    structured: dict[str, Any] | None = None

    MAX_LOGPROBS: ClassVar[int] = MAX_LOGPROBS  # most top-N logprobs a request may ask for (sampled or prompt tokens)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (self._is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (self._in_range(self.temperature, 0, float("inf")), "temperature",
             f"temperature must be a number >= 0, got {self.temperature!r}"),
            (self._in_range(self.top_p, 0, 1) and self.top_p > 0, "top_p", f"top_p must be in (0, 1], got {self.top_p!r}"),
            # top_k above the vocabulary keeps every token (the sampler clamps it); no upper bound needed
            (self._is_int(self.top_k) and self.top_k >= 0, "top_k",
             f"top_k must be 0 (off), -1 (off) or a positive integer, got {self.top_k!r}"),
            (self.seed is None or (self._is_int(self.seed) and 0 <= self.seed < 2**63), "seed",
             f"seed must be an integer in [0, 2**63), got {self.seed!r}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop must be a non-empty string or a list of them"),
            (all(self._is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "stop_token_ids must be non-negative integers"),
            (self._is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens!r}"),
        ]
        for ok, param, message in checks + self._extra_checks():
            if not ok:
                raise InvalidRequest(message, param)

    def _extra_checks(self) -> list[tuple[bool, str, str]]:
        """Checks for the penalty / bias / logprob / fan-out fields (safe on values of the wrong type)."""
        if isinstance(self.logit_bias, dict):  # JSON object keys arrive as strings: accept "123"
            self.logit_bias = {int(k) if isinstance(k, str) and k.strip().isdigit() else k: v
                               for k, v in self.logit_bias.items()}
        bias = self.logit_bias if isinstance(self.logit_bias, dict) else {}
        bad_keys = [k for k in bias if not self._is_int(k) or k < 0]
        bad_values = [(k, v) for k, v in bias.items() if not self._in_range(v, -100, 100)]
        return [
            (self._in_range(self.min_p, 0, 1), "min_p", f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}"),
            (self._in_range(self.repetition_penalty, 0, float("inf")) and 0 < self.repetition_penalty < float("inf"),
             "repetition_penalty", f"repetition_penalty must be > 0 (1.0 = off, > 1 discourages repeats), got {self.repetition_penalty!r}"),
            (self._in_range(self.presence_penalty, -2, 2), "presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}"),
            (self._in_range(self.frequency_penalty, -2, 2),
             "frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"),
            (self.logit_bias is None or isinstance(self.logit_bias, dict),
             "logit_bias", f"logit_bias must be a mapping of token id to bias, got {type(self.logit_bias).__name__}"),
            (not bad_keys, "logit_bias", f"logit_bias keys must be non-negative integer token ids, got {(bad_keys or [None])[0]!r}"),
            (not bad_values, "logit_bias", "logit_bias values must be in [-100, 100], got "
             + ", ".join(f"{v!r} for token {k}" for k, v in bad_values[:1])),
            (self.logprobs is None or (self._is_int(self.logprobs) and 0 <= self.logprobs <= self.MAX_LOGPROBS),
             "logprobs", f"logprobs must be None (off) or an integer in [0, {self.MAX_LOGPROBS}], got {self.logprobs!r}"),
            (self.prompt_logprobs is None or (self._is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS),
             "prompt_logprobs", f"prompt_logprobs must be None (off) or an integer in [0, {self.MAX_LOGPROBS}], got {self.prompt_logprobs!r}"),
            (self._is_int(self.n) and self.n >= 1, "n", f"n must be an integer >= 1, got {self.n!r}"),
            (self.structured is None or _structured_ok(self.structured), "structured",
             f"structured must name exactly one of {', '.join(STRUCTURED_KINDS)} with its value (a JSON schema, "
             f"True, a regex string, a list of strings, a grammar string); got {self.structured!r}"),
        ]

    def check_vocab(self, vocab_size: int) -> None:
        """Raise InvalidRequest if a token id this request names lies outside a vocabulary of `vocab_size`
        (such an id would otherwise reach a tensor in the middle of a batch step)."""
        for field_name, tokens in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids)):
            for token in tokens:
                if token >= vocab_size:
                    raise InvalidRequest(f"{field_name} names token id {token}, outside the vocabulary "
                                         f"(0..{vocab_size - 1})", field_name)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_history(self) -> bool:
        """Penalties need the tokens seen so far; batches without them skip building those lists."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @staticmethod
    def _is_int(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    @staticmethod
    def _in_range(x: object, lo: float, hi: float) -> bool:
        """A real number (not bool, not NaN) in [lo, hi]."""
        return isinstance(x, (int, float)) and not isinstance(x, bool) and lo <= x <= hi


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed, waiting to recompute
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    """One sequence being generated. Plain Python: the scheduler reasons about it without torch.

    Progress is one number, `num_computed_tokens`: how many of `all_token_ids` already have KV in
    the cache. A prompt chunk, a decode step and a prefix-cache hit all just advance it;
    preemption resets it to 0.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    eos_token_ids: frozenset[int] = frozenset()  # found at run time (tokenizer), not in config
    parent_id: str | None = None  # n > 1: siblings wait for the parent's prompt, then share its blocks
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first schedule; -1 = not yet
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def is_finished(self) -> bool:
        return self.status.finished

    def banned_token_ids(self, num_pending: int = 0) -> list[int]:
        """Ids that may not come next: EOS and stop ids before min_tokens outputs. `num_pending`:
        outputs not yet appended that come first (speculative drafts being verified)."""
        p = self.sampling_params
        if self.num_output_tokens + num_pending >= p.min_tokens:
            return []
        return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids)))
