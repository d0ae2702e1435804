"""The public offline API, shaped like vLLM's so users switch without relearning.

    from brisk import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=64, temperature=0))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, Union

import torch
from tqdm import tqdm

from brisk.config import EngineConfig
from brisk.engine.generator import SequenceGenerator
from brisk.engine.outputs import RequestOutput
from brisk.loader.load import load_model
from brisk.loader.resolve import DEFAULT_MODEL
from brisk.request import SamplingParams
from brisk.runtime.model_runner import ModelRunner

# A prompt is text, or {"prompt_token_ids": [...]} for pre-tokenized input (as in vLLM).
Prompt = Union[str, dict[str, Any]]
Messages = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, *, dtype: str = "float32", device: str = "cpu",
                 max_model_len: int | None = None, seed: int = 0) -> None:
        self.config = EngineConfig(model=model, dtype=dtype, device=device, max_model_len=max_model_len, seed=seed)
        loaded = load_model(model, dtype=dtype, device=device, max_model_len=max_model_len)
        self.model = loaded.model
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.source.name
        self.max_model_len = max_model_len or loaded.config.max_position_embeddings
        self._runner = ModelRunner(loaded.model, max_seqs=1, max_len=self.max_model_len)
        self._generator = SequenceGenerator(self._runner, self.tokenizer, seed)
        self._ids = itertools.count()

    def get_tokenizer(self):  # noqa: ANN201 - the Tokenizer type lives in loader/
        return self.tokenizer

    def _prompt_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            return prompt.get("prompt"), list(ids)
        raise ValueError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    @staticmethod
    def _params_for(n: int, params: SamplingParams | Sequence[SamplingParams] | None) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; pass one, or one per prompt")
        return list(params)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output after each token; `.outputs[0].delta` is the new text."""
        text, ids = self._prompt_ids(prompt)
        with torch.inference_mode():
            yield from self._generator.generate(str(next(self._ids)), text, ids, params or SamplingParams())

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in order."""
        batch = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        per_prompt = self._params_for(len(batch), params)
        prepared = [self._prompt_ids(p) for p in batch]  # validate every prompt before running any
        for _, ids in prepared:
            self._generator.check_prompt(ids)
        results: list[RequestOutput] = []
        bar = tqdm(total=len(batch), desc="generating", disable=not use_tqdm or len(batch) < 2)
        with torch.inference_mode():
            for (text, ids), p in zip(prepared, per_prompt):
                last = None
                for last in self._generator.generate(str(next(self._ids)), text, ids, p):
                    pass
                assert last is not None and last.finished
                results.append(last)
                bar.update(1)
        bar.close()
        return results

    def chat(self, messages: Messages | Sequence[Messages],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[Prompt] = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, params, use_tqdm)
