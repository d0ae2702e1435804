"""The OpenAI-compatible HTTP API over an AsyncEngine.

Handlers validate, turn the body into prompt ids and SamplingParams, queue the request and
either collect its final output or stream Server-Sent Events (`data: {...}` chunks, then
`data: [DONE]`). Every error leaves as OpenAI's error JSON with the offending field in `param`;
a client that disconnects mid-stream has its request aborted and its KV blocks freed.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from brisk.engine.async_engine import AsyncEngine, EngineDead, EngineOverloaded
from brisk.engine.outputs import RequestOutput
from brisk.loader.tokenizer import Tokenizer
from brisk.request import SamplingParams
from brisk.server import formatting as fmt
from brisk.server.metrics import ServerMetrics
from brisk.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


class ServerState:
    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, model_name: str, max_model_len: int,
                 api_key: str | None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.api_key = api_key
        self.metrics = ServerMetrics(engine)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "not_found_error")

    def check_length(self, prompt_len: int, max_tokens: int, field: str) -> None:
        if prompt_len + max_tokens > self.max_model_len:
            raise APIError(400, f"this model's context window is {self.max_model_len} tokens; the prompt has "
                                f"{prompt_len} tokens and {field} asks for {max_tokens} more "
                                f"({prompt_len + max_tokens}); shorten the prompt or lower {field}", field)


def create_app(state: ServerState, max_body_bytes: int = 4 * 2**20) -> FastAPI:
    app = FastAPI(title="brisk", docs_url=None, redoc_url=None)
    app.state.brisk = state
    _install_errors(app)
    _install_guards(app, state, max_body_bytes)
    _install_routes(app, state)
    return app


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.kind, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        return error_response(400, f"{param or 'body'}: {err.get('msg', 'invalid request')}", param)

    @app.exception_handler(ValueError)
    async def _value(_: Request, e: ValueError) -> JSONResponse:
        return error_response(400, str(e))

    @app.exception_handler(EngineOverloaded)
    async def _busy(_: Request, e: EngineOverloaded) -> JSONResponse:
        return error_response(503, f"server busy: {e}; retry shortly", None, "server_overloaded", {"Retry-After": "1"})

    @app.exception_handler(EngineDead)
    async def _dead(_: Request, e: EngineDead) -> JSONResponse:
        return error_response(503, str(e), None, "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), None, kind)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(e).__name__}: {e}", None, "server_error")


class _Guard:
    """API key and body-size checks as plain ASGI middleware. (Starlette's BaseHTTPMiddleware
    wraps `receive`, and through it a handler never hears that its client disconnected.)"""

    def __init__(self, app: Any, state: ServerState, max_body_bytes: int) -> None:
        self.app, self.state, self.max_body_bytes = app, state, max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Any) -> JSONResponse | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        key = self.state.api_key
        if key and (path.startswith("/v1") or path in ("/tokenize", "/detokenize")):
            auth = headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), key.encode()):
                return error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                      None, "authentication_error")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return error_response(413, f"request body of {length} bytes is over the {self.max_body_bytes}-byte limit")
        return None


def _install_guards(app: FastAPI, state: ServerState, max_body_bytes: int) -> None:
    app.add_middleware(_Guard, state=state, max_body_bytes=max_body_bytes)


def _install_routes(app: FastAPI, state: ServerState) -> None:
    page = resources.files("brisk.server").joinpath("static/index.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def chat_page() -> str:
        return page  # shipped in the package; nothing is loaded from a CDN

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.alive:
            return error_response(503, "the engine is not running", None, "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "brisk", "max_model_len": state.max_model_len}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        state.check_model(req.model)
        if req.messages is not None:
            ids = state.tokenizer.encode_chat([{"role": m.role, "content": m.text()} for m in req.messages])
        elif req.prompt is not None:
            ids = state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise APIError(400, "give 'prompt' or 'messages'", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        state.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < state.tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{state.tokenizer.vocab_size - 1})",
                           "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        state.check_model(req.model)
        prompts = await asyncio.to_thread(_completion_prompts, req, state.tokenizer)  # a 4 MiB body takes a while
        max_tokens = req.max_tokens or 16
        for _, ids in prompts:
            state.check_length(len(ids), max_tokens, "max_tokens")
        params = req.sampling_params(max_tokens, req.logprobs)
        if req.echo and req.logprobs is not None:
            params.prompt_logprobs = req.logprobs
        job = await _submit(state, prompts, params)
        view = fmt.CompletionView(state, req, prompts, job.created, job.id)
        if req.stream:
            return _sse(state, job, _stream(state, job, view, req.include_usage))
        return JSONResponse(view.full(await _collect(state, job, raw)))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request) -> Response:
        state.check_model(req.model)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        ids = await asyncio.to_thread(state.tokenizer.encode_chat, messages, req.add_generation_prompt)
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        asked = req.max_completion_tokens or req.max_tokens
        max_tokens = asked if asked is not None else max(1, state.max_model_len - len(ids))
        state.check_length(len(ids), max_tokens, field)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = req.sampling_params(max_tokens, logprobs)
        job = await _submit(state, [(None, ids)], params)
        view = fmt.ChatView(state, req, [(None, ids)], job.created, job.id)
        if req.stream:
            return _sse(state, job, _stream(state, job, view, req.include_usage))
        return JSONResponse(view.full(await _collect(state, job, raw)))


def _completion_prompts(req: CompletionRequest, tok: Tokenizer) -> list[tuple[str | None, list[int]]]:
    p = req.prompt
    if isinstance(p, str):
        items: list[str | list[int]] = [p]
    elif p and all(isinstance(x, int) for x in p):
        items = [list(p)]  # type: ignore[arg-type]
    else:
        items = list(p)  # type: ignore[arg-type]
    if not items:
        raise APIError(400, "prompt is empty", "prompt")
    out: list[tuple[str | None, list[int]]] = []
    for item in items:
        ids = tok.encode(item) if isinstance(item, str) else list(item)
        if not ids:
            raise APIError(400, "prompt is empty; give at least one token of text", "prompt")
        bad = [t for t in ids if not 0 <= t < tok.vocab_size]
        if bad:
            raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary (0..{tok.vocab_size - 1})", "prompt")
        out.append((item if isinstance(item, str) else None, ids))
    return out


class _Job:
    """The engine requests behind one HTTP request (one per prompt)."""

    def __init__(self, request_ids: list[str], queues: list[asyncio.Queue[RequestOutput | BaseException]]) -> None:
        self.id = uuid.uuid4().hex
        self.created = int(time.time())
        self.request_ids = request_ids
        self.queues = queues


async def _submit(state: ServerState, prompts: list[tuple[str | None, list[int]]], params: SamplingParams) -> _Job:
    rids: list[str] = []
    queues: list[asyncio.Queue[RequestOutput | BaseException]] = []
    try:
        for text, ids in prompts:
            rid, q = await state.engine.add(ids, params, text)
            rids.append(rid)
            queues.append(q)
    except BaseException:
        for rid in rids:
            state.engine.abort(rid)
        raise
    state.metrics.on_request(sum(len(ids) for _, ids in prompts))
    return _Job(rids, queues)


def _abort_job(state: ServerState, job: _Job) -> None:
    """Abort the job's requests (a no-op for finished ones): their KV blocks go back to the pool."""
    for rid in job.request_ids:
        state.engine.abort(rid)
        state.metrics.forget(rid)


