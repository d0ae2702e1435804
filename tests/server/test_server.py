"""`brisk serve` on 127.0.0.1 with the real default model, driven by the official openai client
and by raw HTTP for the error paths."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from brisk.engine.llm import LLM
from brisk.request import SamplingParams
from tests.server.conftest import leave_mid_stream

MODEL = "smollm2-135m"


def _all_blocks_free(server: dict[str, Any], timeout: float = 20.0) -> bool:
    eng = server["llm"].engine
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not eng.has_unfinished_requests() and eng.scheduler.kv.num_free_blocks == eng.num_blocks:
            return True
        time.sleep(0.05)
    return False


def test_models_and_health(server: dict[str, Any]) -> None:
    assert [m.id for m in server["client"].models.list().data] == [MODEL]
    assert httpx.get(server["base"] + "/health").json() == {"status": "ok"}


def test_completion_equals_offline_greedy(server: dict[str, Any]) -> None:
    prompt = "The capital of France is"
    got = server["client"].completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    ids = server["llm"].tokenizer.encode(prompt)
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 12
    assert got.usage.total_tokens == len(ids) + 12
    assert got.choices[0].finish_reason == "length"
    assert got.choices[0].text == _offline(server, prompt, 12)


def _offline(server: dict[str, Any], prompt: str, max_tokens: int) -> str:
    """Greedy text from a separate LLM over the same file (the server's engine is busy in its thread)."""
    if "offline" not in server:
        server["offline"] = LLM(MODEL, num_kv_blocks=128, max_model_len=1024)
    out = server["offline"].generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
    return out[0].outputs[0].text


def test_chat_stream_matches_non_stream_and_reports_usage(server: dict[str, Any]) -> None:
    client = server["client"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and full.choices[0].message.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_n_seed_stop_and_logprobs(server: dict[str, Any]) -> None:
    client = server["client"]
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.9, "seed": 11}
    a = client.completions.create(n=2, **kw)
    b = client.completions.create(n=2, **kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # the seed reproduces
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 6"])
    assert " 6" not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    lp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    assert len(lp.choices[0].logprobs.tokens) == 5 and all(len(t) == 2 for t in lp.choices[0].logprobs.top_logprobs)
    assert "".join(lp.choices[0].logprobs.tokens) == lp.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)  # greedy takes the top token


def test_tokenize_round_trip(server: dict[str, Any]) -> None:
    base = server["base"]
    toks = httpx.post(base + "/tokenize", json={"prompt": "Hello world"}).json()
    assert toks["count"] == len(toks["tokens"]) > 0
    assert httpx.post(base + "/detokenize", json={"tokens": toks["tokens"]}).json()["prompt"] == "Hello world"


@pytest.mark.parametrize(("body", "param"), [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"logprobs": 50}, "logprobs"),
])
def test_bad_values_get_400_naming_the_field(server: dict[str, Any], body: dict[str, Any], param: str) -> None:
    r = httpx.post(server["base"] + "/v1/completions", json={"model": MODEL, "prompt": "hi", **body})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if body.get("max_tokens") == 5000:
        assert "1024" in err["message"] and "5000" in err["message"]  # both numbers


def test_unknown_model_malformed_json_and_auth(server: dict[str, Any]) -> None:
    base = server["base"]
    r = httpx.post(base + "/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(base + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    state = server["state"]
    state.api_key = "s3cret"
    try:
        assert httpx.get(base + "/v1/models").status_code == 401
        assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    finally:
        state.api_key = ""


def test_64_concurrent_streams_finish_and_free_every_block(server: dict[str, Any]) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, bool]:
        stream = await client.completions.create(model=MODEL, prompt=f"Item {i}:", max_tokens=6, temperature=0,
                                                 stream=True)
        text, finished = "", False
        async for chunk in stream:
            text += chunk.choices[0].text
            finished = finished or chunk.choices[0].finish_reason is not None
        return text, finished

    async def main() -> list[tuple[str, bool]]:
        client = openai.AsyncOpenAI(base_url=server["base"] + "/v1", api_key="unused", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert len(results) == 64 and all(done for _, done in results)
    assert _all_blocks_free(server)


def test_client_disconnect_mid_stream_frees_its_blocks(server: dict[str, Any]) -> None:
    lines = leave_mid_stream(server["base"])
    assert len(lines) == 3 and lines[0]["choices"][0]["finish_reason"] is None
    # 400 tokens would take ~10 s more; the abort frees the blocks well before
    assert _all_blocks_free(server, timeout=4.0)


def test_metrics_chat_page_and_overload(server: dict[str, Any]) -> None:
    base = server["base"]
    server["client"].completions.create(model=MODEL, prompt="Count: 1, 2,", max_tokens=4, temperature=0)
    text = httpx.get(base + "/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["brisk_kv_blocks_total"] == server["llm"].engine.num_blocks
    assert values["brisk_generation_tokens_total"] >= 4 and values["brisk_prompt_tokens_total"] > 0
    assert values["brisk_time_to_first_token_seconds_count"] >= 1
    assert values["brisk_e2e_request_latency_seconds_count"] >= 1
    page = httpx.get(base + "/")
    assert page.status_code == 200 and "/v1/chat/completions" in page.text and "cdn" not in page.text.lower()
    engine = server["state"].engine
    engine.max_waiting = 0  # every new request now finds the line full
    try:
        r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "server_overloaded"
    finally:
        engine.max_waiting = 256
    assert _all_blocks_free(server)


def test_bench_serve_against_the_server(server: dict[str, Any]) -> None:
    from brisk.bench.serving import bench_serve
    from brisk.bench.throughput import make_workload

    work = make_workload(6, server["llm"].model_config.vocab_size, 0, 16, 5)
    result = bench_serve(server["base"], MODEL, work, rate=20.0, seed=0, api_key=None, plot=None)
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["output_tokens"] == 30 and result["output_tokens_per_s"] > 0
    assert 0 < result["ttft_p50_ms"] <= result["ttft_p99_ms"] <= result["e2e_p99_ms"]
    assert result["itl_p50_ms"] > 0 and result["tpot_p50_ms"] > 0
    assert _all_blocks_free(server)


def test_echo_with_logprobs_scores_every_prompt_token(server: dict[str, Any]) -> None:
    """What lm-eval style scoring sends: token ids, echo, logprobs, no new text worth keeping."""
    ids = server["llm"].tokenizer.encode("Paris is the capital of France")
    r = httpx.post(server["base"] + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1,
                                                             "temperature": 0, "echo": True, "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1  # every prompt token, then the generated one
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0


def test_unknown_route_and_method_get_openai_errors(server: dict[str, Any]) -> None:
    r = httpx.get(server["base"] + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(server["base"] + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_non_streaming_client_that_gives_up_frees_its_blocks(server: dict[str, Any]) -> None:
    body = {"model": MODEL, "prompt": "Tell me everything about the sea.", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server["base"] + "/v1/completions", json=body, timeout=1.5)
    assert _all_blocks_free(server, timeout=4.0)  # 400 tokens would take ~10 s more
