"""What generation hands back, shaped like vLLM's offline outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from brisk.request import FinishReason
from brisk.sample.logprobs import TokenLogprobs


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for this request
    num_accepted_tokens: int = 0  # of those, accepted

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens; None when nothing was drafted."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    delta: str = ""  # text new since the previous streamed output
    logprobs: list[TokenLogprobs] | None = None  # one per generated token when params.logprobs is set

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token when params.prompt_logprobs

    def decode_tokens_per_second(self) -> float | None:
        """Generated tokens after the first, per second of decoding."""
        m, n = self.metrics, len(self.outputs[0].token_ids)
        if m.first_token_time is None or m.finish_time is None or n < 2 or m.finish_time <= m.first_token_time:
            return None
        return (n - 1) / (m.finish_time - m.first_token_time)
