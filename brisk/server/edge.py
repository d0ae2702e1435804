"""The server's edge: what happens to bytes before a handler sees a request.

    socket ──► EdgeProtocol (uvicorn's h11 protocol)   connection cap, a deadline for each request's
       │                                               head, the HTTP layer's own errors as JSON
       ▼
    Guard (ASGI middleware)                            credentials, the body read in full with a byte
       │                                               limit and a deadline (chunked bodies too)
       ▼
    SanitizingRoute (FastAPI)                          JSON parsed off the event loop; lone UTF-16
       │                                               surrogates in any string become U+FFFD
       ▼
    handler

Every refusal is OpenAI's error JSON. Refusals that leave part of a request unread (a body over
the limit, a body or head that came too slowly) also close the connection: its next bytes could
not be told apart from a new request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from brisk.errors import UserError

_AUTH_PREFIXES = ("/v1", "/tokenize", "/detokenize")
_DRAIN_FACTOR = 4  # an oversized body is read and dropped up to this many times the limit


@dataclass(frozen=True)
class EdgeLimits:
    """How much a client may ask of the HTTP layer before it is refused."""

    max_body_bytes: int = 4 * 2**20  # 413 beyond this, counted as the bytes arrive
    body_timeout_s: float = 30.0  # the whole body must arrive within this (408 otherwise)
    head_timeout_s: float = 30.0  # a request line and headers must arrive within this (408)
    max_connections: int = 1024  # open connections; one more is answered 503 and closed

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "body_timeout_s", "head_timeout_s", "max_connections"):
            if not getattr(self, name) > 0:
                raise UserError(f"{name} must be > 0, got {getattr(self, name)!r}")


def error_body(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, kind), status_code=status, headers=headers)


def _closing(status: int, message: str) -> JSONResponse:
    return error_response(status, message, headers={"Connection": "close"})


# ---------------------------------------------------------------------------------------- ASGI guard
class Guard:
    """Plain ASGI middleware (Starlette's BaseHTTPMiddleware wraps `receive`, and through it a
    handler never hears that its client disconnected). It reads the whole body before the app
    runs, so no handler ever waits on a slow client or holds more than `max_body_bytes` of one."""

    def __init__(self, app: Any, api_key: Callable[[], str | None], limits: EdgeLimits) -> None:
        self.app, self.api_key, self.limits = app, api_key, limits

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is None:
            body, refusal = await self._read_body(receive, self._declared_too_long(scope))
            if body is None and refusal is None:
                return  # the client went away mid-body: nobody to answer
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, _replay(body or b"", receive), send)

    def _declared_too_long(self, scope: Any) -> bool:
        lengths = _header_values(scope, b"content-length")
        return bool(lengths) and lengths[0].isdigit() and int(lengths[0]) > self.limits.max_body_bytes

    def _refusal(self, scope: Any) -> JSONResponse | None:
        key = self.api_key()
        if key and scope.get("path", "").startswith(_AUTH_PREFIXES):
            auths = [v.decode("latin-1") for v in _header_values(scope, b"authorization")]
            if len(auths) > 1:
                return error_response(400, f"{len(auths)} Authorization headers were sent; send exactly one",
                                      None, "authentication_error")
            auth = auths[0] if auths else ""
            given = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), key.encode()):
                return error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                      None, "authentication_error")
        return None

    async def _read_body(self, receive: Any, too_long: bool) -> tuple[bytes | None, JSONResponse | None]:
        """(body, None), (None, refusal), or (None, None) when the client disconnected.

        A body over the limit (declared, or counted as a chunked one arrives) is read to its end and
        dropped before the 413 goes out, up to `_DRAIN_FACTOR` times the limit: closing a socket
        with unread bytes resets it, and the client would never see the answer."""
        limit, chunks, size = self.limits.max_body_bytes, [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return None, _closing(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s; "
                                           "send it at once")
            if message["type"] == "http.disconnect":
                return None, None
            chunk = message.get("body", b"")
            size += len(chunk)
            too_long = too_long or size > limit
            if not too_long:
                chunks.append(chunk)
            done = not message.get("more_body", False)
            if too_long and (done or size > _DRAIN_FACTOR * limit):
                return None, _closing(413, f"request body is over the {limit}-byte limit; send less")
            if done:
                return b"".join(chunks), None


def _header_values(scope: Any, name: bytes) -> list[bytes]:
    """Every value of header `name` (lower case; ASGI servers give names in lower case)."""
    return [v for k, v in scope.get("headers", []) if k.lower() == name]


def _replay(body: bytes, receive: Any) -> Callable[[], Coroutine[Any, Any, dict[str, Any]]]:
    """A `receive` that hands the app the body already read, then listens for the disconnect."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


