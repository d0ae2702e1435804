"""OpenAI request bodies as pydantic models, and their translation into SamplingParams.

Field names and defaults follow the OpenAI API (plus vLLM's extras: top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, and the structured-output ones:
guided_json, guided_regex, guided_choice, guided_grammar, on both endpoints; chat also takes
OpenAI's `response_format` json_object / json_schema). Ranges are checked here so a bad
value is a 400 naming its field; everything else SamplingParams checks again.

Chat also takes OpenAI's tool calling: `tools`, `tool_choice`, `parallel_tool_calls`, assistant
messages with `tool_calls` and `tool` messages with `tool_call_id` (server/tools.py).

Validation is strict, as OpenAI's is: no string is read as a number or a boolean ("5", "true"),
and a field this server does not know is refused, not ignored, so a client that asks for
something brisk does not do (the legacy `functions`, audio) is told it will not get it. Fields
that only describe a request (`user`, `metadata`, `store`, `service_tier`) are accepted and ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from brisk.errors import InvalidRequest, UserError
from brisk.request import SamplingParams

PromptInput = str | list[str] | list[int] | list[list[int]]
MAX_STOPS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 512, 1024


# Known OpenAI fields that would change what the answer must be: refused with the reason.
UNSUPPORTED = {
    "response_format": "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                       "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
    "functions": "the legacy `functions` field is not supported; send `tools` "
                 "([{\"type\": \"function\", \"function\": {...}}])",
    "function_call": "the legacy `function_call` field is not supported; send `tool_choice`",
    "best_of": "best_of is not supported; use n and pick among the choices",
    "suffix": "insertion (suffix) is not supported",
    "prediction": "predicted outputs are not supported",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported; send [\"text\"] or leave it out",
    "reasoning_effort": "this server runs no reasoning model",
    "web_search_options": "web search is not supported",
}


def validation_message(err: Mapping[str, Any]) -> str:
    """The text of a 400 for one pydantic error, with the reason for fields refused on purpose."""
    refused = [str(p) for p in err.get("loc", ()) if str(p) in UNSUPPORTED]
    if refused:  # an unknown field, or a known one in a form that asks for more than text
        return UNSUPPORTED[refused[0]]
    if err.get("type") == "extra_forbidden":
        return "not a field this server accepts; remove it"
    # a validator's ValueError reads "Value error, <its message>": the message is enough
    return str(err.get("msg", "invalid request")).removeprefix("Value error, ")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _TextFormat(_Strict):
    type: Literal["text"]


class _JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class _JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = _TextFormat | _JsonObjectFormat | _JsonSchemaFormat


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    # bounded: every stop string is searched for after every token, on the engine's thread
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    # described, not acted on
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # accepted only in the form that asks for nothing beyond plain text
    best_of: Literal[1] | None = None
    # vLLM's structured outputs (at most one)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _few_short_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise UserError(f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters each")
        return stop

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, n=self.n, stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), seed=self.seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,  # type: ignore[arg-type]
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens, logprobs=logprobs,
            structured=self.structured()[1],
        )

    def structured(self) -> tuple[str | None, dict[str, Any] | None]:
        """(the request field that asks for it, SamplingParams.structured); (None, None): free text."""
        asked = [(f, {"json": v} if f == "guided_json" else {"regex": v} if f == "guided_regex" else
                  {"choice": v} if f == "guided_choice" else {"grammar": v})
                 for f, v in (("guided_json", self.guided_json), ("guided_regex", self.guided_regex),
                              ("guided_choice", self.guided_choice), ("guided_grammar", self.guided_grammar))
                 if v is not None]
        asked += self._format()
        if len(asked) > 1:
            raise InvalidRequest(f"{' and '.join(f for f, _ in asked)}: ask for one structured output, not "
                                 f"{len(asked)}", asked[1][0])
        return asked[0] if asked else (None, None)

    def _format(self) -> list[tuple[str, dict[str, Any]]]:
        return []

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: PromptInput
    logprobs: int | None = Field(default=None, ge=0, le=SamplingParams.MAX_LOGPROBS)
    echo: bool = False
    suffix: None = None


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names
MAX_TOOLS = 128


class FunctionDef(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # arguments are always schema-valid when tool_choice constrains them


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class _NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _NamedFunction


class _CallFunction(_Strict):
    name: str
    arguments: str  # JSON text, as the API returned it


class ToolCallIn(_Strict):
    """An earlier call, as an assistant message of the conversation carries it."""

    id: str
    type: Literal["function"]
    function: _CallFunction


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # a participant's name: the templates brisk renders do not show it
    tool_calls: list[ToolCallIn] | None = None  # assistant only
    tool_call_id: str | None = None  # tool only: the call this message answers

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise UserError(f"only assistant messages carry tool_calls, not {self.role!r} ones")
        if self.role == "tool" and not self.tool_call_id:
            raise UserError("a tool message needs tool_call_id: the id of the call it answers")
        return self

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
            out["content"] = self.text() if self.content is not None else None
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        """String content, or the text parts of a content list joined (images are not supported)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise InvalidRequest(f"messages: content part type {part.get('type')!r} is not supported; send text",
                                     "messages")
            text = part.get("text", "")
            if not isinstance(text, str):
                raise InvalidRequest("messages: a text part's 'text' must be a string", "messages")
            parts.append(text)
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=SamplingParams.MAX_LOGPROBS)
    add_generation_prompt: bool = True
    response_format: ResponseFormat | None = Field(default=None, discriminator="type")
    modalities: list[Literal["text"]] | None = Field(default=None, min_length=1, max_length=1)
    tools: list[ToolDef] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check_tools(self) -> None:
        """Tool fields that agree with each other (InvalidRequest naming the field otherwise)."""
        names = [t.function.name for t in self.tools or []]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise InvalidRequest(f"tools: two tools are named {dup!r}; names must be unique", "tools")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not names:
            raise InvalidRequest("tool_choice: give `tools` to choose from, or leave tool_choice out", "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidRequest(f"tool_choice: no tool is named {choice.function.name!r}; the tools are "
                                 f"{', '.join(names)}", "tool_choice")

    def _format(self) -> list[tuple[str, dict[str, Any]]]:
        fmt = self.response_format
        if isinstance(fmt, _JsonObjectFormat):
            return [("response_format", {"json_object": True})]
        if isinstance(fmt, _JsonSchemaFormat):
            schema = fmt.json_schema.schema_
            return [("response_format", {"json": schema if schema is not None else {"type": "object"}})]
        return []


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = Field(default=None, max_length=MAX_TOOLS)  # rendered as chat would
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
