"""Structured outputs through `brisk serve` with the official openai client: response_format
json_schema / json_object on chat, vLLM's guided_* extras on completions, streamed and whole
answers alike, bad schemas a 400 naming the field."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 30},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action", "horror"]}, "minItems": 1,
                   "maxItems": 3},
        "rating": {"type": "number", "minimum": 0, "maximum": 10},
        "director": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30}},
                     "required": ["name"], "additionalProperties": False},
    },
    "required": ["title", "year", "genres", "rating", "director"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "movie", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a movie as JSON."}]


def test_json_schema_samples_all_validate(server: dict[str, Any]) -> None:
    out = server["client"].chat.completions.create(model="smollm2-135m", messages=MESSAGES, response_format=FORMAT,
                                                    temperature=1.0, seed=11, n=16, max_tokens=160)
    assert len(out.choices) == 16
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_and_whole_answers_agree(server: dict[str, Any]) -> None:
    client = server["client"]
    kwargs: dict[str, Any] = dict(model="smollm2-135m", messages=MESSAGES, response_format=FORMAT, temperature=0,
                                  max_tokens=160)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        stream=True, **kwargs) if chunk.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), SCHEMA)
    obj = client.chat.completions.create(model="smollm2-135m", messages=MESSAGES, temperature=0, max_tokens=80,
                                         response_format={"type": "json_object"}).choices[0].message.content
    assert isinstance(json.loads(obj), dict)


def test_guided_extras_on_completions(server: dict[str, Any]) -> None:
    client = server["client"]
    out = client.completions.create(model="smollm2-135m", prompt="A phone number:", max_tokens=20, temperature=1.0,
                                    n=6, seed=2, extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"})
    assert all(re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", c.text) for c in out.choices)
    out = client.completions.create(model="smollm2-135m", prompt="The best fruit is", max_tokens=5, temperature=1.0,
                                    n=6, seed=2, extra_body={"guided_choice": ["apple", "pear", "plum"]})
    assert all(c.text in ("apple", "pear", "plum") for c in out.choices)
    out = client.completions.create(model="smollm2-135m", prompt="JSON:", max_tokens=60, temperature=0,
                                    extra_body={"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                                "required": ["ok"]}})
    assert isinstance(json.loads(out.choices[0].text)["ok"], bool)


def test_a_schema_that_cannot_compile_is_a_400_naming_the_field(server: dict[str, Any]) -> None:
    openai = pytest.importorskip("openai")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    with pytest.raises(openai.BadRequestError) as err:
        server["client"].chat.completions.create(model="smollm2-135m", messages=MESSAGES, response_format=bad,
                                                 max_tokens=4)
    assert err.value.body["param"] == "response_format" and "objekt" in err.value.body["message"]
    assert not server["llm"].engine.has_unfinished_requests()
