"""Single-sequence generation: prefill once, then one decode step per token.

This is the Foundation loop behind `LLM.generate`; the paged, batched engine replaces it. It
already speaks the runner's language (slot, start, new tokens) so the model code is shared.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import torch

from brisk.engine.detokenizer import IncrementalDetokenizer
from brisk.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from brisk.loader.tokenizer import Tokenizer
from brisk.request import FinishReason, SamplingParams
from brisk.runtime.model_runner import ModelRunner, SeqStep
from brisk.sample.sampler import sample


class SequenceGenerator:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, seed: int = 0) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self._seeds = random.Random(seed)  # seeds for requests that bring none

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Bad prompts are ValueErrors that say what to change."""
        if not prompt_ids:
            raise ValueError("the prompt is empty; give at least one token of text")
        vocab = self.runner.model.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        if len(prompt_ids) >= self.runner.max_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens but the context window is {self.runner.max_len} "
                "tokens (leaving room for at least one new token); shorten the prompt"
            )

    def generate(self, request_id: str, prompt: str | None, prompt_ids: list[int],
                 params: SamplingParams) -> Iterator[RequestOutput]:
        """Yield a RequestOutput after every generated token; the last one has `finished=True`."""
        self.check_prompt(prompt_ids)
        metrics = RequestMetrics(arrival_time=time.perf_counter())
        gen = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
            gen = torch.Generator(device=self.runner.device).manual_seed(seed)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.tokenizer.eos_token_ids))
        detok = IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens)
        out: list[int] = []
        logits = self.runner.execute([SeqStep(0, 0, list(prompt_ids))])
        pos = len(prompt_ids)
        while True:
            banned = sorted(stop_ids) if len(out) < params.min_tokens else None
            token = sample(logits, [params], [gen], [banned] if banned else None)[0]
            out.append(token)
            if metrics.first_token_time is None:
                metrics.first_token_time = time.perf_counter()
            finish = self._finish_reason(token, stop_ids, detok, len(out), pos + 1, params)
            if finish is not None:
                metrics.finish_time = time.perf_counter()
                if finish == FinishReason.LENGTH:
                    detok.flush()
            completion = CompletionOutput(0, detok.text, list(out), finish, detok.stream_delta(finish is not None))
            yield RequestOutput(request_id, prompt, list(prompt_ids), [completion], finish is not None, metrics)
            if finish is not None:
                return
            logits = self.runner.execute([SeqStep(0, pos, [token])])
            pos += 1

    def _finish_reason(self, token: int, stop_ids: set[int], detok: IncrementalDetokenizer, generated: int,
                       length: int, params: SamplingParams) -> FinishReason | None:
        if token in stop_ids:  # never sampled before min_tokens: the sampler bans them until then
            return FinishReason.STOP  # the stop token's text is not part of the output
        detok.push(token)
        if detok.stopped:
            return FinishReason.STOP
        if generated >= params.max_tokens or length >= self.runner.max_len:
            return FinishReason.LENGTH
        return None
