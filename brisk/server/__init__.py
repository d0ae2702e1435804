"""The OpenAI-compatible server: `brisk serve` (see app.py for the API)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from brisk.errors import UserError

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

    from brisk.engine.llm import LLM
    from brisk.server.edge import EdgeLimits

API_KEY_ENV = "BRISK_API_KEY"


def build_app(llm: LLM, api_key: str | None = None, max_waiting: int = 256, limits: EdgeLimits | None = None,
              tool_parser: str | None = None) -> FastAPI:
    """The FastAPI app over `llm`'s engine, with the engine thread started. `tool_parser`: a name
    in server.tools.FORMATS (default: the one the model's chat template shows)."""
    from brisk.engine.async_engine import AsyncEngine
    from brisk.server.app import ServerState, create_app

    if llm._probe is not None and llm._probe.active:
        raise UserError("Probe Pruning decides heads and channels per batch of prompts (LLM.generate, `brisk "
                         "generate`, `brisk eval ppl`); a server's requests come and go one at a time: serve a "
                         "statically pruned model instead (`brisk prune --method structured`)")
    engine = AsyncEngine(llm.engine, max_waiting=max_waiting)
    engine.start()
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    state = ServerState(engine, llm.tokenizer, llm.model_name, llm.max_model_len, key, tool_parser)
    return create_app(state, limits)


def uvicorn_config(app: FastAPI, host: str, port: int, limits: EdgeLimits | None = None,
                   graceful_seconds: int = 10) -> uvicorn.Config:
    """uvicorn's settings for brisk: the edge protocol (JSON errors from the HTTP layer, a
    connection cap, head deadlines) over h11."""
    import uvicorn

    from brisk.server.edge import EdgeLimits, protocol_class

    return uvicorn.Config(app, host=host, port=port, log_level="warning", http=protocol_class(limits or EdgeLimits()),
                          timeout_graceful_shutdown=graceful_seconds)


def serve(llm: LLM, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_waiting: int = 256, graceful_seconds: int = 10, limits: EdgeLimits | None = None,
          tool_parser: str | None = None) -> None:
    """Run until SIGINT/SIGTERM: uvicorn stops accepting, lets running requests finish for up to
    `graceful_seconds`, then the engine thread stops; the process exits 0."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn drains, then re-raises the signal so the process dies of it (status -15);
            # a server asked to stop that stopped cleanly should say so: exit 0.
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()

    app = build_app(llm, api_key, max_waiting, limits, tool_parser)
    try:
        _Server(uvicorn_config(app, host, port, limits, graceful_seconds)).run()
    finally:
        app.state.brisk.engine.shutdown()