# ---------------------------------------------------------------------------------------- JSON bodies
_SURROGATE = re.compile("[\ud800-\udfff]")
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def without_lone_surrogates(value: Any) -> Any:
    """Every string in a parsed JSON value (keys too) with lone UTF-16 surrogates replaced by U+FFFD.

    JSON may escape half of a surrogate pair ("\\ud800"); Python then holds a string no UTF-8 codec,
    tokenizer or response can carry. json.loads already joins valid pairs into one character, so
    any surrogate left is lone: it becomes U+FFFD, as a UTF-8 decoder treats broken bytes."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [without_lone_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {without_lone_surrogates(k): without_lone_surrogates(v) for k, v in value.items()}
    return value


def parse_json(body: bytes) -> Any:
    value = json.loads(body)
    return without_lone_surrogates(value) if _ESCAPED_SURROGATE.search(body) else value


class _SanitizedRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            # a 4 MiB body takes tens of ms to parse: off the event loop, like tokenizing
            self._json = await asyncio.to_thread(parse_json, body) if len(body) > 65536 else parse_json(body)
        return self._json


class SanitizingRoute(APIRoute):
    """Routes whose JSON bodies go through `parse_json` (FastAPI's documented custom-request hook)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_SanitizedRequest(request.scope, request.receive))

        return route


# ---------------------------------------------------------------------------------------- HTTP layer
def _raw_error(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection, for the layer below ASGI."""
    body = json.dumps(error_body(status, message)).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("latin-1") + body


class EdgeProtocol(H11Protocol):
    """uvicorn's h11 protocol with three changes: the errors uvicorn answers itself (a malformed
    request line, a NUL in the path, a bad Content-Length) are OpenAI JSON instead of text; a
    connection beyond `max_connections` gets a 503; a request head that has not arrived within
    `head_timeout_s` of the connection opening (or of the previous response) ends the connection."""

    limits = EdgeLimits()  # replaced per server by `protocol_class`

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._refused = len(self.connections) > self.limits.max_connections
        self._head_timer: asyncio.TimerHandle | None = None
        if not self._refused:
            self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._refused:  # answer once the request has come, so the client is reading
            self._send_raw(503, f"the server has {self.limits.max_connections} connections open, its limit; "
                                "retry shortly")
            return
        super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()  # a kept-alive connection's next request gets its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._send_raw(400, f"malformed HTTP request ({msg.rstrip('.')}); check the request line and headers")

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_late)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is in progress: its body has the Guard's own deadline
        if self.cycle is None:
            self._send_raw(408, f"no complete request head arrived within {self.limits.head_timeout_s:g} s")
        else:
            self.transport.close()  # idle between requests: close quietly, as keep-alive expiry does

    def _send_raw(self, status: int, message: str) -> None:
        if not self.transport.is_closing():
            self.transport.write(_raw_error(status, message))
            self.transport.close()


def protocol_class(limits: EdgeLimits) -> type[EdgeProtocol]:
    """EdgeProtocol bound to one server's limits (uvicorn builds protocols from a class)."""
    return type("BriskEdgeProtocol", (EdgeProtocol,), {"limits": limits})
