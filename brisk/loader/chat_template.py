"""Chat templates: render a model's Jinja chat template into a prompt string.

Chat templates come from model files (GGUF metadata, tokenizer_config.json) and are untrusted
code, so they run in jinja2's immutable sandbox. The environment mirrors HF transformers'
(`trim_blocks`, `lstrip_blocks`, `raise_exception`, `strftime_now`, a non-escaping `tojson`,
`loopcontrols`, a pass-through `{% generation %}` tag) so that the same template yields the same
text as `AutoTokenizer.apply_chat_template(..., tokenize=False)`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from brisk.errors import UserError

# Roles the templates we know of understand. "ipython" is Llama 3's tool role, "developer"
# OpenAI's newer name for "system", "function" the legacy OpenAI tool role.
KNOWN_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "ipython", "function"})


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's built-in tojson HTML-escapes `<`, `>`, `&` and `'`, which would change the prompt
    # the model was trained on; HF overrides it the same way.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, so a template cannot plant dunder attributes."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja2's Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat template may not set attribute {name!r} on a namespace")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant spans for training masks in HF.
    Inference has no use for the marks, but templates using the tag must still compile."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


def _flatten_content(content: Any, index: int) -> Any:
    """OpenAI-style content parts `[{"type": "text", "text": ...}]` become one string: text-only
    models' templates concatenate `message['content']` and would otherwise print a Python list."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            expected = "{'type': 'text', 'text': str}"
            raise UserError(f"messages[{index}]['content'] parts must be {expected}, got {part!r}")
        texts.append(part["text"])
    return "".join(texts)


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check a conversation and return plain-dict copies of its messages (templates only read them).

    Contract: a non-empty list of dicts, each with a `role` from KNOWN_ROLES and a string
    `content`. An assistant message carrying `tool_calls` may have `content` None.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        kind = type(messages).__name__
        raise UserError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {kind}")
    if not messages:
        raise UserError("messages must contain at least one message")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise UserError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        if "role" not in message:
            raise UserError(f"messages[{i}] has no 'role'")
        role = message["role"]
        if not isinstance(role, str):
            raise UserError(f"messages[{i}]['role'] must be a string, got {role!r}")
        if role not in KNOWN_ROLES:
            raise UserError(f"messages[{i}] has unknown role {role!r}; expected one of {sorted(KNOWN_ROLES)}")
        if "content" not in message:
            raise UserError(f"messages[{i}] has no 'content'")
        content = _flatten_content(message["content"], i)
        if content is None and role == "assistant" and message.get("tool_calls"):
            pass
        elif not isinstance(content, str):
            raise UserError(f"messages[{i}]['content'] must be a string, got {type(content).__name__}")
        checked.append({**message, "content": content})
    return checked


class ChatTemplate:
    """A compiled chat template. Compiling once per model keeps rendering cheap per request."""

    def __init__(self, source: str) -> None:
        self.source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise UserError(f"the model's chat template does not compile: {e} (line {e.lineno})") from e

    def render(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool = True,
        bos_token: str | None = None,
        eos_token: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render `messages` (validated first). Errors raised by the template itself
        (`raise_exception("Conversation roles must alternate...")`) become ValueError."""
        checked = validate_messages(messages)
        try:
            return self._template.render(
                messages=checked,
                add_generation_prompt=add_generation_prompt,
                bos_token=bos_token or "",
                eos_token=eos_token or "",
                tools=tools,
                **extra,
            )
        except jinja2.exceptions.TemplateError as e:
            raise UserError(f"the chat template rejected the messages: {e}") from e


def render_chat_template(
    template: str | ChatTemplate | None,
    messages: Any,
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render `messages` with `template`; a model without one is a user-facing ValueError."""
    if template is None:
        raise UserError(
            "this model has no chat template; send a plain text prompt (completion) instead of chat messages"
        )
    compiled = template if isinstance(template, ChatTemplate) else ChatTemplate(template)
    return compiled.render(
        messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token, tools=tools
    )


# Gemma's chat format, the template Google ships with Gemma 3 (tokenizer_config.json), for GGUF
# files that carry none (llama.cpp then uses the same format, built in): a system message joins
# the first user turn, the assistant's role is "model", contents are trimmed.
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
