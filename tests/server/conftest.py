"""A live `brisk serve` app on 127.0.0.1 for the server tests (one per test session)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

MODEL = "smollm2-135m"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def server(gguf_path: Path) -> Iterator[dict[str, Any]]:
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from brisk.engine.llm import LLM

    llm = LLM(MODEL, num_kv_blocks=512, max_model_len=1024, max_num_seqs=64)
    with running_server(llm) as (base, app):
        yield {"base": base, "llm": llm, "state": app.state.brisk,
               "client": openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)}


@contextlib.contextmanager
def running_server(llm: Any, limits: Any = None) -> Iterator[tuple[str, Any]]:
    """`brisk serve`'s app for `llm` on a free local port, in a thread, with serve's uvicorn
    settings (`limits`: an EdgeLimits, or the defaults): (base URL, app)."""
    uvicorn = pytest.importorskip("uvicorn")
    from brisk.server import build_app, uvicorn_config

    app = build_app(llm, api_key="", limits=limits)
    port = _free_port()
    srv = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, limits))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        srv.should_exit = True
        thread.join(10)
        app.state.brisk.engine.shutdown()


def leave_mid_stream(base: str, chunks: int = 3) -> list[dict[str, Any]]:
    """Stream a long completion and hang up after `chunks` chunks (a client that goes away)."""
    import json

    import httpx

    body = {"model": MODEL, "prompt": "Write a long story about a dragon.", "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    lines: list[dict[str, Any]] = []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(json.loads(line[6:]))
            if len(lines) >= chunks:
                break  # leave mid-stream
    return lines
