"""The public offline API on the real default model."""

from __future__ import annotations

import pytest

from brisk import LLM, FinishReason, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def test_generate_returns_one_output_per_prompt_in_order(brisk_llm: LLM) -> None:
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    outs = brisk_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    for o in outs:
        c = o.outputs[0]
        assert c.text and len(c.token_ids) <= 24
        assert c.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert o.metrics.first_token_time is not None and o.metrics.finish_time is not None
    single = brisk_llm.generate(prompts[1], GREEDY, use_tqdm=False)[0]
    assert single.outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_chat_stops_on_end_of_turn(brisk_llm: LLM) -> None:
    out = brisk_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                         SamplingParams(max_tokens=64, temperature=0), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == FinishReason.STOP
    assert "Paris" in c.text
    assert c.token_ids[-1] in brisk_llm.get_tokenizer().eos_token_ids
    assert "<|im_end|>" not in c.text


def test_stream_deltas_add_up_to_the_final_text(brisk_llm: LLM) -> None:
    params = SamplingParams(max_tokens=20, temperature=0)
    chunks = list(brisk_llm.stream("Once upon a time", params))
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert "".join(c.outputs[0].delta for c in chunks) == chunks[-1].outputs[0].text
    assert chunks[-1].outputs[0].text == brisk_llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].text


def test_stop_string_ends_generation_without_leaking(brisk_llm: LLM) -> None:
    free = brisk_llm.generate("1, 2, 3, 4,", GREEDY, use_tqdm=False)[0].outputs[0].text
    assert " 7" in free
    out = brisk_llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=24, temperature=0, stop=[" 7"]),
                             use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == FinishReason.STOP
    assert out.text == free[: free.index(" 7")]


def test_seeded_sampling_is_reproducible(brisk_llm: LLM) -> None:
    def run(seed: int) -> list[int]:
        p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=seed)
        return brisk_llm.generate("My favourite animal is", p, use_tqdm=False)[0].outputs[0].token_ids

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_min_tokens_and_ignore_eos(brisk_llm: LLM) -> None:
    msgs = [{"role": "user", "content": "Say yes."}]
    out = brisk_llm.chat(msgs, SamplingParams(max_tokens=40, temperature=0, min_tokens=30), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 30
    out = brisk_llm.chat(msgs, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == FinishReason.LENGTH


def test_per_prompt_params(brisk_llm: LLM) -> None:
    outs = brisk_llm.generate(["a", "b"], [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                                           SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)],
                              use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    with pytest.raises(ValueError, match="one per prompt"):
        brisk_llm.generate(["a", "b"], [GREEDY], use_tqdm=False)


@pytest.mark.parametrize("prompt, match", [
    ("", "prompt is empty"),
    ({"prompt_token_ids": []}, "prompt is empty"),
    ({"prompt_token_ids": [10**6]}, "outside the vocabulary"),
    ({"prompt_token_ids": "abc"}, "list of integers"),
    (42, "must be a string"),
])
def test_bad_prompts_are_clear_errors(brisk_llm: LLM, prompt, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        brisk_llm.generate([prompt], GREEDY, use_tqdm=False)


def test_prompt_longer_than_context_is_rejected_and_engine_keeps_working(brisk_llm: LLM) -> None:
    too_long = {"prompt_token_ids": [100] * brisk_llm.max_model_len}
    with pytest.raises(ValueError, match=f"context window is {brisk_llm.max_model_len}"):
        brisk_llm.generate(["fine", too_long], GREEDY, use_tqdm=False)
    assert brisk_llm.generate("fine", GREEDY, use_tqdm=False)[0].outputs[0].text


def test_generation_stops_when_the_context_is_full(brisk_llm: LLM) -> None:
    ids = [100] * (brisk_llm.max_model_len - 3)
    out = brisk_llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == FinishReason.LENGTH and len(out.token_ids) == 3


def test_logprobs_of_sampled_and_prompt_tokens_match_a_full_forward(brisk_llm: LLM) -> None:
    import torch

    from brisk.model.attention import ContiguousAttention, SeqSpan
    from brisk.runtime.model_runner import allocate_contiguous_kv

    text = "The capital of France is Paris. The capital of Italy is"
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3, prompt_logprobs=2)
    first, again = (brisk_llm.generate(text, params, use_tqdm=False)[0] for _ in range(2))
    ids = first.prompt_token_ids + first.outputs[0].token_ids
    model = brisk_llm.model
    caches = allocate_contiguous_kv(model.config, 1, len(ids), torch.float32, "cpu")
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), ContiguousAttention(caches, [SeqSpan(0, 0, len(ids), 0)]))
        ref = torch.log_softmax(model.compute_logits(hidden), dim=-1)  # [len, vocab]
    plp = first.prompt_logprobs
    assert plp is not None and len(plp) == len(first.prompt_token_ids) and plp[0] is None
    for pos in range(1, len(plp)):
        assert plp[pos].token_id == ids[pos] and len(plp[pos].top) == 2
        assert abs(plp[pos].logprob - float(ref[pos - 1, ids[pos]])) < 1e-3
    start = len(first.prompt_token_ids)
    for i, lp in enumerate(first.outputs[0].logprobs):
        assert lp.token_id == ids[start + i] and lp.rank == 1 and len(lp.top) == 3  # greedy: the top token
        assert abs(lp.logprob - float(ref[start + i - 1, lp.token_id])) < 1e-3
    # the second run would hit the prefix cache; prompt logprobs still cover every position
    assert [p and round(p.logprob, 4) for p in again.prompt_logprobs] == [p and round(p.logprob, 4) for p in plp]
