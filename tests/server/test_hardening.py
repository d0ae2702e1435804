"""Hostile and careless clients against a real `brisk serve` on 127.0.0.1: no request hurts
another, stalls the server or gets a 5xx for bad input, and nothing leaks.

One server for the module, with short edge deadlines (2 s) and a small connection cap (24) so
the slow-client and cap checks take seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("uvicorn")

from brisk.engine.llm import LLM
from tests.server.conftest import MODEL, running_server

DEADLINE_S = 2.0
MAX_CONNECTIONS = 24


@pytest.fixture(scope="module")
def srv(gguf_path: Any) -> Iterator[dict[str, Any]]:
    from brisk.server.edge import EdgeLimits

    llm = LLM(MODEL, num_kv_blocks=256, max_model_len=1024, max_num_seqs=32)
    limits = EdgeLimits(body_timeout_s=DEADLINE_S, head_timeout_s=DEADLINE_S, max_connections=MAX_CONNECTIONS)
    with running_server(llm, limits) as (base, app):
        host, port = base.removeprefix("http://").split(":")
        yield {"base": base, "llm": llm, "state": app.state.brisk, "addr": (host, int(port))}


def _idle(srv: dict[str, Any], timeout: float = 20.0) -> bool:
    """Nothing running or waiting and every KV block back in the pool."""
    eng = srv["llm"].engine
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not eng.has_unfinished_requests() and eng.scheduler.kv.num_free_blocks == eng.num_blocks:
            stats = srv["state"].engine.stats
            if stats.get("running", 0) == 0 and stats.get("waiting", 0) == 0:
                return True
        time.sleep(0.05)
    return False


def _post_raw(srv: dict[str, Any], path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    """POST with json.dumps' own escaping (httpx's json= cannot encode a lone surrogate)."""
    return httpx.post(srv["base"] + path, content=json.dumps(body).encode(), timeout=60,
                      headers={"content-type": "application/json", **kw.pop("headers", {})}, **kw)


def _is_openai_error(r: httpx.Response) -> bool:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (isinstance(err.get("message"), str) and bool(err["message"]) and isinstance(err.get("type"), str)
            and err.get("code") == r.status_code and "param" in err)


def _raw_exchange(srv: dict[str, Any], data: bytes, wait: float = 10.0) -> bytes:
    """Send bytes on a fresh socket, read until the server closes it."""
    with socket.create_connection(srv["addr"], timeout=wait) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def _split_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, body


# ------------------------------------------------------------------ 1. poison values stop at the edge
POISON = [
    ({"top_k": 2**63}, None),  # no error: top_k past the vocabulary keeps every token
    ({"top_k": 2**64}, None),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logit_bias": {str(2**64): 1.0}}, "logit_bias"),
    ({"min_tokens": 2**64}, "min_tokens"),
    ({"seed": 2**64}, "seed"),
    ({"max_tokens": 2**64}, "max_tokens"),
]


def test_poison_values_get_400_and_a_neighbouring_stream_finishes(srv: dict[str, Any]) -> None:
    body = {"model": MODEL, "prompt": "The history of the printing press", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True}
    alone = httpx.post(srv["base"] + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    streamed: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", srv["base"] + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    streamed.append(json.loads(line[6:])["choices"][0]["text"])

    t = threading.Thread(target=stream)
    t.start()
    for extra, param in POISON:
        r = httpx.post(srv["base"] + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0.7, "min_tokens": 1,
                             **extra})
        if param is None:
            assert r.status_code == 200, (extra, r.text)
        else:
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    t.join(60)
    assert "".join(streamed) == alone  # the neighbour got exactly its own greedy text
    assert _idle(srv)


# ------------------------------------------------------------------ 2. lone surrogates
def test_lone_surrogates_become_replacement_characters_everywhere(srv: dict[str, Any]) -> None:
    tok = srv["llm"].tokenizer
    expected = tok.encode("a\ufffdb")
    with httpx.Client(base_url=srv["base"], timeout=60) as client:  # one kept-alive connection throughout

        def post(path: str, body: dict[str, Any]) -> httpx.Response:
            return client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})

        r = post("/tokenize", {"prompt": "a\udfffb"})
        assert r.status_code == 200 and r.json()["tokens"] == expected
        for body in ({"prompt": "\ud800"}, {"messages": [{"role": "user", "content": "x\ud800"}]}):
            assert post("/tokenize", body).status_code == 200
        assert post("/v1/completions", {"prompt": "\ud800", "max_tokens": 2}).status_code == 200
        assert post("/v1/completions", {"prompt": ["ok", "a\udfffb"], "max_tokens": 1}).status_code == 200
        for content in ("\ud800", [{"type": "text", "text": "a\udfffb"}]):
            r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": content}], "max_tokens": 2})
            assert r.status_code == 200, r.text
        r = post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": ["\udc00"]})
        assert r.status_code == 200
        assert post("/v1/completions", {"prompt": "😀 \ud83d\ude00", "max_tokens": 1}).status_code == 200  # real pairs
        assert client.get("/health").status_code == 200  # the same connection still answers
    assert _idle(srv)


def test_an_internal_error_is_json_and_says_the_connection_closes(srv: dict[str, Any]) -> None:
    """A bug (here a tokenizer that raises) is a 500 in OpenAI's shape with `Connection: close`,
    since uvicorn drops the connection after it; the next request is served."""
    tok = srv["state"].tokenizer
    real = tok.encode

    def broken(*args: Any, **kwargs: Any) -> list[int]:
        raise TypeError("simulated tokenizer bug")

    tok.encode = broken
    try:
        r = httpx.post(srv["base"] + "/tokenize", json={"prompt": "hi"}, timeout=30)
    finally:
        tok.encode = real
    assert r.status_code == 500 and _is_openai_error(r) and r.json()["error"]["type"] == "server_error"
    assert r.headers["connection"] == "close" and "simulated tokenizer bug" in r.json()["error"]["message"]
    assert httpx.post(srv["base"] + "/tokenize", json={"prompt": "hi"}, timeout=30).status_code == 200


def test_only_brisk_user_errors_are_the_clients_fault(srv: dict[str, Any]) -> None:
    """A ValueError that is not brisk's UserError (a library's, a bug's) is a 500, not a 400 that
    would tell the client to fix a request that was fine; brisk's UserError stays a 400."""
    from brisk.errors import UserError

    tok = srv["state"].tokenizer
    real = tok.encode
    for error, status, kind in ((ValueError("a library's own check failed"), 500, "server_error"),
                                (UserError("the prompt is not something this model reads"), 400,
                                 "invalid_request_error")):
        def broken(*args: Any, _e: Exception = error, **kwargs: Any) -> list[int]:
            raise _e

        tok.encode = broken
        try:
            r = httpx.post(srv["base"] + "/tokenize", json={"prompt": "hi"}, timeout=30)
        finally:
            tok.encode = real
        assert r.status_code == status and _is_openai_error(r), r.text
        assert r.json()["error"]["type"] == kind and str(error) in r.json()["error"]["message"]
    assert httpx.post(srv["base"] + "/tokenize", json={"prompt": "hi"}, timeout=30).status_code == 200


