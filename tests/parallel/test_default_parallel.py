"""The default model (9 heads, 3 KV heads, 30 layers) over 3 tensor-parallel ranks and over 2
pipeline stages: one process's greedy tokens through LLM.generate and through the server."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from brisk import LLM, SamplingParams
from tests.server.conftest import MODEL, running_server

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "Three facts about the Moon:"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def single(brisk_llm: LLM) -> dict[str, object]:
    """One process's answers: the tokens of PROMPTS and the text of a chat completion."""
    tokens = [o.outputs[0].token_ids for o in brisk_llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    chat = brisk_llm.chat(CHAT, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)[0].outputs[0].text
    return {"tokens": tokens, "chat": chat}


@pytest.fixture(scope="module", params=[(3, 1), (1, 2)], ids=["tp3", "pp2"])
def parallel_llm(request: pytest.FixtureRequest, gguf_path: object) -> Iterator[LLM]:
    tp, pp = request.param
    with LLM(MODEL, max_model_len=1024, num_kv_blocks=256, tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
        yield llm


def test_parallel_generate_and_server_match_one_process(parallel_llm: LLM, single: dict[str, object]) -> None:
    openai = pytest.importorskip("openai")
    tokens = [o.outputs[0].token_ids for o in parallel_llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert tokens == single["tokens"]
    with running_server(parallel_llm) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
        assert reply.choices[0].message.content == single["chat"]
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=16, temperature=0, stream=True) if c.choices)
        assert streamed == single["chat"]
        assert httpx.get(f"{base}/health").status_code == 200
        metrics = httpx.get(f"{base}/metrics").text
        tp, pp = parallel_llm.parallel.tensor_parallel_size, parallel_llm.parallel.pipeline_parallel_size
        assert f"brisk_tensor_parallel_size {tp:.1f}" in metrics and f"brisk_pipeline_parallel_size {pp:.1f}" in metrics
        sent = [ln for ln in metrics.splitlines() if ln.startswith("brisk_parallel_rank0_comm_bytes ")]
        assert sent and float(sent[0].split()[-1]) > 0
