"""RequestOutputs -> OpenAI response and stream-chunk JSON, for completions and chat.

A View belongs to one HTTP request. Choice `i * n + j` is completion j of prompt i. While
streaming it remembers, per choice, how many logprobs were sent and whether the finish chunk
went out, since every engine output repeats all n completions of a prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from brisk.engine.outputs import CompletionOutput, RequestOutput
from brisk.sample.logprobs import TokenLogprobs
from brisk.server.tools import CallDelta, ToolCallScanner, ToolPlan, join_calls

if TYPE_CHECKING:
    from brisk.server.app import ServerState
    from brisk.server.protocol import ChatCompletionRequest, CompletionRequest


class View:
    object_full = ""
    object_chunk = ""
    id_prefix = ""

    def __init__(self, state: ServerState, req: CompletionRequest | ChatCompletionRequest,
                 prompts: list[tuple[str | None, list[int]]], created: int, job_id: str) -> None:
        self.state = state
        self.req = req
        self.prompts = prompts
        self.n = req.n
        self.id = f"{self.id_prefix}-{job_id}"
        self.created = created
        self._sent_logprobs: dict[int, int] = {}
        self._closed: set[int] = set()
        self._offsets: dict[int, int] = {}  # choice -> text offset of its next streamed token

    # ------------------------------------------------------------------ shared pieces
    def _token(self, token_id: int) -> str:
        return self.state.tokenizer.decode([token_id], skip_special_tokens=False)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.state.model_name,
                "choices": choices}

    def usage(self, finals: list[RequestOutput]) -> dict[str, int]:
        prompt = sum(len(ids) for _, ids in self.prompts)
        completion = sum(len(c.token_ids) for out in finals for c in out.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def usage_chunk(self, finals: list[RequestOutput]) -> dict[str, Any]:
        return {**self._envelope(self.object_chunk, []), "usage": self.usage(finals)}

    def full(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = [self.full_choice(i * self.n + c.index, i, c) for i, out in enumerate(finals) for c in out.outputs]
        return {**self._envelope(self.object_full, choices), "usage": self.usage(finals)}

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[dict[str, Any]]:
        chunks = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            if index in self._closed:
                continue
            logprobs = c.logprobs or []
            new_lp = logprobs[self._sent_logprobs.get(index, 0):]
            self._sent_logprobs[index] = len(logprobs)
            if c.finished:
                self._closed.add(index)
            if c.delta or c.finished or new_lp:
                choice = self.delta_choice(index, c, new_lp)
                if choice is not None:
                    chunks.append(self._envelope(self.object_chunk, [choice]))
        return chunks

    # ------------------------------------------------------------------ per API
    def opening(self) -> list[dict[str, Any]]:
        return []

    def full_choice(self, index: int, prompt_index: int, c: CompletionOutput) -> dict[str, Any]:
        raise NotImplementedError

    def delta_choice(self, index: int, c: CompletionOutput, new_lp: list[TokenLogprobs]) -> dict[str, Any] | None:
        """The choice's part of one stream chunk; None when there is nothing to send yet."""
        raise NotImplementedError


