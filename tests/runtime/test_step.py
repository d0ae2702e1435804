"""The runner returns sampled ids (runtime/step.py): `execute_model` runs the forward and turns its
logits into tokens, logprobs, prompt logprobs and verified drafts, with a failing row isolated."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from brisk.config import ModelConfig
from brisk.core.outputs import ScheduledRequest
from brisk.model.llama import LlamaForCausalLM
from brisk.request import Request, SamplingParams
from brisk.runtime.paged_runner import PagedModelRunner
from brisk.runtime.step import StepBatch
from brisk.sample.structured import Constraint
from brisk.speculative.base import Draft

CFG = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
BS = 4


@dataclass
class Seq:
    request: Request
    generator: torch.Generator | None = None
    constraint: Constraint | None = None


def _runner() -> PagedModelRunner:
    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG, max_positions=256)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return PagedModelRunner(model.eval(), 32, BS)


def _step(rid: str, ids: list[int], start: int, first_block: int) -> ScheduledRequest:
    blocks = list(range(first_block, first_block + -(-(start + len(ids)) // BS)))
    return ScheduledRequest(rid, ids, start, [blocks], sample=True)


def _seq(rid: str, prompt: list[int], **params: object) -> Seq:
    return Seq(Request(rid, prompt, SamplingParams(max_tokens=8, **params), 0.0, frozenset({0})))


def test_execute_model_returns_the_argmax_logprobs_and_prompt_logprobs() -> None:
    runner = _runner()
    a, b = [5, 6, 7, 8, 9], [11, 12, 13]
    steps = [_step("a", a, 0, 0), _step("b", b, 0, 8)]
    seqs = {"a": _seq("a", a, temperature=0.0, logprobs=2, prompt_logprobs=1), "b": _seq("b", b, temperature=0.0)}
    out = runner.execute_model(StepBatch(steps, seqs, prompt_rows=frozenset({"a"})))
    logits = runner.execute(steps, frozenset({"a"}))  # the same step again: same KV, same logits
    assert out.token_ids == {rid: [int(logits.of(rid)[-1].argmax())] for rid in ("a", "b")}
    lp = out.logprobs["a"][0]
    assert lp.token_id == out.token_ids["a"][0] and lp.rank == 1 and len(lp.top) == 2
    assert lp.logprob == pytest.approx(float(logits.of("a")[-1].log_softmax(-1).max()), abs=1e-5)
    assert "b" not in out.logprobs  # b asked for none
    assert sorted(out.prompt_logprobs["a"]) == [1, 2, 3, 4]  # positions 1.. of the prompt, each predicted
    expect = float(logits.of("a")[0].log_softmax(-1)[a[1]])
    assert out.prompt_logprobs["a"][1].logprob == pytest.approx(expect, abs=1e-5)
    assert out.forward_seconds > 0 and out.logits is not None and out.logits.sample_ids == ["a", "b"]


def test_drafts_are_verified_in_the_step() -> None:
    """Greedy verification keeps the drafts the target agrees with and adds the target's next token."""
    runner = _runner()
    prompt = [5, 6, 7, 8]
    first = runner.execute_model(StepBatch([_step("a", prompt, 0, 0)], {"a": _seq("a", prompt, temperature=0.0)}))
    t1 = first.token_ids["a"][0]
    # the target's own next token as the first draft, then (almost surely) a wrong one
    follow = runner.execute([_step("a", [t1], 4, 0)]).logits[0].argmax().item()
    drafts = {"a": Draft([follow, (follow + 1) % CFG.vocab_size])}
    seq = _seq("a", prompt, temperature=0.0)
    seq.request.output_token_ids.append(t1)
    step = _step("a", [t1, *drafts["a"].token_ids], 4, 0)
    out = runner.execute_model(StepBatch([step], {"a": seq}, drafts))
    assert out.num_accepted["a"] >= 1 and out.token_ids["a"][0] == follow
    assert len(out.token_ids["a"]) == out.num_accepted["a"] + 1


def test_a_row_that_breaks_the_batch_fails_alone() -> None:
    runner = _runner()
    prompt = [5, 6, 7, 8]
    steps = [_step("ok", prompt, 0, 0), _step("bad", prompt, 0, 8)]
    seqs = {"ok": _seq("ok", prompt, temperature=0.0), "bad": _seq("bad", prompt, temperature=0.0, min_tokens=4)}
    # planted after validation: a stop id (banned before min_tokens) that overflows the sampler's int64 tensor
    seqs["bad"].request.sampling_params.stop_token_ids = [2**64]
    called: list[bool] = []
    out = runner.execute_model(StepBatch(steps, seqs, after_forward=lambda: called.append(True)))
    alone = runner.execute_model(StepBatch(steps[:1], {"ok": seqs["ok"]}))
    assert out.token_ids == alone.token_ids and set(out.failed) == {"bad"} and called == [True]
