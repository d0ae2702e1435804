"""Tool (function) calling for /v1/chat/completions: the prompt side, the grammar side and the parser.

A `ToolFormat` is how one model family writes its calls; the registry below has the three in
common use (vLLM's parser names):
- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` per call (Hermes,
  Qwen2.5/Qwen3, and brisk's default prompt for templates that know no tools),
- `llama3_json`: `{"name": ..., "parameters": {...}}` as the whole answer, calls joined by `; `
  (Llama 3.1-3.3; `<|python_tag|>` may open it),
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (`[TOOL_CALLS]` a control token).

Prompt: a chat template that reads `tools` gets the OpenAI tool list and the conversation as
HF templates expect it (assistant `tool_calls` with arguments as objects, `tool` messages).
A template that knows no tools (SmolLM2's, Gemma's) gets brisk's documented default instead,
in the hermes format: the tool list in a system message, earlier calls written as `<tool_call>`
blocks, tool results as a user turn of `<tool_response>` blocks.

Grammar: `tool_choice` "required" or a named function constrains decoding to one call (or,
with parallel calls, several) of the allowed tools, each `arguments` valid against its JSON
schema, in the format's syntax, so the answer always parses. "auto" decodes freely and parses.

Parser: `ToolCallScanner` reads the answer as it streams and splits it into content and calls,
so streamed and whole answers are cut the same way. Arguments are the model's own text of the
`arguments` value (what a client `json.loads`).
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, Self

# OpenAI's structured outputs are compact JSON; the same for arguments (see sample/structured.py)
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolFormat:
    """How a model family writes tool calls: the texts around each call's JSON object and around
    the whole list, and the key that holds the arguments."""

    name: str
    arguments_key: str
    trigger: str | None  # the text that opens the calls; None: a call is the whole answer
    call_open: str = ""  # written before each call object
    call_close: str = ""  # and after it
    joiner: str = ""  # between two calls
    list_open: str = ""  # before the first call (after the trigger)
    list_close: str = ""  # after the last
    separators: tuple[str, ...] = ()  # texts the parser skips between call objects (besides ws , ;)

    def call_text(self, name: str, arguments: Any) -> str:
        """One call as the model writes it (for earlier calls in a conversation)."""
        body = json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False)
        return f"{self.call_open}{body}{self.call_close}"


FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", "arguments", "<tool_call>", call_open="<tool_call>\n",
                         call_close="\n</tool_call>", joiner="\n", separators=("<tool_call>", "</tool_call>")),
    "llama3_json": ToolFormat("llama3_json", "parameters", None, joiner="; ", separators=("<|python_tag|>",)),
    "mistral": ToolFormat("mistral", "arguments", "[TOOL_CALLS]", joiner=", ", list_open="[TOOL_CALLS][",
                          list_close="]", separators=("[TOOL_CALLS]", "[", "]")),
}


def detect_format(template_source: str) -> str:
    """The format a chat template writes calls in; hermes (brisk's default prompt) otherwise."""
    if "[TOOL_CALLS]" in template_source:
        return "mistral"
    if "<tool_call>" in template_source:
        return "hermes"
    if "<|python_tag|>" in template_source or ("parameters" in template_source and "<|eom_id|>" in template_source):
        return "llama3_json"
    return "hermes"


# ---------------------------------------------------------------------------------------- prompt
DEFAULT_TOOL_PROMPT = (
    "You can call functions to help with the user's request. The functions are described as JSON "
    "within <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags, one block per call:\n"
    "<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}}\n</tool_call>\n"
    "Results come back inside <tool_response></tool_response> tags."
)


def _arguments_value(arguments: str) -> Any:
    """A call's arguments as templates want them: the JSON object (kept as text if not JSON)."""
    try:
        return json.loads(arguments)
    except (TypeError, ValueError):
        return arguments


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that takes tools: assistant calls' arguments parsed into objects
    (HF templates `tojson` them), the rest as given."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{**c, "function": {**c["function"], "arguments": _arguments_value(c["function"]["arguments"])}}
                     for c in m["tool_calls"]]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def default_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages for a template that knows no tools, in brisk's default (hermes) convention: the
    tool list joins the system message, calls become `<tool_call>` text, and each run of tool
    results becomes one user turn (templates that insist on alternating roles accept it)."""
    fmt = FORMATS["hermes"]
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if m.get("tool_calls"):
            calls = [fmt.call_text(c["function"]["name"], _arguments_value(c["function"]["arguments"]))
                     for c in m["tool_calls"]]
            text = "\n".join(([m["content"]] if m.get("content") else []) + calls)
            m = {"role": "assistant", "content": text}
        out.append(m)
    out = [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = DEFAULT_TOOL_PROMPT.format(tools=listing)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# --------------------------------------------------------------------------------------- grammar
def _rewrite_refs(node: Any, prefix: str, root_name: str) -> Any:
    """A copy of one tool's schema with its `$ref`s pointing where the merged schema keeps them."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                if v == "#":
                    v = f"#/$defs/{root_name}"
                else:
                    for local in ("#/$defs/", "#/definitions/"):
                        if v.startswith(local):
                            v = f"#/$defs/{prefix}{v[len(local):]}"
                out[k] = v
            else:
                out[k] = _rewrite_refs(v, prefix, root_name)
        return out
    if isinstance(node, list):
        return [_rewrite_refs(v, prefix, root_name) for v in node]
    return node