class CompletionView(View):
    object_full = object_chunk = "text_completion"
    id_prefix = "cmpl"

    def _logprobs(self, entries: list[tuple[int, TokenLogprobs | None]], offset: int) -> dict[str, Any]:
        """The legacy format; a token without a logprob (the first prompt token) gets nulls."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for token_id, e in entries:
            text = self._token(token_id)
            tokens.append(text)
            token_lps.append(None if e is None else e.logprob)
            tops.append({self._token(t): lp for t, lp in e.top} if e is not None and e.top else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _echo(self, prompt_index: int) -> str:
        text, ids = self.prompts[prompt_index]
        return text if text is not None else self.state.tokenizer.decode(ids, skip_special_tokens=False)

    def full_choice(self, index: int, prompt_index: int, c: CompletionOutput) -> dict[str, Any]:
        req: CompletionRequest = self.req  # type: ignore[assignment]
        prefix = self._echo(prompt_index) if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            entries: list[tuple[int, TokenLogprobs | None]] = [(e.token_id, e) for e in c.logprobs or []]
            if req.echo:
                prompt_ids = self.prompts[prompt_index][1]
                prompt_lps = self._prompt_lps.get(prompt_index) or [None] * len(prompt_ids)
                entries = list(zip(prompt_ids, prompt_lps)) + entries
            logprobs = self._logprobs(entries, 0)
        return {"index": index, "text": prefix + c.text, "logprobs": logprobs,
                "finish_reason": str(c.finish_reason) if c.finish_reason else None}

    def full(self, finals: list[RequestOutput]) -> dict[str, Any]:
        self._prompt_lps = {i: out.prompt_logprobs for i, out in enumerate(finals)}
        return super().full(finals)

    def opening(self) -> list[dict[str, Any]]:
        req: CompletionRequest = self.req  # type: ignore[assignment]
        if not req.echo:
            return []
        return [self._envelope(self.object_chunk, [{"index": i * self.n + j, "text": self._echo(i), "logprobs": None,
                                                    "finish_reason": None}])
                for i in range(len(self.prompts)) for j in range(self.n)]

    def delta_choice(self, index: int, c: CompletionOutput, new_lp: list[TokenLogprobs]) -> dict[str, Any]:
        req: CompletionRequest = self.req  # type: ignore[assignment]
        logprobs = None
        if req.logprobs is not None:  # offsets run on across chunks, after any echoed prompt
            start = self._offsets.get(index, len(self._echo(index // self.n)) if req.echo else 0)
            logprobs = self._logprobs([(e.token_id, e) for e in new_lp], start)
            self._offsets[index] = start + sum(len(t) for t in logprobs["tokens"])
        return {"index": index, "text": c.delta, "logprobs": logprobs,
                "finish_reason": str(c.finish_reason) if c.finish_reason else None}


class ChatView(View):
    """Chat answers; with a tool plan, each choice's text is cut into content and tool calls
    (server/tools.py), the same way whole and streamed."""

    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, state: ServerState, req: ChatCompletionRequest, prompts: list[tuple[str | None, list[int]]],
                 created: int, job_id: str, tools: ToolPlan | None = None) -> None:
        super().__init__(state, req, prompts, created, job_id)
        self.tools = tools
        self._scanners: dict[int, ToolCallScanner] = {}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        # bytes are the token's own, so a client can join partial UTF-8 characters (emoji, CJK)
        return {"token": self._token(token_id), "logprob": logprob,
                "bytes": list(self.state.tokenizer.token_bytes(token_id))}

    def _logprobs(self, entries: list[TokenLogprobs]) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        return {"content": [{**self._entry(e.token_id, e.logprob),
                             "top_logprobs": [self._entry(t, lp) for t, lp in e.top]} for e in entries]}

    def full_choice(self, index: int, prompt_index: int, c: CompletionOutput) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        calls: list[CallDelta] = []
        if self.tools is not None:
            content, calls = self.tools.split(c.text)
            message = {"role": "assistant", "content": content if content or not calls else None}
            if calls:
                message["tool_calls"] = [_call_json(call) for call in calls]
        return {"index": index, "message": message, "logprobs": self._logprobs(c.logprobs or []),
                "finish_reason": _finish(c, bool(calls))}

    def opening(self) -> list[dict[str, Any]]:
        return [self._envelope(self.object_chunk, [{"index": j, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}])
                for j in range(self.n)]

    def delta_choice(self, index: int, c: CompletionOutput, new_lp: list[TokenLogprobs]) -> dict[str, Any] | None:
        if self.tools is None:
            delta: dict[str, Any] = {"content": c.delta} if c.delta else {}
            return {"index": index, "delta": delta, "logprobs": self._logprobs(new_lp),
                    "finish_reason": str(c.finish_reason) if c.finish_reason else None}
        scanner = self._scanners.setdefault(index, self.tools.scanner())
        parsed = scanner.feed(c.delta)
        if c.finished:
            parsed += scanner.finish()
        delta = {"content": parsed.content} if parsed.content else {}
        if parsed.calls:
            delta["tool_calls"] = [_call_json(call, streamed=True) for call in join_calls(parsed.calls)]
        if not delta and not c.finished and not new_lp:
            return None  # text held back (perhaps the start of a call)
        return {"index": index, "delta": delta, "logprobs": self._logprobs(new_lp),
                "finish_reason": _finish(c, scanner.calls > 0)}


def _call_json(call: CallDelta, streamed: bool = False) -> dict[str, Any]:
    """OpenAI's tool call object; a stream's later pieces of a call carry only its arguments."""
    if call.id is None:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": call.index, **out} if streamed else out


def _finish(c: CompletionOutput, called: bool) -> str | None:
    """"tool_calls" when the answer ended by itself with calls in it; the engine's reason otherwise."""
    if c.finish_reason is None:
        return None
    reason = str(c.finish_reason)
    return "tool_calls" if called and reason == "stop" else reason
