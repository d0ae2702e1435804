"""The OpenAI-compatible HTTP API over an AsyncEngine.

Handlers validate, turn the body into prompt ids and SamplingParams, queue the request and
either collect its final output or stream Server-Sent Events (`data: {...}` chunks, then
`data: [DONE]`). Every error leaves as OpenAI's error JSON with the offending field in `param`;
a client that disconnects mid-stream has its request aborted and its KV blocks freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from brisk.engine.async_engine import AsyncEngine, EngineDead, EngineOverloaded
from brisk.engine.outputs import RequestOutput
from brisk.errors import InvalidRequest, UserError
from brisk.loader.tokenizer import Tokenizer
from brisk.request import SamplingParams
from brisk.server import formatting as fmt
from brisk.server import tools
from brisk.server.edge import (
    EdgeLimits,
    Guard,
    SanitizingRoute,
    error_body,
    error_response,
)
from brisk.server.metrics import ServerMetrics
from brisk.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    ToolDef,
    validation_message,
)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers


_T = TypeVar("_T")


class ServerState:
    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, model_name: str, max_model_len: int,
                 api_key: str | None, tool_parser: str | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        # how this model writes tool calls: the parser asked for, or the one its template shows
        self.tool_format = tools.FORMATS[tool_parser or tools.detect_format(tokenizer.template_source)]
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.api_key = api_key
        self.metrics = ServerMetrics(engine)
        # Tokenizing, chat templates, detokenizing and big responses run here, never on the event
        # loop: two threads bound how much of the machine request handling takes from the engine.
        self.cpu = ThreadPoolExecutor(max_workers=2, thread_name_prefix="brisk-http")

    async def run_cpu(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self.cpu, fn, *args)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "not_found_error")

    def check_length(self, prompt_len: int, max_tokens: int, field: str) -> None:
        if prompt_len + max_tokens > self.max_model_len:
            raise APIError(400, f"this model's context window is {self.max_model_len} tokens; the prompt has "
                                f"{prompt_len} tokens and {field} asks for {max_tokens} more "
                                f"({prompt_len + max_tokens}); shorten the prompt or lower {field}", field)


def create_app(state: ServerState, limits: EdgeLimits | None = None) -> FastAPI:
    # No trailing-slash redirects: their Location would be built from the client's Host header.
    app = FastAPI(title="brisk", docs_url=None, redoc_url=None, redirect_slashes=False)
    app.router.route_class = SanitizingRoute
    app.state.brisk = state
    _install_errors(app)
    app.add_middleware(Guard, api_key=lambda: state.api_key, limits=limits or EdgeLimits())
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
        return error_response(400, f"{param or 'body'}: {validation_message(err)}", param)

    @app.exception_handler(InvalidRequest)
    async def _invalid_request(_: Request, e: InvalidRequest) -> JSONResponse:
        return error_response(400, str(e), e.param)

    @app.exception_handler(UserError)
    async def _user(_: Request, e: UserError) -> JSONResponse:
        # only brisk's user-error type is the client's fault: any other ValueError is a bug here (500)
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
        # Starlette re-raises after answering and uvicorn then drops the connection: say so, so a
        # client does not send its next request down a socket about to close.
        return error_response(500, f"internal error: {type(e).__name__}: {e}", None, "server_error",
                              {"Connection": "close"})


def _install_routes(app: FastAPI, state: ServerState) -> None:
    _install_info_routes(app, state)
    _install_generation_routes(app, state)


def _install_info_routes(app: FastAPI, state: ServerState) -> None:
    """The chat page, health, models, metrics, tokenize and detokenize."""
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
    async def tokenize(req: TokenizeRequest) -> Response:
        state.check_model(req.model)
        if req.messages is None and req.prompt is None:
            raise APIError(400, "give 'prompt' or 'messages'", "prompt")
        return await state.run_cpu(_tokenize, state, req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Response:
        state.check_model(req.model)
        return await state.run_cpu(_detokenize, state, req)


def _install_generation_routes(app: FastAPI, state: ServerState) -> None:
    """/v1/completions and /v1/chat/completions, whole or streamed."""

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        state.check_model(req.model)
        prompts = await state.run_cpu(_completion_prompts, req, state.tokenizer)  # a 4 MiB body takes a while
        max_tokens = req.max_tokens or 16
        for _, ids in prompts:
            state.check_length(len(ids), max_tokens, "max_tokens")
        params = await _structured_checked(state, req, max_tokens, req.logprobs)
        if req.echo and req.logprobs is not None:
            params.prompt_logprobs = req.logprobs
        job = await _submit(state, prompts, params)
        view = fmt.CompletionView(state, req, prompts, job.created, job.id)
        if req.stream:
            return _sse(state, job, _stream(state, job, view, req.include_usage))
        return await state.run_cpu(_full_response, view, await _collect(state, job, raw))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request) -> Response:
        state.check_model(req.model)
        req.check_tools()
        plan = _tool_plan(state, req.messages, req.tools, req.tool_choice, req.parallel_tool_calls)
        ids = await state.run_cpu(state.tokenizer.encode_chat, plan.messages, req.add_generation_prompt,
                                  plan.template_tools)
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        asked = req.max_completion_tokens or req.max_tokens
        max_tokens = asked if asked is not None else max(1, state.max_model_len - len(ids))
        state.check_length(len(ids), max_tokens, field)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        # a tool's schema that cannot compile is the `tools` field's fault
        tool_grammar = ("tools", {"grammar": plan.grammar}) if plan.grammar is not None else None
        params = await _structured_checked(state, req, max_tokens, logprobs, tool_grammar)
        if plan.keep_special:
            params = dataclasses.replace(params, skip_special_tokens=False)
        job = await _submit(state, [(None, ids)], params)
        view = fmt.ChatView(state, req, [(None, ids)], job.created, job.id, plan if plan.parse else None)
        if req.stream:
            return _sse(state, job, _stream(state, job, view, req.include_usage))
        return await state.run_cpu(_full_response, view, await _collect(state, job, raw))


def _tool_plan(state: ServerState, messages: list[ChatMessage], tool_defs: list[ToolDef] | None,
               tool_choice: str | BaseModel | None = None, parallel: bool | None = None) -> tools.ToolPlan:
    """How a conversation's tools (and earlier calls and results) enter the prompt, whether a
    grammar makes the answer a call, and how the answer is cut into content and calls."""
    choice = tool_choice.model_dump() if isinstance(tool_choice, BaseModel) else tool_choice
    return tools.plan_tools([m.as_dict() for m in messages],
                            [t.model_dump(exclude_none=True) for t in tool_defs] if tool_defs else None,
                            choice, parallel, state.tokenizer, state.tool_format)


async def _structured_checked(state: ServerState, req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                              logprobs: int | None, extra: tuple[str, dict[str, Any]] | None = None) -> SamplingParams:
    """The request's SamplingParams, its grammar (if any) compiled first off the event loop (then
    cached for the engine): a schema or regex that cannot compile is a 400 naming its field.
    `extra`: a grammar the server adds (field, spec), e.g. tool_choice's."""
    field, spec = req.structured()
    if extra is not None and field is not None:
        raise InvalidRequest(f"{field} and tool_choice (required or a named tool) both constrain the answer; "
                             "ask for one", field)
    if extra is not None:
        field, spec = extra
    try:
        params = req.sampling_params(max_tokens, logprobs)
        if extra is not None:
            params = dataclasses.replace(params, structured=spec)
        if spec is not None:
            await state.run_cpu(state.engine.engine.grammars().constraint, spec)
    except ValueError as e:
        if field is None or (isinstance(e, InvalidRequest) and e.param != "structured"):
            raise
        raise InvalidRequest(f"{field}: {e}", field) from None
    return params


def _tokenize(state: ServerState, req: TokenizeRequest) -> JSONResponse:
    """Tokenized and serialised off the event loop: a 4 MB prompt is ~1M ids, seconds of work."""
    if req.messages is not None:
        plan = _tool_plan(state, req.messages, req.tools)  # the prompt chat would build
        ids = state.tokenizer.encode_chat(plan.messages, True, plan.template_tools)
    else:
        ids = state.tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len})


def _detokenize(state: ServerState, req: DetokenizeRequest) -> JSONResponse:
    vocab = state.tokenizer.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "tokens")
    return JSONResponse({"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)})


def _full_response(view: fmt.View, finals: list[RequestOutput]) -> JSONResponse:
    """The whole response, formatted and serialised (echoes and logprobs can be megabytes)."""
    return JSONResponse(view.full(finals))


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
        yield _event(error_body(e.status, e.message, e.param, e.kind))
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