async def _watch_disconnect(raw: Request, state: ServerState, job: _Job) -> None:
    """A non-streaming client that goes away (a timeout, a retry) must not keep its requests running."""
    while not await raw.is_disconnected():
        await asyncio.sleep(0.5)
    _abort_job(state, job)


async def _collect(state: ServerState, job: _Job, raw: Request) -> list[RequestOutput]:
    """The final output of each prompt; on an error, a cancelled handler or a client that
    disconnects, the requests are aborted."""
    finals: list[RequestOutput] = []
    watcher = asyncio.create_task(_watch_disconnect(raw, state, job))
    try:
        for q in job.queues:
            while True:
                item = await q.get()
                if isinstance(item, EngineDead):
                    raise item  # 503: the server cannot serve now, not a fault of this request
                if isinstance(item, BaseException):
                    raise APIError(500, str(item), None, "server_error")
                state.metrics.on_output(item)
                if item.finished:
                    finals.append(item)
                    break
    finally:
        watcher.cancel()
        if len(finals) < len(job.queues):
            _abort_job(state, job)
    return finals


async def _merged(job: _Job) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of all the job's requests as they come: (prompt index, output)."""
    merged: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()

    async def pump(i: int, q: asyncio.Queue[RequestOutput | BaseException]) -> None:
        while True:
            item = await q.get()
            await merged.put((i, item))
            if isinstance(item, BaseException) or item.finished:
                return

    tasks = [asyncio.create_task(pump(i, q)) for i, q in enumerate(job.queues)]
    try:
        open_count = len(tasks)
        while open_count:
            i, item = await merged.get()
            if isinstance(item, BaseException):
                raise APIError(500, str(item), None, "server_error")
            if item.finished:
                open_count -= 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _stream(state: ServerState, job: _Job, view: fmt.View, include_usage: bool) -> AsyncIterator[str]:
    finished: list[RequestOutput] = []
    try:
        for chunk in view.opening():
            yield _event(chunk)
        async for i, out in _merged(job):
            state.metrics.on_output(out)
            for chunk in view.chunks(i, out):
                yield _event(chunk)
            if out.finished:
                finished.append(out)
        if include_usage:
            yield _event(view.usage_chunk(finished))
    except APIError as e:
        yield _event({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}})
    finally:
        if len(finished) < len(job.request_ids):  # the client went away (or an error): free the blocks
            _abort_job(state, job)
    yield "data: [DONE]\n\n"


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _AbortingStream(StreamingResponse):
    """Aborts the job however the response ends: a client that disconnects before the first chunk
    cancels the response without ever starting the generator, so its `finally` cannot do it."""

    def __init__(self, state: ServerState, job: _Job, gen: AsyncIterator[str]) -> None:
        super().__init__(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._state, self._job = state, job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            _abort_job(self._state, self._job)  # no-op for requests that finished


def _sse(state: ServerState, job: _Job, gen: AsyncIterator[str]) -> StreamingResponse:
    return _AbortingStream(state, job, gen)