# ------------------------------------------------------------------ 3. body limits
def test_chunked_and_declared_bodies_over_the_limit_get_413(srv: dict[str, Any]) -> None:
    from brisk.server.edge import EdgeLimits

    limit = EdgeLimits().max_body_bytes

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(5 * 16):
            yield b"x" * 65536
        yield b'"}'

    r = httpx.post(srv["base"] + "/v1/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and _is_openai_error(r) and str(limit) in r.json()["error"]["message"]
    assert r.headers["connection"] == "close"
    r = httpx.post(srv["base"] + "/v1/completions", content=b"x" * (limit + 1), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and _is_openai_error(r)
    assert httpx.get(srv["base"] + "/health").status_code == 200


# ------------------------------------------------------------------ 4. the event loop stays free
def test_big_tokenize_calls_leave_health_fast(server: dict[str, Any]) -> None:
    """On the session's server, whose edge deadlines are the defaults (30 s): three 2 MB uploads at
    once take longer than this module's 2 s."""
    srv = server
    text = ("The quick brown fox jumps over the lazy dog. " * 45000)[:2_000_000]
    done: list[int] = []

    def tokenize() -> None:
        r = httpx.post(srv["base"] + "/tokenize", json={"prompt": text}, timeout=120)
        done.append(r.status_code)

    threads = [threading.Thread(target=tokenize) for _ in range(3)]
    for t in threads:
        t.start()
    worst = 0.0
    with httpx.Client(timeout=30) as client:
        while any(t.is_alive() for t in threads):
            started = time.perf_counter()
            assert client.get(srv["base"] + "/health").status_code == 200
            worst = max(worst, time.perf_counter() - started)
            time.sleep(0.05)
    assert done == [200] * 3
    assert worst < 1.0, f"/health took {worst:.2f} s while three 2 MB prompts were tokenized"
    print(f"three 2 MB /tokenize calls at once: slowest /health {worst * 1000:.1f} ms")


# ------------------------------------------------------------------ 5. slow clients
def test_trickling_body_and_head_are_cut_after_the_deadline(srv: dict[str, Any]) -> None:
    host, port = srv["addr"]
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
    body_first = head + "content-type: application/json\r\ncontent-length: 200\r\n\r\n{"
    for first, drip in ((body_first, b" "), (head, b"x")):  # the body trickles, then the head
        started = time.perf_counter()
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(first.encode())
            raw = b""
            try:
                while time.perf_counter() - started < 3 * DEADLINE_S:
                    s.sendall(drip)
                    s.settimeout(0.3)
                    try:
                        chunk = s.recv(65536)
                    except TimeoutError:
                        continue
                    if not chunk:
                        break
                    raw += chunk
            except (BrokenPipeError, ConnectionResetError):
                pass
        took = time.perf_counter() - started
        status, headers, body = _split_response(raw)
        assert status == 408 and json.loads(body)["error"]["code"] == 408, raw
        assert headers["connection"] == "close" and DEADLINE_S * 0.9 < took < DEADLINE_S + 2.0


def test_connections_beyond_the_cap_get_503_json(srv: dict[str, Any]) -> None:
    held = [socket.create_connection(srv["addr"]) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        status, headers, body = _split_response(
            _raw_exchange(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
        assert status == 503 and json.loads(body)["error"]["code"] == 503
        assert headers["content-type"] == "application/json"
    finally:
        for s in held:
            s.close()
    deadline = time.time() + 5
    while time.time() < deadline:  # the server notices the closed sockets
        try:
            if httpx.get(srv["base"] + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    assert httpx.get(srv["base"] + "/health").status_code == 200


# ------------------------------------------------------------------ 6. errors below the app
@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n",
    b"GET /he\x00alth HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
])
def test_malformed_http_gets_openai_json(srv: dict[str, Any], request_bytes: bytes) -> None:
    status, headers, body = _split_response(_raw_exchange(srv, request_bytes))
    assert status == 400 and headers["content-type"] == "application/json"
    err = json.loads(body)["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error" and "malformed" in err["message"]


# ------------------------------------------------------------------ also found
@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/completions", {"max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"n": "2"}, "n"),
    ("/v1/completions", {"stream": "true"}, "stream"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"temperature": "0.5"}, "temperature"),
    ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {"max_tokens": 2.0}, "max_tokens"),
])
def test_strings_are_not_coerced(srv: dict[str, Any], path: str, extra: dict[str, Any], param: str) -> None:
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(srv["base"] + path, json={**body, **extra}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                  "schema": {"type": "objekt"}}}}, "response_format"),
    ("/v1/chat/completions", {"guided_regex": "(("}, "guided_regex"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools.0.function"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy"}}, "audio"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {"made_up_field": 1}, "made_up_field"),
    ("/v1/completions", {"guided_json": {"type": "objekt"}}, "guided_json"),
])
def test_fields_that_would_change_the_answer_are_refused(srv: dict[str, Any], path: str, extra: dict[str, Any],
                                                         param: str) -> None:
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(srv["base"] + path, json={**body, "max_tokens": 2, **extra}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_descriptive_fields_are_accepted(srv: dict[str, Any]) -> None:
    described = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "max_tokens": 2}
    messages = [{"role": "user", "content": "hi", "name": "ann"}]
    r = httpx.post(srv["base"] + "/v1/chat/completions", timeout=60,
                   json={"messages": messages, "response_format": {"type": "text"}, "modalities": ["text"],
                         **described})
    assert r.status_code == 200, r.text
    r = httpx.post(srv["base"] + "/v1/completions", json={"prompt": "hi", "best_of": 1, **described}, timeout=60)
    assert r.status_code == 200, r.text


