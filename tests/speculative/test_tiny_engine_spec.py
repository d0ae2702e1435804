"""Speculation through the whole engine on a tiny random model: greedy output unchanged, sampled
output distributed as the target's, no block leaked, draft lengths adapting under "auto"."""

from __future__ import annotations

import pytest
import torch

from brisk.config import CacheConfig, SpecConfig
from brisk.engine.speculative import VERIFY_COST, build_speculator
from brisk.request import SamplingParams
from tests.speculative.conftest import (
    VOCAB,
    FixedProposer,
    OracleProposer,
    run,
    tiny_engine,
    tiny_model,
    with_proposer,
)
from tests.speculative.test_verify import _chi2_pvalue_ok

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _prompts(count: int = 8, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(1, VOCAB, (6,), generator=g).tolist()  # a common prefix: prefix-cache hits
    return [shared + torch.randint(1, VOCAB, (int(n),), generator=g).tolist()
            for n in torch.randint(1, 20, (count,), generator=g)]


def _draft_engine(target, draft, k: int | str = 3, **kw):  # type: ignore[no-untyped-def]
    engine = tiny_engine(target, **kw)
    cfg = SpecConfig(method="draft", model="tiny", num_speculative_tokens=k)
    engine.spec = build_speculator(cfg, engine.runner, CacheConfig(block_size=4, num_kv_blocks=64), 64, draft,
                                   True, 0)
    return engine


def test_greedy_identical_with_wrong_right_and_partial_drafts() -> None:
    target = tiny_model(0)
    prompts = _prompts()
    # a small budget: prompts arrive in chunks beside speculating decodes
    expected = run(tiny_engine(target, budget=12), prompts, GREEDY)
    wrong = with_proposer(tiny_engine(target, budget=12), FixedProposer(torch.full((VOCAB,), 1 / VOCAB)))
    assert run(wrong, prompts, GREEDY) == expected
    assert wrong.spec.stats.num_draft_tokens > 50
    same = _draft_engine(target, tiny_model(0), budget=12)  # the target as its own draft: all accepted
    assert run(same, prompts, GREEDY) == expected
    assert same.spec.stats.acceptance_rate == 1.0
    other = _draft_engine(target, tiny_model(0, scale=0.45), budget=12)  # a perturbed copy: some accepted
    assert run(other, prompts, GREEDY) == expected
    assert 0.0 < other.spec.stats.acceptance_rate < 1.0
    for engine in (wrong, same, other):
        assert engine.scheduler.kv.num_free_blocks == engine.num_blocks


def test_one_at_a_time_equals_batched_under_speculation() -> None:
    target = tiny_model(1)
    prompts = _prompts(seed=1)
    alone = {}
    for i, p in enumerate(prompts):
        engine = _draft_engine(target, tiny_model(1, scale=0.45))
        alone[f"r{i}"] = run(engine, [p], GREEDY)["r0"]
    assert run(_draft_engine(target, tiny_model(1, scale=0.45)), prompts, GREEDY) == alone


def test_sampled_tokens_follow_the_target_distribution_with_a_wrong_draft() -> None:
    """Marginals of the 2nd and 3rd generated token (both come out of verification) against the
    exact ones, computed by enumerating the first tokens with the plain engine's model."""
    target = tiny_model(2, scale=0.3)
    prompt = [3, 5, 7]
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)  # 2 drafts after t1
    q = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(9)) * 2, -1)
    engine = with_proposer(tiny_engine(target, blocks=512, budget=256, seqs=64), FixedProposer(q), k=2)
    n = 3000
    counts = second_and_third_tokens(engine, prompt, params, n)
    assert engine.spec.stats.num_draft_tokens > 1.5 * n  # chains of drafts really were verified
    assert engine.scheduler.kv.num_free_blocks == engine.num_blocks
    exact = _exact_marginals(target, prompt)
    assert _chi2_pvalue_ok(counts[0], exact[0], n)
    assert _chi2_pvalue_ok(counts[1], exact[1], n)


