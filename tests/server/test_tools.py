"""Tool calling's pieces without a server: the parser on every format (streamed at every cut ==
whole), the grammars tool_choice uses (on the real tokenizer), and the prompt side (brisk's
default for templates without tools, HF's conventions for templates with them)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from brisk.server.tools import (
    FORMATS,
    ToolCallScanner,
    calls_grammar,
    calls_schema,
    closed_objects,
    default_messages,
    detect_format,
    parse_all,
    plan_tools,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"],
    "$defs": {"zone": {"type": "string", "enum": ["utc", "cet"]}}}}}


def _streamed(fmt: str, text: str, eager: bool, step: int, max_calls: int | None = None) -> tuple[str, list[tuple]]:
    scanner = ToolCallScanner(FORMATS[fmt], eager, max_calls)
    content, calls = "", {}
    pieces = [scanner.feed(text[i:i + step]) for i in range(0, len(text), step)] + [scanner.finish()]
    for p in pieces:
        content += p.content
        for c in p.calls:
            if c.id is not None:
                assert c.index not in calls, "a call is announced once"
                calls[c.index] = [c.name, ""]
            calls[c.index][1] += c.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)]


CASES = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}"}]}}'
               '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me look.", [("get_weather", '{"city": "Paris", "n": [1, {"a": "}"}]}'), ("get_time", "{}")]),
    ("hermes", "No call here, just a < sign.", "No call here, just a < sign.", []),
    ("hermes", '<tool_call>\n{"arguments": {"q": 1}, "name": "late"}\n</tool_call>', "", [("late", '{"q": 1}')]),
    ("hermes", '<tool_call>\n{"name": "no_args"}\n</tool_call>', "", [("no_args", "{}")]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "b", "parameters": {}}', "",
     [("get_weather", '{"city": "Oslo"}'), ("b", "{}")]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": "y"}}', "", [("a", '{"x": "y"}')]),
    ("llama3_json", "The set {1, 2} is small.", "The set {1, 2} is small.", []),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": "]"}}]',
     "Sure.", [("a", '{"x": 1}'), ("b", '{"y": "]"}')]),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
@pytest.mark.parametrize("eager", [False, True])
def test_parser_cuts_streamed_text_as_it_cuts_the_whole(fmt: str, text: str, content: str, calls: list,
                                                       eager: bool) -> None:
    whole_content, whole_calls = parse_all(FORMATS[fmt], text, eager, None)
    assert whole_content == content
    assert [(c.name, c.arguments) for c in whole_calls] == calls
    for call in whole_calls:
        assert call.id.startswith("call_")
        json.loads(call.arguments)
    for step in (1, 2, 5, 11, len(text)):
        assert _streamed(fmt, text, eager, step) == (content, calls), step


def test_arguments_a_model_wrote_as_a_json_string_are_that_string() -> None:
    text = '<tool_call>\n{"name": "as_text", "arguments": "{\\"x\\": 1}"}\n</tool_call>'
    for step in (1, len(text)):
        assert _streamed("hermes", text, False, step) == ("", [("as_text", '{"x": 1}')])


def test_a_malformed_call_of_a_free_answer_is_content_and_parallel_off_keeps_one() -> None:
    text = '<tool_call>\n{"name": "x", oops}\n</tool_call> done'
    for step in (1, 3, len(text)):
        assert _streamed("hermes", text, False, step) == (text, [])
    unfinished = '<tool_call>\n{"name": "cut", "arguments": {"q": '
    assert _streamed("hermes", unfinished, False, 4) == (unfinished, [])
    two = CASES[0][1]
    content, calls = parse_all(FORMATS["hermes"], two, False, max_calls=1)
    assert [c.name for c in calls] == ["get_weather"] and content == "Let me look."


def test_eager_streaming_announces_the_name_before_the_arguments_end() -> None:
    scanner = ToolCallScanner(FORMATS["hermes"], eager=True)
    first = scanner.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [(c.name, c.arguments) for c in first.calls] == [("get_weather", ""), (None, '{"ci')]
    rest = scanner.feed('ty": "Rome"}}\n</tool_call>')
    rest += scanner.finish()
    assert "".join(c.arguments for c in rest.calls) == 'ty": "Rome"}' and not rest.content


def test_closed_objects_and_merged_defs() -> None:
    closed = closed_objects(WEATHER["function"]["parameters"])
    assert closed["additionalProperties"] is False
    assert closed_objects({"type": "object", "properties": {}, "additionalProperties": True})["additionalProperties"]
    schema = calls_schema([WEATHER, CLOCK], "arguments")
    assert [o["properties"]["name"]["const"] for o in schema["anyOf"]] == ["get_weather", "get_time"]
    assert schema["$defs"]["tool1"]["properties"]["zone"] == {"$ref": "#/$defs/tool1_zone"}
    assert "tool1_zone" in schema["$defs"]


@pytest.fixture(scope="module")
def tokenizer(gguf_path: Any) -> Any:
    from brisk.loader.gguf_loader import open_gguf
    from brisk.loader.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(open_gguf(gguf_path).metadata)


def _accepts(tokenizer: Any, grammar: str, text: str, special: list[int] = ()) -> bool:
    llguidance = pytest.importorskip("llguidance")
    ll = llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=tokenizer.vocab_size,
                                eos_token=sorted(tokenizer.eos_token_ids))
    assert not llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll)[0]
    matcher = llguidance.LLMatcher(ll, grammar)
    ids = list(special) + tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()


def test_required_grammars_accept_calls_and_nothing_else(tokenizer: Any) -> None:
    hermes = calls_grammar(FORMATS["hermes"], [WEATHER, CLOCK], True, tokenizer.special_token_id)
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>'
    assert _accepts(tokenizer, hermes, one) and _accepts(tokenizer, hermes, two)
    assert not _accepts(tokenizer, hermes, "Sure! " + one)  # no free text
    assert not _accepts(tokenizer, hermes, one.replace('"Paris"}', '"Paris", "maxLength": 4}'))  # closed
    assert not _accepts(tokenizer, hermes, one.replace("get_weather", "get_wether"))
    single = calls_grammar(FORMATS["hermes"], [WEATHER, CLOCK], False, tokenizer.special_token_id)
    assert _accepts(tokenizer, single, one) and not _accepts(tokenizer, single, two)
    llama = calls_grammar(FORMATS["llama3_json"], [WEATHER], True, tokenizer.special_token_id)
    assert _accepts(tokenizer, llama, '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    # Mistral's [TOOL_CALLS] is a control token, named by id in the grammar (here <|im_end|>, id 2,
    # stands in for it): its spelling as plain text does not open the list
    mistral = calls_grammar(FORMATS["mistral"], [WEATHER], True, lambda t: 2 if t == "[TOOL_CALLS]" else None)
    assert "<[2]>" in mistral
    body = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    assert _accepts(tokenizer, mistral, body, special=[2])
    assert not _accepts(tokenizer, mistral, "[TOOL_CALLS]" + body)


def test_default_prompt_for_a_template_without_tools(tokenizer: Any) -> None:
    assert not tokenizer.template_takes_tools
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
                {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 19}'}]
    out = default_messages(messages, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in out[0]["content"] and "<tools>" in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert out[3]["content"] == '<tool_response>\n{"temp": 18}\n</tool_response>\n<tool_response>\n{"temp": 19}\n' \
                                '</tool_response>'
    prompt = tokenizer.apply_chat_template(out)
    assert prompt.count("<|im_start|>system") == 1  # the template adds no second system turn
    plan = plan_tools(messages, [WEATHER], "required", None, tokenizer, FORMATS["mistral"])
    assert plan.fmt.name == "hermes" and plan.grammar is not None and plan.parse and plan.max_calls is None
    assert plan_tools(messages, [WEATHER], "none", None, tokenizer, FORMATS["hermes"]).parse is False
    named = plan_tools(messages, [WEATHER, CLOCK], {"type": "function", "function": {"name": "get_time"}}, None,
                       tokenizer, FORMATS["hermes"])
    assert named.max_calls == 1 and "get_weather" not in named.grammar


# A small Qwen-style template that reads `tools` (written for this test): calls as <tool_call>
# blocks with the arguments object, tool results as <tool_response> in a user turn.
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
Tools:{% for t in tools %}
{{ t | tojson }}{% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% elif m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_template_that_takes_tools_gets_them_in_hf_shape(tokenizer: Any) -> None:
    from brisk.loader.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer._backend, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                    add_bos=False, chat_template=TOOL_TEMPLATE)
    assert tok.template_takes_tools and detect_format(tok.template_source) == "hermes"
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    plan = plan_tools(messages, [WEATHER], None, None, tok, FORMATS["hermes"])
    prompt = tok.apply_chat_template(plan.messages, tools=plan.template_tools)
    assert json.dumps(WEATHER) in prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>' in prompt  # an object
    assert "<tool_response>sunny</tool_response>" in prompt
    assert detect_format("{{ '[TOOL_CALLS]' }} {{ tools }}") == "mistral"
    assert detect_format("{{ '<|python_tag|>' }} {{ tools }}") == "llama3_json"
