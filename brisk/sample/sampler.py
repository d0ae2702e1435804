"""Pick the next token of each row of a logits batch.

One call handles a whole step's batch. The stages, in order (vLLM / HF semantics):

    raw logits [B, V] ──────────────────────────────────────────────► logprobs (raw log_softmax)
        │ 1. logit bias, then bans (banned ids -> -inf)
        │ 2. repetition penalty (HF: /p if > 0, *p if < 0; tokens in prompt + output)
        │ 3. frequency / presence penalties (OpenAI: output tokens only)
        ├──────────────────────────────► greedy rows: argmax of these penalised logits
        │ 4. temperature                    (sampled rows only, from here on)
        │ 5. min-p   6. top-k   7. top-p
        ▼ 8. draw: argmax(probs / Exp(1) noise), the noise from the row's own generator

Logprobs describe the raw model distribution, before any stage (see `logprobs.py`).

Every stage is a tensor op over the batch, skipped when no row uses it, so the common all-greedy
batch with no penalties is one argmax. Only the draw loops over rows, and only to fill each seeded
row's noise from its own `torch.Generator`: a seeded request's tokens depend on nothing but its
logits and its generator, whatever shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import overload

import torch

from brisk.kernels import argmax_rows
from brisk.request import SamplingParams
from brisk.sample import processors as P
from brisk.sample.logprobs import TokenLogprobs, token_logprobs
from brisk.sample.structured import Constraint, mask_logits

@dataclass
class SamplingBatch:
    """What the sampler needs about each row, built once per step by the runner.

    Row i of every list belongs to row i of the logits. The three token-id lists may be left empty
    to mean "no tokens for any row"; otherwise each has one list per row. They are read only for rows
    whose params use them (penalties), except `banned_token_ids`, which always applies.
    """

    params: list[SamplingParams]
    generators: list[torch.Generator | None]  # per row; None: the default generator of the device
    output_token_ids: list[list[int]] = field(default_factory=list)  # generated so far (all penalties)
    prompt_token_ids: list[list[int]] = field(default_factory=list)  # repetition penalty also counts these
    banned_token_ids: list[list[int]] = field(default_factory=list)  # e.g. EOS before min_tokens
    # per row, its grammar (sample/structured.py) or None; empty: no row is constrained
    constraints: list[Constraint | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        rows = len(self.params)
        for name in ("output_token_ids", "prompt_token_ids", "banned_token_ids"):
            if not getattr(self, name):
                setattr(self, name, [[] for _ in range(rows)])
            assert len(getattr(self, name)) == rows, f"{name} has {len(getattr(self, name))} rows, params {rows}"
        assert len(self.generators) == rows, f"{len(self.generators)} generators for {rows} rows"


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # per row; None where params.logprobs is None


@overload
def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput: ...


@overload
def sample(logits: torch.Tensor, batch: list[SamplingParams], generators: list[torch.Generator | None],
           banned: list[list[int]] | None = None) -> list[int]: ...


def sample(logits: torch.Tensor, batch: SamplingBatch | list[SamplingParams],
           generators: list[torch.Generator | None] | None = None,
           banned: list[list[int]] | None = None) -> SamplerOutput | list[int]:
    """logits: [B, V] (float32; other float dtypes are upcast) -> the next token of every row.

    `sample(logits, SamplingBatch)` returns a SamplerOutput (ids and logprobs). The older form
    `sample(logits, params, generators, banned=None)` returns just the ids; it is the same sampler
    with no penalty history. The logits tensor is never modified.
    """
    if isinstance(batch, SamplingBatch):
        return _sample_batch(logits, batch)
    assert generators is not None, "the list form of sample() needs one generator (or None) per row"
    legacy = SamplingBatch(list(batch), list(generators), banned_token_ids=[list(b or []) for b in banned or []])
    return _sample_batch(logits, legacy).token_ids


def _sample_batch(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    rows, vocab = logits.shape
    assert rows == len(batch.params), f"{rows} logit rows for {len(batch.params)} requests"
    if rows == 0:
        return SamplerOutput([], [])
    for p in batch.params:
        if p.logit_bias or p.stop_token_ids:
            p.check_vocab(vocab)  # the engine checks at admission; this keeps a bad id from reaching a tensor
    if any(c is not None for c in batch.constraints):
        # first: penalties, sampling and logprobs all see the grammar's distribution
        logits = mask_logits(logits, batch.constraints)
    penalised = penalise(logits, batch)  # [B, V]; `logits` itself when no row needs any of it
    greedy = [p.greedy for p in batch.params]
    if all(greedy):
        token_ids = argmax_rows(penalised)  # [B]
    else:
        token_ids = _sample_rows(penalised, batch, greedy)
    return SamplerOutput(token_ids.tolist(), _logprobs(logits, token_ids, batch.params))


def penalise(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Stages 1-3 on a float32 copy (or the input itself when no row asks for any of them)."""
    params, vocab, device = batch.params, logits.shape[-1], logits.device
    bias = any(p.logit_bias for p in params)
    bans = any(batch.banned_token_ids)
    repetition = any(p.repetition_penalty != 1.0 for p in params)
    freq_presence = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
    if not (bias or bans or repetition or freq_presence):
        return logits
    out = logits.to(torch.float32, copy=True)  # [B, V]
    if bias:
        biases = [p.logit_bias or {} for p in params]
        ids = P.padded_ids([list(b) for b in biases], vocab, device)  # [B, L]
        values = P.padded([list(b.values()) for b in biases], 0.0, torch.float32, device)  # [B, L]
        P.apply_logit_bias(out, ids, values)
    if bans:
        P.apply_bans(out, P.padded_ids(batch.banned_token_ids, vocab, device))
    if repetition:
        seen_rows = [pr + o if p.repetition_penalty != 1.0 else []
                     for p, pr, o in zip(params, batch.prompt_token_ids, batch.output_token_ids)]
        seen = P.token_mask(P.padded_ids(seen_rows, vocab, device), vocab)  # [B, V]
        penalty = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device)
        out = P.apply_repetition_penalty(out, seen, penalty)
    if freq_presence:
        used = [p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params]
        counts = P.token_counts(P.padded_ids([o if u else [] for o, u in zip(batch.output_token_ids, used)],
                                             vocab, device), vocab)  # [B, V]
        frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device)
        presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device)
        P.apply_frequency_presence(out, counts, frequency, presence)
    return out


