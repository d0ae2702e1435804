"""Structured outputs on the default model (the file as stored): sampled JSON-schema outputs all
validate, regex / choice / json_object outputs match, constrained and free requests batched together
get their own tokens, preemption and n > 1 keep every output valid, bad grammars are clear
ValueErrors before anything is queued."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from brisk import LLM, SamplingParams
from brisk.errors import InvalidRequest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(gguf_path: Path) -> LLM:
    return LLM("smollm2-135m", max_model_len=1024)


def _chat(llm: LLM, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_fifty_sampled_outputs_all_validate(llm: LLM) -> None:
    prompt = _chat(llm, "Give me a user record as JSON.")
    params = SamplingParams(max_tokens=160, temperature=1.0, seed=7, n=50, structured={"json": SCHEMA})
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert len(out.outputs) == 50
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text  # the grammar ended it, not max_tokens
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in out.outputs}) > 25  # sampled, not one answer 50 times


def test_regex_choice_and_json_object(llm: LLM) -> None:
    regex = SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=8, structured={"regex": r"[12][0-9]{3}-[01][0-9]"})
    choice = SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=8, structured={"choice": ["red", "green", "blue"]})
    anything = SamplingParams(max_tokens=80, temperature=0.0, structured={"json_object": True})
    r, c, j = llm.generate(["A date:", "A color:", _chat(llm, "Say hi as JSON.")], [regex, choice, anything],
                           use_tqdm=False)
    assert all(re.fullmatch(r"[12][0-9]{3}-[01][0-9]", o.text) for o in r.outputs)
    assert all(o.text in ("red", "green", "blue") for o in c.outputs)
    assert isinstance(json.loads(j.outputs[0].text), dict)


def test_constrained_and_free_rows_in_one_batch_get_their_own_tokens(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    constrained = SamplingParams(max_tokens=120, temperature=0.0, structured={"json": SCHEMA})
    prompts = [_chat(llm, "A user record, please."), "The capital of France is", _chat(llm, "Another one.")]
    params = [constrained, greedy, constrained]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    assert together == alone


def test_preemption_keeps_the_grammar(gguf_path: Path) -> None:
    """A pool of 40 blocks of 4 tokens for four constrained requests: some are preempted and
    recomputed; each output still validates and equals the one from a pool with room for all."""
    prompts = [f"Record number {i} as JSON:" for i in range(4)]
    params = SamplingParams(max_tokens=130, temperature=0.0, structured={"json": SCHEMA})
    small = LLM("smollm2-135m", max_model_len=150, num_kv_blocks=40, block_size=4)
    got = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    roomy = LLM("smollm2-135m", max_model_len=512)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids
                                                      for o in roomy.generate(prompts, params, use_tqdm=False)]
    for o in got:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


@pytest.mark.parametrize("method", [{"method": "ngram", "num_speculative_tokens": 4},
                                    {"method": "draft", "model": "smollm2-135m", "num_speculative_tokens": 4}])
def test_speculation_checks_drafts_against_the_grammar(gguf_path: Path, method: dict) -> None:
    """Drafts of constrained requests (the grammar's forced tokens) are verified under the grammar's
    masks, with any proposer configured: greedy tokens equal plain constrained decoding's (the grammar's last token ends it, not a
    verified EOS after it), drafts really are accepted, and sampled outputs stay valid."""
    params = SamplingParams(max_tokens=150, temperature=0.0, structured={"json": SCHEMA})
    prompts = ["Give a user record as JSON:", "Three users as JSON, the first:"]
    plain = LLM("smollm2-135m", max_model_len=512).generate(prompts, params, use_tqdm=False)
    spec = LLM("smollm2-135m", max_model_len=512, speculative_config=method)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in plain]
    # constrained requests draft only the grammar's forced tokens (keys, `": `), which the masked
    # target takes: the proposers' guesses were accepted 12% of the time under this schema
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0.9 * sum(o.metrics.num_draft_tokens for o in got)
    sampled = SamplingParams(max_tokens=150, temperature=1.0, seed=3, n=4, structured={"json": SCHEMA})
    for out in spec.generate(prompts, sampled, use_tqdm=False):
        for c in out.outputs:
            jsonschema.validate(json.loads(c.text), SCHEMA)


def test_constrained_requests_jump_forward_without_a_speculative_method(llm: LLM, monkeypatch) -> None:
    """With no speculative method configured, a constrained request still drafts the tokens its
    grammar forces and the target verifies them (jump-forward, lossless): the greedy tokens equal
    decoding one token a step, drafts are taken, free requests in the batch draft nothing."""
    import brisk.engine.speculative as speculative

    constrained = SamplingParams(max_tokens=120, temperature=0.0, structured={"json": SCHEMA})
    free = SamplingParams(max_tokens=40, temperature=0.0)
    prompts = [_chat(llm, "A user record, please."), "The capital of France is", _chat(llm, "Another one.")]
    params = [constrained, free, constrained]
    jumped = llm.generate(prompts, params, use_tqdm=False)
    drafted = [o.metrics.num_draft_tokens for o in jumped]
    assert drafted[0] > 20 and drafted[2] > 20 and drafted[1] == 0
    assert sum(o.metrics.num_accepted_tokens for o in jumped) > 0.9 * sum(drafted)
    monkeypatch.setattr(speculative, "MAX_FORCED", 0)  # one token a step
    stepped = llm.generate(prompts, params, use_tqdm=False)
    assert [o.metrics.num_draft_tokens for o in stepped] == [0, 0, 0]
    assert [o.outputs[0].token_ids for o in jumped] == [o.outputs[0].token_ids for o in stepped]
    assert [o.outputs[0].finish_reason for o in jumped] == [o.outputs[0].finish_reason for o in stepped]


def test_forced_tokens_are_the_grammars_canonical_continuation(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"address": {"type": "string"}}, "required": ["address"]}
    constraint = llm.engine.grammars().constraint({"json": schema})
    forced = constraint.forced_tokens(8)
    assert llm.tokenizer.decode(forced) == '{"address":'
    assert constraint.forced_tokens(2) == forced[:2] and constraint.forced_tokens(0) == []
    for t in forced:  # the matcher did not move, and accepts them
        constraint.advance(t)
    assert constraint.forced_tokens(8) == []  # the string's content is free


def test_masks_filled_on_the_mask_thread_give_the_same_tokens(gguf_path: Path) -> None:
    """Where a core is spare the masks (and speculation's verification masks) are filled while
    the forward runs; this machine has none, so the thread is switched on by hand here."""
    prompts = ["Give a user record as JSON:", "Another one:", "A third:"]
    params = SamplingParams(max_tokens=80, temperature=0.0, structured={"json": SCHEMA})
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    inline = LLM("smollm2-135m", max_model_len=512, speculative_config=spec)
    threaded = LLM("smollm2-135m", max_model_len=512, speculative_config=spec)
    inline.engine._mask_thread, threaded.engine._mask_thread = False, True
    want = [o.outputs[0].token_ids for o in inline.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in threaded.generate(prompts, params, use_tqdm=False)] == want
    assert threaded.engine._masks is not None and inline.engine._masks is None


def test_a_grammar_dead_end_ends_only_that_request_with_finish_reason_grammar(llm: LLM, monkeypatch) -> None:
    """llguidance avoids dead ends, so one is made: after 5 tokens this constraint allows nothing
    (an all-zero mask, the token drawn refused). The request ends with finish_reason "grammar" and
    the text it had; a free request beside it gets the tokens it gets alone."""
    from brisk.sample.structured import Constraint

    class DeadEnd(Constraint):
        def _dead(self) -> bool:
            return self._moves >= 5

        def fill(self, bitmask, row):  # type: ignore[no-untyped-def]
            super().fill(bitmask, row)
            if self._dead():
                bitmask[row].zero_()

        def prefetch(self, drafts=None):  # type: ignore[no-untyped-def]
            self._ahead = None

        def advance(self, token):  # type: ignore[no-untyped-def]
            if self._dead():
                raise ValueError("structured output: token refused")
            super().advance(token)

        def allows_nothing(self) -> bool:
            return self._dead()

    grammars = llm.engine.grammars()
    real = grammars.constraint
    monkeypatch.setattr(grammars, "constraint",
                        lambda spec: DeadEnd(real(spec).matcher, grammars.vocab_size) if "regex" in spec else real(spec))
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = llm.generate(["The sea is"], free, use_tqdm=False)[0].outputs[0].token_ids
    dead = SamplingParams(max_tokens=40, temperature=0.0, structured={"regex": "[a-z ]{30,}"})
    outs = llm.generate(["The sea is", "Words:"], [free, dead], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone
    ended = outs[1].outputs[0]
    assert str(ended.finish_reason) == "grammar" and len(ended.token_ids) == 5
    assert re.fullmatch("[a-z ]+", ended.text)
    assert not llm.engine.has_unfinished_requests() and llm.engine.scheduler.kv_usage == 0


@pytest.mark.parametrize(("structured", "message"), [
    ({"json": {"type": "objekt"}}, "Invalid type"),
    ({"regex": "(("}, "unclosed group"),
    ({"grammar": "start: (("}, "grammar does not compile"),
])
def test_bad_grammars_are_clear_errors_before_anything_is_queued(llm: LLM, structured: dict, message: str) -> None:
    engine = llm.engine
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.add_request("bad", [1, 2, 3], SamplingParams(structured=structured))
    assert not engine.has_unfinished_requests() and "bad" not in engine.unfinished_request_ids()


@pytest.mark.parametrize("structured", [{"json": 3}, {"regex": ""}, {"choice": []}, {"yaml": "x"},
                                        {"json": {}, "regex": "a"}, {"json_object": False}])
def test_malformed_specs_name_the_field(structured: dict) -> None:
    with pytest.raises(InvalidRequest, match="structured must name exactly one of"):
        SamplingParams(structured=structured)


def test_verify_rejects_the_first_draft_the_grammar_forbids(llm: LLM) -> None:
    """speculative/verify with a grammar, on random logits: a draft the grammar refuses is rejected at its
    row even where the raw logits favour it, the token chosen instead fits the grammar, and the
    rows before it are judged as plain constrained sampling would (masked)."""
    import torch

    from brisk.request import Request
    from brisk.speculative.base import Draft
    from brisk.speculative.verify import verify

    grammars = llm.engine.grammars()
    tok = llm.tokenizer
    digit, letter = tok.encode("7", add_special_tokens=False)[0], tok.encode("x", add_special_tokens=False)[0]
    vocab = grammars.vocab_size
    for params in (SamplingParams(max_tokens=8, temperature=0.0), SamplingParams(max_tokens=8, temperature=1.0)):
        logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
        logits[0, digit] = logits[1, letter] = 50.0  # the raw model wants "7" then "x"
        constraint = grammars.constraint({"regex": "[0-9]{3}"})
        req = Request("r", [1, 2], params, eos_token_ids=frozenset(tok.eos_token_ids))
        gen = torch.Generator().manual_seed(1)
        (out,) = verify([logits], [req], [Draft([digit, letter])], [gen], [constraint])
        assert out.num_accepted == 1 and out.token_ids[0] == digit
        assert out.token_ids[1] != letter and tok.decode([out.token_ids[1]]).isdigit()
        for t in out.token_ids:  # every token fits, and the matcher was left where it began
            constraint.advance(t)
