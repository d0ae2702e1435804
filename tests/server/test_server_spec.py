"""The server with speculative decoding: same greedy text as the plain server, streamed, and the
acceptance counters on /metrics."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL, running_server


def test_speculating_server_matches_plain_and_reports_acceptance(server) -> None:
    openai = pytest.importorskip("openai")
    llm = server["llm"].with_speculation({"method": "ngram", "num_speculative_tokens": 4})
    with running_server(llm) as (base, _):
        spec_client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Repeat exactly: one two three four five six seven eight."}]
        kw = {"model": MODEL, "messages": messages, "max_tokens": 40, "temperature": 0}
        plain = server["client"].chat.completions.create(**kw).choices[0].message.content
        spec = spec_client.chat.completions.create(**kw).choices[0].message.content
        assert spec == plain
        streamed = "".join(c.choices[0].delta.content or "" for c in spec_client.chat.completions.create(
            **kw, stream=True) if c.choices)
        assert streamed == plain
        metrics = httpx.get(f"{base}/metrics").text
        drafted = [ln for ln in metrics.splitlines() if ln.startswith('brisk_spec_draft_tokens{method="ngram"}')]
        assert drafted and float(drafted[0].split()[-1]) > 0
        assert 'brisk_spec_acceptance_rate{method="ngram"}' in metrics