_ONE_SCHEMA = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames",
               "additionalItems", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` where an object that lists its properties and says nothing of others
    allows no others (OpenAI's strict mode requires it said): a function called with arguments it
    does not declare fails, and a small model will copy schema words (`maxLength`) in as keys.
    `allOf` members are left open, since closing them would make their conjunction unsatisfiable."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_objects(v) for k, v in out[key].items()}
    for key in _ONE_SCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(v) for v in out[key]]
    opens = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if "properties" in out and not any(k in out for k in opens):
        out["additionalProperties"] = False
    return out


def calls_schema(tools: list[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
    """One JSON schema for "a call of one of `tools`": {name: const, arguments: its parameters},
    name first so a stream can announce the call before its arguments. Each tool's `$defs` move
    to the top (renamed per tool) so its references still resolve."""
    defs: dict[str, Any] = {}
    options = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        params = closed_objects(copy.deepcopy(fn.get("parameters") or {"type": "object", "properties": {}}))
        prefix, root = f"tool{i}_", f"tool{i}"
        for key in ("$defs", "definitions"):
            for name, sub in (params.pop(key, None) or {}).items():
                defs[prefix + name] = _rewrite_refs(sub, prefix, root)
        params = _rewrite_refs(params, prefix, root)
        defs[root] = params
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]},
                                                          arguments_key: {"$ref": f"#/$defs/{root}"}},
                        "required": ["name", arguments_key], "additionalProperties": False})
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": defs, "x-guidance": _COMPACT}


def calls_grammar(fmt: ToolFormat, tools: list[dict[str, Any]], parallel: bool,
                  special_id: Callable[[str], int | None]) -> str:
    """llguidance's Lark grammar for an answer that is nothing but calls of `tools` in `fmt`
    (one, or one or more when `parallel`). A control token (Mistral's `[TOOL_CALLS]`) is named by
    id, so only that token, never its spelling in plain text, opens the list."""

    def lit(text: str) -> str:
        if not text:
            return ""
        parts = []
        for piece in re.split(r"(\[TOOL_CALLS\]|<\|python_tag\|>)", text):
            if not piece:
                continue
            tid = special_id(piece)
            parts.append(f"<[{tid}]>" if tid is not None else json.dumps(piece))
        return " ".join(parts)

    call = " ".join(p for p in (lit(fmt.call_open), "body", lit(fmt.call_close)) if p)
    calls = f"call ({lit(fmt.joiner)} call)*" if parallel and fmt.joiner else "call"
    start = " ".join(p for p in (lit(fmt.list_open), calls, lit(fmt.list_close)) if p)
    schema = json.dumps(calls_schema(tools, fmt.arguments_key), ensure_ascii=False)
    return f"%llguidance {{}}\nstart: {start}\ncall: {call}\nbody: %json {schema}\n"


# ---------------------------------------------------------------------------------------- parser
@dataclass
class CallDelta:
    """A piece of one streamed call: the first piece of call `index` carries its id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class Parsed:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __iadd__(self, other: Parsed) -> Self:
        self.content += other.content
        self.calls += other.calls
        return self


def _string_end(text: str, i: int) -> int | None:
    """Index after the JSON string that opens at text[i] (a quote), or None if it has not ended."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """Index after the JSON value that starts at text[i], or None if it may go on."""
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            ch = text[j]
            if ch == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    m = re.compile(r"[^,}\]\s]*").match(text, i)
    end = m.end() if m else i
    return end if end < len(text) else None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


@dataclass
class _Object:
    """The top level of a JSON object being written: its fields' value spans, where it closed."""

    fields: dict[str, tuple[int, int | None]]
    end: int | None  # index after the closing brace
    broken: bool  # not an object's syntax


def _scan_object(text: str) -> _Object:
    fields: dict[str, tuple[int, int | None]] = {}
    i = 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            return _Object(fields, None, False)
        if text[i] == "}":
            return _Object(fields, i + 1, False)
        if text[i] == "," and fields:
            i += 1
            continue
        if text[i] != '"':
            return _Object(fields, None, True)
        key_end = _string_end(text, i)
        if key_end is None:
            return _Object(fields, None, False)
        key = json.loads(text[i:key_end])
        i = _skip_ws(text, key_end)
        if i >= len(text):
            return _Object(fields, None, False)
        if text[i] != ":":
            return _Object(fields, None, True)
        i = _skip_ws(text, i + 1)
        if i >= len(text):
            return _Object(fields, None, False)
        end = _value_end(text, i)
        fields[key] = (i, end)
        if end is None:
            return _Object(fields, None, False)
        i = end


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallScanner:
    """Splits an answer, fed as it streams, into content and tool calls.

    `eager`: announce a call as soon as its name is written and stream its arguments as they
    come (for answers a grammar guarantees); otherwise each call is held until its object is
    complete and well formed, and a malformed one is given back as content. `max_calls`: calls
    beyond it are dropped (`parallel_tool_calls: false`)."""

    def __init__(self, fmt: ToolFormat, eager: bool = False, max_calls: int | None = None) -> None:
        self.fmt = fmt
        self.eager = eager
        self.max_calls = max_calls
        self.calls = 0  # calls announced
        self._mode = "start" if fmt.trigger is None else "content"
        self._buf = ""  # text not yet decided
        self._raw = ""  # text of the calls section since the last thing handed out (given back if malformed)
        self._obj = ""  # the call object being written
        self._announced = False
        self._sent_args = 0  # characters of the current call's arguments handed out

    def feed(self, text: str) -> Parsed:
        self._buf += text
        out = Parsed()
        for piece in self._run(final=False):
            out += piece
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        for piece in self._run(final=True):
            out += piece
        if self._mode == "object":
            if self._announced:  # already out: the arguments as far as they were written
                out += self._args_piece()
            elif not self.eager:  # an unconstrained answer's unfinished "call": it was text
                out.content += self._raw + self._obj
            # (under a grammar it is a call cut short by max_tokens: dropped, finish_reason says "length")
            self._obj = ""
        elif self._mode == "calls" and self._buf.strip() or self._mode in ("content", "start"):
            out.content += self._buf
        self._buf = ""
        return out

    # ------------------------------------------------------------------ the modes
    def _run(self, final: bool) -> Iterator[Parsed]:
        while True:
            step = {"start": self._start, "content": self._content, "calls": self._between,
                    "object": self._object}[self._mode](final)
            if step is None:
                return
            yield step

    def _start(self, final: bool) -> Parsed | None:
        """A format without a trigger: the answer is calls iff it opens with an object."""
        tag = "<|python_tag|>"
        stripped = self._buf.lstrip()
        if not stripped or (tag.startswith(stripped) and not final):
            return None
        if stripped.startswith(tag):
            stripped = stripped[len(tag):].lstrip()
            if not stripped and not final:
                return None
        self._mode = "calls" if stripped.startswith("{") else "content"
        if self._mode == "calls":
            self._raw, self._buf = self._buf[:len(self._buf) - len(stripped)], stripped
        return Parsed()

    def _content(self, final: bool) -> Parsed | None:
        trigger = self.fmt.trigger
        if trigger is None:  # content for good
            text, self._buf = self._buf, ""
            return Parsed(text) if text else None
        at = self._buf.find(trigger)
        if at >= 0:
            text = self._buf[:at].rstrip()
            self._raw, self._buf = self._buf[len(text):at], self._buf[at:]
            self._mode = "calls"
            return Parsed(text)
        if final:
            return None
        keep = _held(self._buf, trigger)
        text, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return Parsed(text) if text else None

    def _between(self, final: bool) -> Parsed | None:
        while True:
            stripped = self._buf.lstrip(" \t\r\n,;")
            self._raw += self._buf[:len(self._buf) - len(stripped)]
            self._buf = stripped
            sep = next((s for s in self.fmt.separators if stripped.startswith(s)), None)
            if sep is None:
                break
            self._raw += sep
            self._buf = stripped[len(sep):]
        if not self._buf:
            return None
        if self._buf[0] == "{":
            self._mode, self._obj, self._buf = "object", self._buf, ""
            self._announced, self._sent_args = False, 0
            return Parsed()
        if not final and any(s.startswith(self._buf) for s in self.fmt.separators):
            return None  # perhaps the start of a tag
        # plain text after the calls: content again (and calls may follow it)
        self._raw = ""
        self._mode = "content"
        return Parsed()

    def _object(self, final: bool) -> Parsed | None:
        self._obj += self._buf
        self._buf = ""
        obj = _scan_object(self._obj)
        if obj.broken:
            if self._announced:  # out already (only an unconstrained answer gets here): it ends
                self._obj, self._mode = "", "content"
                return Parsed()
            return self._give_back()
        out = Parsed()
        if self.eager:
            out += self._announce(obj)
            out += self._args_piece(obj)
        if obj.end is None:
            return out if (out.content or out.calls) else None
        rest = self._obj[obj.end:]
        self._obj = self._obj[:obj.end]
        done = self._complete(obj)
        self._buf = rest + self._buf
        out += done
        return out

    # ------------------------------------------------------------------ calls
    def _name(self, obj: _Object) -> str | None:
        span = obj.fields.get("name")
        if span is None or span[1] is None:
            return None
        value = json.loads(self._obj[span[0]:span[1]]) if self._obj[span[0]] == '"' else None
        return value if isinstance(value, str) else None

    def _args_key(self, obj: _Object) -> str | None:
        """The field holding the arguments (the format's name first; models mix the two up)."""
        return next((k for k in (self.fmt.arguments_key, "arguments", "parameters") if k in obj.fields), None)

    def _args_span(self, obj: _Object) -> tuple[int, int | None] | None:
        key = self._args_key(obj)
        return None if key is None else obj.fields[key]

    def _announce(self, obj: _Object) -> Parsed:
        if self._announced:
            return Parsed()
        name = self._name(obj)
        if name is None:
            return Parsed()
        self._announced = True
        self.calls += 1
        self._raw = ""
        if self.max_calls is not None and self.calls > self.max_calls:
            return Parsed()
        return Parsed(calls=[CallDelta(self.calls - 1, new_call_id(), name, "")])

    def _args_piece(self, obj: _Object | None = None) -> Parsed:
        if not self._announced or (self.max_calls is not None and self.calls > self.max_calls):
            return Parsed()
        obj = obj or _scan_object(self._obj)
        span = self._args_span(obj)
        if span is None:
            return Parsed()
        end = span[1] if span[1] is not None else len(self._obj)
        text = self._obj[span[0]:end]
        new, self._sent_args = text[self._sent_args:], len(text)
        return Parsed(calls=[CallDelta(self.calls - 1, arguments=new)]) if new else Parsed()

    def _complete(self, obj: _Object) -> Parsed:
        """The object closed: a call (announced now unless it already was), or content if malformed."""
        self._mode = "calls"
        try:
            value = json.loads(self._obj)
        except ValueError:
            value = None
        name = self._name(obj)
        key = self._args_key(obj)
        span = None if key is None else obj.fields[key]
        args_ok = key is None or isinstance(value, dict) and isinstance(value.get(key), (dict, str))
        if self._announced:
            out = Parsed()
            if span is None and self._sent_args == 0:  # no arguments written: an empty object
                out.calls.append(CallDelta(self.calls - 1, arguments="{}"))
            self._obj = ""
            return out if not (self.max_calls is not None and self.calls > self.max_calls) else Parsed()
        if not isinstance(value, dict) or name is None or not args_ok:
            return self._give_back()
        out = self._announce(obj)
        if out.calls:
            args = "{}" if span is None else self._obj[span[0]:span[1]]
            if key is not None and isinstance(value[key], str):  # arguments written as a JSON string
                args = value[key]
            out.calls[0].arguments = args
        self._obj = ""
        return out

    def _give_back(self) -> Parsed:
        """A malformed call: its text (and the tags before it) is content after all."""
        text = self._raw + self._obj
        self._raw, self._obj, self._mode = "", "", "content"
        return Parsed(text)


def _held(text: str, trigger: str) -> int:
    """How many trailing characters of `text` to hold back: a possible start of `trigger`, and
    the whitespace before it (dropped if the trigger follows)."""
    keep = 0
    for k in range(min(len(trigger) - 1, len(text)), 0, -1):
        if trigger.startswith(text[-k:]):
            keep = k
            break
    body = text[:len(text) - keep]
    return keep + (len(body) - len(body.rstrip()))


def join_calls(pieces: list[CallDelta]) -> list[CallDelta]:
    """Pieces of the same call merged, in order: one entry per call (of a chunk, or an answer)."""
    calls: dict[int, CallDelta] = {}
    for p in pieces:
        if p.index in calls:
            calls[p.index].arguments += p.arguments
        else:
            calls[p.index] = CallDelta(p.index, p.id, p.name, p.arguments)
    return list(calls.values())


def parse_all(fmt: ToolFormat, text: str, eager: bool, max_calls: int | None) -> tuple[str, list[CallDelta]]:
    """A whole answer cut as the stream would cut it: (content, calls with their full arguments)."""
    scanner = ToolCallScanner(fmt, eager, max_calls)
    parsed = scanner.feed(text)
    parsed += scanner.finish()
    return parsed.content, join_calls(parsed.calls)


# ------------------------------------------------------------------------------------------ plan
class _TemplateTokenizer(Protocol):
    @property
    def template_takes_tools(self) -> bool: ...

    def special_token_id(self, text: str) -> int | None: ...


@dataclass
class ToolPlan:
    """What one chat request's tools mean for its prompt, its decoding and its answer."""

    fmt: ToolFormat
    messages: list[dict[str, Any]]  # for the chat template
    template_tools: list[dict[str, Any]] | None  # the template's `tools` variable
    grammar: str | None  # the answer must be calls (tool_choice "required" or named)
    parse: bool  # split the answer into content and calls
    max_calls: int | None
    keep_special: bool  # the format's trigger is a control token: decode with special tokens

    @property
    def eager(self) -> bool:
        """Stream arguments as they come: only when a grammar guarantees the call parses."""
        return self.grammar is not None

    def scanner(self) -> ToolCallScanner:
        return ToolCallScanner(self.fmt, self.eager, self.max_calls)

    def split(self, text: str) -> tuple[str, list[CallDelta]]:
        """A whole answer's (content, calls), cut as its stream is."""
        return parse_all(self.fmt, text, self.eager, self.max_calls)


def plan_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, tool_choice: str | dict | None,
               parallel: bool | None, tokenizer: _TemplateTokenizer, fmt: ToolFormat) -> ToolPlan:
    """`tools`: OpenAI tool objects; `tool_choice`: "none" | "auto" | "required" | {"type":
    "function", "function": {"name": ...}} (None: "auto" with tools, "none" without)."""
    if tokenizer.template_takes_tools:
        rendered, template_tools = template_messages(messages), tools or None
    else:  # brisk's default prompt, which asks for the hermes format
        rendered, template_tools, fmt = default_messages(messages, tools), None, FORMATS["hermes"]
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    grammar = None
    if tools and choice == "required":
        grammar = calls_grammar(fmt, tools, parallel is not False, tokenizer.special_token_id)
    elif tools and isinstance(choice, dict):
        chosen = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
        grammar = calls_grammar(fmt, chosen, False, tokenizer.special_token_id)
    named = isinstance(choice, dict)
    keep = fmt.trigger is not None and tokenizer.special_token_id(fmt.trigger) is not None
    return ToolPlan(fmt, rendered, template_tools, grammar, parse=bool(tools) and choice != "none",
                    max_calls=1 if named or parallel is False else None, keep_special=keep)