def _sample_rows(penalised: torch.Tensor, batch: SamplingBatch, greedy: list[bool]) -> torch.Tensor:
    """Stages 4-8 on the sampled rows; greedy rows take the argmax of `penalised`. -> [B] int64."""
    device = penalised.device
    rows = [i for i, g in enumerate(greedy) if not g]
    index = torch.tensor(rows, dtype=torch.int64, device=device)  # [S]
    every_row = len(rows) == len(greedy)
    logits = penalised if every_row else penalised.index_select(0, index)  # [S, V]
    probs = probabilities(logits, [batch.params[i] for i in rows])
    drawn = draw(probs, [batch.generators[i] for i in rows])  # [S]
    if every_row:
        return drawn
    return argmax_rows(penalised).index_copy_(0, index, drawn)


def probabilities(penalised: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Stages 4-7 and the softmax: the distribution a sampled row draws from. [S, V] -> [S, V] float32.
    Speculative verification (speculative/verify.py) accepts drafts against exactly this distribution."""
    device = penalised.device
    logits = penalised.float()

    def col(values: list[float]) -> torch.Tensor:  # one value per sampled row -> [S]
        return torch.tensor(values, dtype=torch.float32, device=device)

    if any(p.temperature != 1.0 for p in params):
        logits = logits / col([p.temperature for p in params]).unsqueeze(-1)  # a new tensor: input untouched
    if any(p.min_p > 0.0 for p in params):
        logits = P.apply_min_p(logits, col([p.min_p for p in params]))
    if any(p.top_k > 0 for p in params):
        ks = [min(p.top_k, logits.shape[-1]) for p in params]  # a top_k past the vocabulary keeps all (and fits int64)
        logits = P.apply_top_k(logits, torch.tensor(ks, dtype=torch.int64, device=device), max(ks))
    if any(p.top_p < 1.0 for p in params):
        logits = P.apply_top_p(logits, col([p.top_p for p in params]))
    return logits.softmax(dim=-1)


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs [S, V], by an exponential race: argmax_i p_i / E_i with E_i ~ Exp(1)
    picks i with probability p_i (E_i / p_i ~ Exp(p_i), and the smallest of those is i's with
    probability p_i / sum p). Seeded rows draw their noise from their own generator; the rest
    share one call on the device's default generator.
    """
    noise = torch.empty_like(probs)  # [S, V]
    if any(g is None for g in generators):
        noise.exponential_()
    for row, gen in enumerate(generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # an exact 0 would make 0 / 0 = NaN for a dropped token
    return (probs / noise).argmax(dim=-1)


def _logprobs(raw: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]) -> list[TokenLogprobs | None]:
    """Raw-model logprobs of each row's token, for rows whose params ask for them."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return out
    if len(rows) == len(params):
        found = token_logprobs(raw, token_ids, [p.logprobs or 0 for p in params])
    else:
        index = torch.tensor(rows, dtype=torch.int64, device=raw.device)
        found = token_logprobs(raw.index_select(0, index), token_ids.index_select(0, index),
                               [params[i].logprobs or 0 for i in rows])
    for i, lp in zip(rows, found):
        out[i] = lp
    return out
