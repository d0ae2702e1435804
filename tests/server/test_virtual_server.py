"""`brisk serve` with the virtual KV layout: 64 concurrent streams and a client that leaves
mid-stream; every answer is the paged layout's, and once idle nothing stays committed."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from brisk.engine.llm import LLM
from brisk.request import SamplingParams
from tests.server.conftest import MODEL, leave_mid_stream, running_server

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def virtual_server(gguf_path: Any) -> Iterator[dict[str, Any]]:
    # without prefix caching, so "nothing committed once idle" holds (cached tiles would stay)
    llm = LLM(MODEL, kv_layout="virtual", enable_prefix_caching=False, max_model_len=1024, max_num_seqs=64)
    with running_server(llm) as (base, app):
        yield {"base": base, "llm": llm, "state": app.state.brisk}


def _nothing_committed(srv: dict[str, Any], timeout: float = 20.0) -> bool:
    eng = srv["llm"].engine
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not eng.has_unfinished_requests() and eng.virtual_kv.num_committed == 0:
            return eng.runner.virtual.resident_bytes() in (0, None)  # None: unreadable here (gVisor)
        time.sleep(0.05)
    return False


def test_64_concurrent_streams_get_the_paged_answers_and_give_every_page_back(
        virtual_server: dict[str, Any]) -> None:
    prompts = [f"Item {i}: the {'long ' * (i % 9)}list of things to pack is" for i in range(64)]

    async def one(client: Any, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                 stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=virtual_server["base"] + "/v1", api_key="unused", max_retries=0,
                                    timeout=300)
        return await asyncio.gather(*(one(client, p) for p in prompts))

    scheduler, peak, stop = virtual_server["llm"].engine.scheduler, [0], threading.Event()

    def watch() -> None:  # how many requests the engine runs at once (the server steps on its own thread)
        while not stop.is_set():
            peak[0] = max(peak[0], len(scheduler.running))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    texts = asyncio.run(main())
    stop.set()
    watcher.join()
    assert peak[0] >= 16, f"at most {peak[0]} requests ran at once: not concurrent"
    assert _nothing_committed(virtual_server)
    paged = LLM(MODEL, max_model_len=1024, max_num_seqs=64)
    expected = [o.outputs[0].text for o in paged.generate(prompts, SamplingParams(max_tokens=8, temperature=0),
                                                          use_tqdm=False)]
    assert texts == expected


def test_a_client_leaving_mid_stream_gives_its_pages_back(virtual_server: dict[str, Any]) -> None:
    lines = leave_mid_stream(virtual_server["base"])
    assert len(lines) == 3 and lines[0]["choices"][0]["finish_reason"] is None
    assert _nothing_committed(virtual_server, timeout=4.0)