def test_no_redirects_and_one_authorization_header(srv: dict[str, Any]) -> None:
    r = httpx.post(srv["base"] + "/tokenize/", json={"prompt": "hi"}, headers={"host": "evil.example"})
    assert r.status_code == 404 and "location" not in r.headers and _is_openai_error(r)
    state = srv["state"]
    state.api_key = "s3cret"
    try:
        headers = [("Authorization", "Bearer s3cret"), ("Authorization", "Bearer other")]
        r = httpx.get(srv["base"] + "/v1/models", headers=headers)
        assert r.status_code == 400 and "Authorization" in r.json()["error"]["message"]
        assert httpx.post(srv["base"] + "/tokenize/", json={"prompt": "hi"}).status_code == 401
        assert httpx.get(srv["base"] + "/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    finally:
        state.api_key = ""


# ------------------------------------------------------------------ randomized
def _random_value(rng: random.Random) -> Any:
    pool: list[Any] = [
        None, True, False, 0, -1, 1, 2, 7, 2**31, 2**63, 2**64, -(2**63), 1e308, -1e308, 0.5, 1.5, 2.5, -0.5,
        "", "5", "true", "hi", "\ud800", "a\udfffb", "😀", "\x00", "x" * rng.choice([10, 5000]), [], [1, 2], [-1],
        [2**64], ["a", "b"], {}, {"a": 1}, {"1": 100}, {"1": 1e9}, [[1, 2], [3]], [{"type": "text", "text": "t"}],
    ]
    return rng.choice(pool)


_VALID: dict[str, list[Any]] = {  # values each field accepts, so that many requests really generate
    "max_tokens": [1, 4], "temperature": [0, 0.7, 2], "top_p": [0.5, 1], "top_k": [-1, 5, 2**63], "min_p": [0, 0.1],
    "n": [1, 2], "stop": ["\n", ["a", "\ud800"]], "stop_token_ids": [[2], []], "seed": [0, 2**62],
    "presence_penalty": [0, 1.5], "frequency_penalty": [-1, 0], "repetition_penalty": [1, 1.3],
    "logit_bias": [{"1": 100}, {"5": -100}], "ignore_eos": [True], "min_tokens": [0, 1], "logprobs": [0, 2],
    "echo": [True, False], "stream": [True, False], "stream_options": [{"include_usage": True}], "user": ["u"],
    "best_of": [1], "suffix": [None], "top_logprobs": [1], "response_format": [{"type": "text"}],
    "skip_special_tokens": [False], "model": [MODEL],
}
_FIELDS = [*_VALID, "tools", "tool_choice", "guided_json", "made_up"]
def _random_request(rng: random.Random) -> tuple[str, dict[str, Any]]:
    chat = rng.random() < 0.5
    body: dict[str, Any] = {"max_tokens": rng.randint(1, 6)}
    if chat:
        content = rng.choice(["Say hi.", "Name a fruit.", "\ud800", [{"type": "text", "text": "ok"}],
                              [{"type": "image_url"}], None, 123, "x" * 3000])
        body["messages"] = rng.choice([[{"role": "user", "content": content}]] * 3 + [[], [{"role": "robot"}], "hi",
                                       [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]])
    else:
        body["prompt"] = rng.choice(["Once upon a time", "The sea", "\ud800", [1, 2, 3], ["a", "b"]] * 2 +
                                    ["", [[5, 6], [7]], [10**9], [], 42, "y" * 3000, [-5]])
    for name in rng.sample(_FIELDS, rng.randint(0, 3)):
        body[name] = rng.choice(_VALID[name]) if name in _VALID and rng.random() < 0.6 else _random_value(rng)
    if not chat:
        body.pop("top_logprobs", None)
    if body.get("stream") is True and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


SENTINEL = {"prompt": "A short poem about the sea:", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def test_randomized_requests_never_get_5xx_and_leak_nothing(srv: dict[str, Any]) -> None:
    """Seeded hostile traffic, 8 at a time, with a well-formed greedy request (the sentinel) every
    20th: no 5xx, every error in OpenAI's shape, every sentinel exactly its text alone, /health
    fast throughout, and nothing left behind. BRISK_HOSTILE_REQUESTS sets the count (300)."""
    rng = random.Random(1234)
    count = int(os.environ.get("BRISK_HOSTILE_REQUESTS", "300"))
    work = [("/v1/completions", dict(SENTINEL)) if i % 20 == 0 else _random_request(rng) for i in range(count)]
    sentinel_text = httpx.post(srv["base"] + "/v1/completions", json=SENTINEL, timeout=60).json()["choices"][0]["text"]
    statuses: dict[int, int] = {}
    bad: list[str] = []
    health: list[float] = []

    async def one(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> None:
        content = json.dumps(body).encode()
        async with client.stream("POST", path, content=content, headers={"content-type": "application/json"}) as r:
            raw = await r.aread()
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        if body == SENTINEL and (r.status_code != 200 or json.loads(raw)["choices"][0]["text"] != sentinel_text):
            bad.append(f"sentinel harmed: {r.status_code} {raw[:300]!r}")
        if r.status_code >= 500:
            bad.append(f"{r.status_code} {body} -> {raw[:300]!r}")
        elif r.status_code != 200:
            err = json.loads(raw).get("error", {})
            if not (isinstance(err.get("message"), str) and err.get("code") == r.status_code and "param" in err):
                bad.append(f"not an OpenAI error: {body} -> {raw[:300]!r}")
        elif body.get("stream") is True:
            events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
            if events[-1:] != ["[DONE]"] or any("error" in json.loads(e) for e in events[:-1]):
                bad.append(f"stream did not end cleanly: {body} -> {raw[-300:]!r}")

    async def poll_health(client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = time.perf_counter()
            r = await client.get("/health")
            health.append(time.perf_counter() - started)
            assert r.status_code == 200
            await asyncio.sleep(0.1)

    async def main() -> None:
        limits = httpx.Limits(max_connections=8)
        async with httpx.AsyncClient(base_url=srv["base"], timeout=120, limits=limits) as client, \
                httpx.AsyncClient(base_url=srv["base"], timeout=30) as health_client:
            stop = asyncio.Event()
            poller = asyncio.create_task(poll_health(health_client, stop))
            sem = asyncio.Semaphore(8)

            async def bounded(path: str, body: dict[str, Any]) -> None:
                async with sem:
                    await one(client, path, body)

            await asyncio.gather(*(bounded(p, b) for p, b in work))
            stop.set()
            await poller

    asyncio.run(main())
    assert not bad, "\n".join(bad[:10])
    assert statuses.get(200, 0) >= 60 and sum(v for k, v in statuses.items() if 400 <= k < 500) >= 60, statuses
    health.sort()
    p99 = health[min(len(health) - 1, int(0.99 * len(health)))]
    assert p99 < 1.0, f"/health p99 {p99:.2f} s"
    assert _idle(srv)
    r = httpx.post(srv["base"] + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    print(f"randomized: {count} requests ({len(range(0, count, 20))} sentinels, all intact), statuses "
          f"{dict(sorted(statuses.items()))}, /health p50 {health[len(health) // 2] * 1000:.1f} ms p99 "
          f"{p99 * 1000:.1f} ms max {health[-1] * 1000:.1f} ms over {len(health)} probes")
