"""`brisk serve` as a process: it answers, and SIGTERM ends it cleanly with exit code 0."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("uvicorn")


def test_sigterm_exits_zero_after_serving(gguf_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "brisk.cli", "serve", "--port", str(port),
                             "--num-kv-blocks", "128", "--max-model-len", "512"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        r = httpx.post(base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
