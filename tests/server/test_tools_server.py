"""Tool calling through `brisk serve` with the official openai client: `tool_choice` required and
named always give calls that parse and fit the tool's schema, streamed calls arrive as OpenAI
streams them and agree with the whole answer, a call -> tool result -> answer round trip with the
client's own types, and every bad tool field a 400 naming it."""

from __future__ import annotations

import json
from typing import Any

import pytest
import httpx

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"],
                   "$defs": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}}}}}
TOOLS = [WEATHER, CLOCK]
BY_NAME = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
MODEL = "smollm2-135m"


def _check_call(name: str, arguments: str) -> None:
    assert name in BY_NAME
    args = json.loads(arguments)
    jsonschema.validate(args, BY_NAME[name])
    assert set(args) <= set(BY_NAME[name]["properties"])  # nothing the function does not declare


def _streamed(client: Any, **kwargs: Any) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) put together from the stream's chunks."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            if call.id is not None:  # the first piece of a call: id, type and name
                assert call.index not in calls and call.type == "function" and call.function.name
                calls[call.index] = [call.function.name, call.function.arguments or ""]
            else:
                assert call.function.name is None
                calls[call.index][1] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def test_required_always_gives_a_call_that_fits_its_schema(server: dict[str, Any]) -> None:
    out = server["client"].chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                    parallel_tool_calls=False, temperature=1.0, seed=5, n=16,
                                                    max_tokens=80)
    assert len(out.choices) == 16
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        _check_call(call.function.name, call.function.arguments)


def test_parallel_calls_each_fit_and_a_named_choice_calls_that_tool(server: dict[str, Any]) -> None:
    client = server["client"]
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                         temperature=0, max_tokens=120).choices[0]
    calls = out.message.tool_calls
    assert calls and len({c.id for c in calls}) == len(calls)
    complete = calls if out.finish_reason == "tool_calls" else calls[:-1]  # max_tokens may cut the last one
    assert complete
    for call in complete:
        _check_call(call.function.name, call.function.arguments)
    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, temperature=1.0,
                                         seed=3, n=4, max_tokens=60)
    for choice in out.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_time"
        _check_call(call.function.name, call.function.arguments)


@pytest.mark.parametrize("tool_choice", ["required", "auto", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_and_whole_answers_agree(server: dict[str, Any], tool_choice: Any) -> None:
    client = server["client"]
    kwargs: dict[str, Any] = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                  parallel_tool_calls=False, temperature=0, max_tokens=80)
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish = _streamed(client, **kwargs)
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert content == (whole.message.content or "") and finish == whole.finish_reason
    if tool_choice != "auto":
        assert finish == "tool_calls" and len(calls) == 1


def test_round_trip_call_then_tool_result_then_answer(server: dict[str, Any]) -> None:
    client = server["client"]
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=80)
    message = first.choices[0].message
    call = message.tool_calls[0]
    history = [*ASK, message, {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0,
                                            max_tokens=40).choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    content, calls, finish = _streamed(client, model=MODEL, messages=history, tools=TOOLS, temperature=0,
                                       max_tokens=40)
    assert (content, finish) == (answer.message.content or "", answer.finish_reason)
    # the call and its result reached the prompt, as brisk's default tool prompt writes them
    rendered = httpx.post(f"{server['base']}/tokenize", json={
        "messages": [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in history],
        "tools": TOOLS}, timeout=30).json()
    prompt = server["state"].tokenizer.decode(rendered["tokens"], skip_special_tokens=False)
    assert f'<tool_call>\n{{"name": "{call.function.name}", "arguments": {call.function.arguments}}}' in prompt
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in prompt and "<tools>" in prompt


BAD = [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [*ASK, {"role": "tool", "content": "18 C"}]}, "messages.1"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0"),
]


@pytest.mark.parametrize(("extra", "param"), BAD)
def test_bad_tool_fields_are_a_400_naming_the_field(server: dict[str, Any], extra: dict[str, Any],
                                                    param: str) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(f"{server['base']}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert not server["llm"].engine.has_unfinished_requests()


def test_gemma3_required_calls_fit_their_schema() -> None:
    """The second family: Gemma 3's template knows no tools either, so the default prompt, with
    the system text joined into the first user turn."""
    from brisk.loader.resolve import resolve_model
    from tests.server.conftest import running_server

    try:
        resolve_model("gemma3-270m")
    except (FileNotFoundError, ValueError) as e:
        pytest.skip(f"Gemma 3 270M not installed: {e}")
    openai = pytest.importorskip("openai")
    from brisk.engine.llm import LLM

    llm = LLM("gemma3-270m", num_kv_blocks=256, max_model_len=1024, max_num_seqs=8)
    with running_server(llm) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(model="gemma3-270m", messages=ASK, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=False, temperature=1.0, seed=1, n=8, max_tokens=80)
        for choice in out.choices:
            assert choice.finish_reason == "tool_calls"
            (call,) = choice.message.tool_calls
            _check_call(call.function.name, call.function.arguments)
