"""A running estimate of what one engine step costs, learned from measured step times.

Sarathi-Serve sizes each step's prompt chunk from a latency target rather than a fixed token
count. The scheduler does that here when `SchedulerConfig.max_decode_slowdown` is set: it needs
the time of a decode-only step with D running decodes, t(D) = a + b*D, and the extra time of
each prompt token computed beside them, c. Both drift with context length and machine load, so
they are fitted online with forgetting: recursive least squares for (a, b) over decode-only steps,
an exponential average of the residual per prompt token for c. Pure Python (core/ has no torch).
"""

from __future__ import annotations

FORGET = 0.95  # weight of the past per observation: ~20 steps of memory
MIN_PROMPT_TOKENS = 8  # smaller mixed steps say too little about c to be averaged in


class StepCostModel:
    def __init__(self) -> None:
        self._theta = [0.0, 0.0]  # a, b of t(D) = a + b * D
        self._p = [[1e4, 0.0], [0.0, 1e4]]  # inverse information matrix of the RLS fit
        self.num_decode_steps = 0
        self.per_prompt_token: float | None = None  # c, seconds

    def decode_time(self, num_decodes: int) -> float | None:
        """Predicted seconds of a step with only `num_decodes` decode tokens; None before any data."""
        if self.num_decode_steps == 0:
            return None
        a, b = self._theta
        return max(0.0, a + b * num_decodes)

    def observe(self, num_decodes: int, num_prompt_tokens: int, seconds: float) -> None:
        """Record one step: `num_decodes` single-token rows and `num_prompt_tokens` in longer spans."""
        if num_prompt_tokens == 0:
            if num_decodes > 0:
                self._rls_update(num_decodes, seconds)
            return
        base = self.decode_time(num_decodes) if num_decodes > 0 else None
        if num_prompt_tokens < MIN_PROMPT_TOKENS or (num_decodes > 0 and base is None):
            return
        c = (seconds - (base or 0.0)) / num_prompt_tokens
        if c <= 0:
            return  # noise: the step came in under the decode-only prediction
        prev = self.per_prompt_token
        self.per_prompt_token = c if prev is None else FORGET * prev + (1 - FORGET) * c

    def _rls_update(self, num_decodes: int, seconds: float) -> None:
        x = (1.0, float(num_decodes))
        p = self._p
        px = [p[0][0] * x[0] + p[0][1] * x[1], p[1][0] * x[0] + p[1][1] * x[1]]
        denom = FORGET + x[0] * px[0] + x[1] * px[1]
        gain = [px[0] / denom, px[1] / denom]
        err = seconds - (self._theta[0] * x[0] + self._theta[1] * x[1])
        self._theta = [self._theta[0] + gain[0] * err, self._theta[1] + gain[1] * err]
        self._p = [[(p[i][j] - gain[i] * px[j]) / FORGET for j in range(2)] for i in range(2)]
        self.num_decode_steps += 1

    def prompt_token_cap(self, num_decodes: int, slowdown: float, floor: int) -> int | None:
        """Prompt tokens that keep a step with `num_decodes` decodes within `slowdown` times a
        decode-only step; None (no cap) until the model has seen enough, `floor` at least so
        prompts always progress."""
        base = self.decode_time(num_decodes)
        if base is None:
            return None
        if self.per_prompt_token is None:
            return floor  # learn c from small chunks first
        return max(floor, int((slowdown - 1.0) * base / self.per_prompt_token + 1e-6))  # 1e-6: float noise