def second_and_third_tokens(engine, prompt: list[int], params: SamplingParams, n: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Counts [2, VOCAB] of the 2nd and 3rd generated token over `n` seeded requests (seeds 0..n-1)."""
    counts = torch.zeros(2, VOCAB)
    for i in range(n):
        engine.add_request(f"s{i}", prompt, SamplingParams(**{**params.__dict__, "seed": i}))
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                toks = o.outputs[0].token_ids
                counts[0, toks[1]] += 1
                counts[1, toks[2]] += 1
    return counts


@torch.inference_mode()
def _exact_marginals(model, prompt: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """P(2nd token) and P(3rd token) by enumerating every first and second token."""
    def next_probs(seqs: torch.Tensor) -> torch.Tensor:  # [B, L] -> [B, V]
        from brisk.model.attention import ContiguousAttention, SeqSpan
        from brisk.runtime.model_runner import allocate_contiguous_kv

        b, length = seqs.shape
        kv = allocate_contiguous_kv(model.config, b, length, torch.float32, "cpu")
        spans = [SeqSpan(i, 0, length, i * length) for i in range(b)]
        pos = torch.arange(length).repeat(b)
        hidden = model(seqs.reshape(-1), pos, ContiguousAttention(kv, spans))
        return torch.softmax(model.compute_logits(hidden.view(b, length, -1)[:, -1]), -1)

    p1 = next_probs(torch.tensor([prompt]))[0]  # [V]
    seqs1 = torch.tensor([prompt + [a] for a in range(VOCAB)])
    p2 = next_probs(seqs1)  # [V(a), V(b)]
    seqs2 = torch.tensor([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    p3 = next_probs(seqs2).view(VOCAB, VOCAB, VOCAB)  # [a, b, c]
    m2 = (p1[:, None] * p2).sum(0)
    m3 = (p1[:, None, None] * p2[:, :, None] * p3).sum((0, 1))
    return torch.stack([m2, m3])


def test_thousands_of_rejections_leak_no_block() -> None:
    target = tiny_model(3)
    engine = with_proposer(tiny_engine(target, blocks=24, budget=16, seqs=4),
                           FixedProposer(torch.full((VOCAB,), 1 / VOCAB), point_mass=True), k=6)
    params = SamplingParams(max_tokens=70, temperature=0.8, seed=1, ignore_eos=True)
    out = run(engine, _prompts(12, seed=3), params)  # prompts <= 25 tokens: 95 fit the 96-slot pool
    stats = engine.spec.stats
    assert len(out) == 12 and all(len(t) == 70 for t in out.values())
    assert engine.scheduler.num_preemptions > 0  # the pool ran short on the way
    assert stats.num_draft_tokens - stats.num_accepted_tokens > 2000
    assert engine.scheduler.kv.num_free_blocks == engine.num_blocks
    assert sorted(set(engine.spec.proposer.released)) == sorted(f"r{i}" for i in range(12))


def test_auto_length_falls_for_useless_drafts_and_rises_for_perfect_ones() -> None:
    target = tiny_model(4)
    prompts = _prompts(4, seed=4)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    expected = run(tiny_engine(target), prompts, params)
    continuations = {tuple(p): expected[f"r{i}"] for i, p in enumerate(prompts)}
    useless = with_proposer(tiny_engine(target), OracleProposer(continuations, wrong=True), k="auto")
    perfect = with_proposer(tiny_engine(target), OracleProposer(continuations), k="auto")
    assert run(useless, prompts, params) == expected == run(perfect, prompts, params)
    # Never-accepted drafts: Thompson sampling keeps trying one now and then, but the verify work
    # they waste stays under 5% of the plain steps (VERIFY_COST per draft token); always-accepted
    # ones go to the maximum (7) within a few steps.
    wasted = useless.spec.stats.num_draft_tokens * VERIFY_COST
    perfect_k = perfect.spec.stats.num_draft_tokens / perfect.spec.stats.num_verify_steps
    assert useless.spec.stats.num_accepted_tokens == 0 and wasted < 0.05 * 4 * 60
    assert useless.spec.stats.num_draft_tokens / useless.spec.stats.num_verify_steps < 2
    assert perfect_k > 5 and perfect.spec.stats.acceptance_rate == 1.0


def test_draft_model_pool_is_given_back() -> None:
    target = tiny_model(5)
    engine = _draft_engine(target, tiny_model(5, scale=0.45))
    run(engine, _prompts(6, seed=5), GREEDY)
    kv = engine.spec.proposer.kv
    assert kv.num_free_blocks == 64 and not engine.spec.proposer._shadows


def test_every_configurable_method_has_a_registered_builder() -> None:
    """config.SPEC_METHODS (what a speculative_config may name) and the registry agree; only
    prompt lookup drafts over parallel workers."""
    from brisk.config import SPEC_METHODS
    from brisk.speculative.registry import METHODS, method

    assert sorted(METHODS) == sorted(SPEC_METHODS)
    assert [name for name, m in METHODS.items() if m.parallel] == ["ngram"]
    with pytest.raises(ValueError, match="not available; available: draft, early_exit, medusa, ngram"):
        method("lookahead")
