"""The public offline API, shaped like vLLM's so users switch without relearning.

    from brisk import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=64, temperature=0))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Self, Union

from tqdm import tqdm

from brisk.config import (
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    PruneConfig,
    QuantConfig,
    SchedulerConfig,
    SpecConfig,
)
from brisk.engine.llm_engine import LLMEngine, num_kv_blocks
from brisk.engine.outputs import RequestOutput
from brisk.engine.workers import Cluster, WorkerArgs, start_cluster
from brisk.errors import UserError
from brisk.loader.load import LoadedModel, load_model
from brisk.loader.resolve import DEFAULT_MODEL
from brisk.model.base import CausalLM
from brisk.request import SamplingParams
from brisk.runtime.paged_runner import kv_block_bytes, model_kv_groups

if TYPE_CHECKING:
    from brisk.compress.probe import Decision, ProbePruner

PROBE_PACK_MIN_TOKENS = 256  # Probe Pruning: prompt tokens of a batch from which its compact model is packed

# A prompt is text, or {"prompt_token_ids": [...]} for pre-tokenized input (as in vLLM).
Prompt = Union[str, dict[str, Any]]
Messages = list[dict[str, Any]]


class LLM:
    """Offline batched generation over brisk's paged engine.

    Engine flags: `block_size` (tokens per KV block), `num_kv_blocks` (default: as many as
    `kv_cache_memory_gib` holds), `max_num_batched_tokens` (tokens per step: prompt chunks and
    decodes together), `max_num_seqs` (sequences per step), `enable_prefix_caching`, `kv_layout`
    ("paged": a block pool allocated at start-up, the default; "virtual": a contiguous row of
    reserved address space per sequence, physical memory committed as tokens arrive, CPU on
    Linux or CUDA (cuda-python's driver bindings); see core/virtual_kv.py),
    `kv_huge_pages` (virtual: 2 MB transparent huge pages),
    `enable_chunked_prefill`, `max_model_len` (longest prompt + output; default: the model's window),
    `max_decode_slowdown` (e.g. 1.5: prompt chunks sized so a step with running decodes takes at
    most that many times a decode-only step; default None: the token budget alone),
    `pack_weights` (CPU: keep oneDNN-packed copies of the weights for batched rows, ~1.3-2x faster
    prefill and batched decode for as much memory again as the weights; default True),
    `enforce_eager` (run decode steps through the Python modules instead of the C++ decode plan,
    runtime/decode_plan.py, and on CUDA without CUDA graphs, runtime/decode_graphs.py: the same
    numbers, slower; default False),
    `quantization` ("int8", "int4", "w8a8", "ternary", "gguf": swap the Linears for quantized ones at
    load, see quant/; a quantized .gguf file keeps its own blocks by default, as "gguf"),
    `dequantize` (a quantized .gguf file's weights turned into floats at load instead: the exactness
    reference against HF transformers, ~8x the memory; default False)
    with `quantization_config` ({"group_size": 64, "calibration": "text.txt"} for int4; a dict or
    a JSON string),
    `pruning` (static pruning at load, before quantization: {"method": "structured" | "layers",
    "ratio": r, "calibration": "text.txt", ...}, see config.PruneConfig and compress/prune.py; a
    dict or JSON; `brisk prune` writes the same model as a directory),
    `speculative_config` (lossless speculative decoding: {"method": "ngram" | "draft" | "early_exit" |
    "medusa", "num_speculative_tokens": k or "auto", ...}, see config.SpecConfig; a dict or JSON),
    `tensor_parallel_size` / `pipeline_parallel_size` (split the model over T x P processes on
    torch.distributed, this one being rank 0; see parallel/ and engine/workers/; `close()` or
    `with LLM(...) as llm:` stops them), `parallel_timeout_s` (a worker silent that long in a step
    is reported hung), `pipeline_micro_batches` (pieces each step is cut into so pipeline stages
    overlap; default: up to one per stage, of at least 64 tokens each).
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, dtype: str = EngineConfig.dtype,
                 device: str = EngineConfig.device, max_model_len: int | None = None, seed: int = EngineConfig.seed,
                 block_size: int = CacheConfig.block_size, num_kv_blocks: int | None = None,
                 kv_cache_memory_gib: float = CacheConfig.kv_cache_memory_gib,
                 max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
                 max_num_seqs: int = SchedulerConfig.max_num_seqs,
                 enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
                 kv_layout: str = CacheConfig.kv_layout,
                 kv_huge_pages: bool = CacheConfig.kv_huge_pages,
                 enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill,
                 max_decode_slowdown: float | None = None, pack_weights: bool = True,
                 enforce_eager: bool = False, quantization: str | None = None, dequantize: bool = False,
                 quantization_config: dict[str, Any] | str | None = None,
                 pruning: dict[str, Any] | str | None = None,
                 speculative_config: dict[str, Any] | str | None = None,
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 parallel_timeout_s: float = ParallelConfig.timeout_s, pipeline_micro_batches: int | None = None) -> None:
        self.config = EngineConfig(model=model, dtype=dtype, device=device, max_model_len=max_model_len, seed=seed)
        cache = CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                            kv_cache_memory_gib=kv_cache_memory_gib, enable_prefix_caching=enable_prefix_caching,
                            kv_layout=kv_layout, kv_huge_pages=kv_huge_pages)
        if quantization is None and quantization_config is not None:
            raise UserError("quantization_config needs a quantization method (e.g. quantization='int4')")
        # checked before spending seconds on loading
        quant = None if quantization is None else QuantConfig.parse(quantization, quantization_config)
        prune = None if pruning is None else PruneConfig.parse(pruning)
        spec = None if speculative_config is None else SpecConfig.parse(speculative_config)
        self.parallel = ParallelConfig(tensor_parallel_size, pipeline_parallel_size, parallel_timeout_s,
                                       pipeline_micro_batches)
        self._cluster: Cluster | None = None
        self.pruning: dict[str, Any] | None = None  # what pruning at load did (compress/prune.py's report)
        self._probe: ProbePruner | None = None  # Probe Pruning: decides per batch (compress/probe.py)
        self.last_probe: Decision | None = None  # ...what it decided for the last batch
        if self.parallel.world_size > 1:
            _check_parallel(cache, prune, spec)  # before any worker starts
            # what every rank is told: the same keywords as this LLM's
            self._start_cluster(WorkerArgs.of_llm(model, {
                "dtype": dtype, "device": device, "max_model_len": max_model_len, "quantization": quantization,
                "quantization_config": quantization_config, "tensor_parallel_size": tensor_parallel_size,
                "pipeline_parallel_size": pipeline_parallel_size, "parallel_timeout_s": parallel_timeout_s,
                "pipeline_micro_batches": pipeline_micro_batches, "block_size": block_size,
                "pack_weights": pack_weights, "dequantize": dequantize, "enforce_eager": enforce_eager}), cache)
            assert self._cluster is not None
            loaded = self._cluster.loaded
        else:
            loaded = self._load(model, quant, prune, spec, dequantize)
        self.quantization = loaded.quantization
        self.max_model_len = max_model_len or loaded.config.max_position_embeddings
        sched = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                max_model_len=self.max_model_len, enable_chunked_prefill=enable_chunked_prefill,
                                max_decode_slowdown=max_decode_slowdown)
        self.model = loaded.model
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.source.name
        self._build_engine(loaded, cache, sched, seed, pack_weights, spec, enforce_eager)
        self._ids = itertools.count()
        # Outputs of open streams, kept when another call (a generate) runs the steps that make them.
        self._stream_buffers: dict[str, list[RequestOutput]] = {}
        self._failures: dict[str, Exception] = {}  # request id -> the error that ended it alone

    def _start_cluster(self, args: WorkerArgs, cache: CacheConfig) -> None:
        """Start the worker processes; rank 0 (this process) loads its share with them."""
        self._cluster = start_cluster(args, cache)
        # Until the engine holds the cluster (_build_engine), a failure must not leave workers behind.
        self._finalizer = weakref.finalize(self, self._cluster.close)

    def _load(self, model: str, quant: QuantConfig | None, prune: PruneConfig | None, spec: SpecConfig | None,
              dequantize: bool) -> LoadedModel:
        """The model in this process: as stored or quantized, pruned at load, or Probe Pruning's
        dense model (its compact models come per batch)."""
        cfg = self.config
        where = {"dtype": cfg.dtype, "device": cfg.device, "max_model_len": cfg.max_model_len}
        if prune is not None and prune.method == "probe":
            from brisk.compress.probe import load_probe

            if dequantize or quant is not None:
                raise UserError("Probe Pruning cuts float weights per batch of prompts: it cannot combine with "
                                 "quantization or --dequantize yet (static pruning, method \"structured\", can)")
            if spec is not None and spec.method == "streaming":
                raise UserError("Speculative Streaming's adapters fit the whole model's layers, and Probe Pruning "
                                "runs a narrower model per batch: use one of them (or another speculative method)")
            loaded, self._probe = load_probe(model, prune, **where)
            self.pruning = self._probe.report()
            return loaded
        if prune is not None:
            from brisk.compress.prune import load_pruned

            if dequantize:
                raise UserError("pruning scores and cuts float weights (a .gguf file is dequantized for it): drop "
                                 "--dequantize")
            loaded, self.pruning = load_pruned(model, prune, quant=quant, **where)
            return loaded
        return load_model(model, quant=quant, dequantize=dequantize, **where)

    def _build_engine(self, loaded: LoadedModel, cache: CacheConfig, sched: SchedulerConfig, seed: int,
                      pack_weights: bool, spec: SpecConfig | None, eager: bool) -> None:
        """The engine over the loaded model (and the draft model speculation "draft" loads)."""
        cfg = self.config
        draft = None if spec is None or spec.method != "draft" else self._load_draft(spec, cfg.dtype, cfg.device)
        # Under Probe Pruning every batch gets an engine of its own (_probe_batch): the dense model's
        # holds one sequence's KV, not the cache's worth
        dense_cache = cache if self._probe is None or not self._probe.active else \
            dataclasses.replace(cache, num_kv_blocks=-(-self.max_model_len // cache.block_size) + 1)
        self.engine = LLMEngine(loaded.model, loaded.tokenizer, dense_cache, sched, seed, pack_weights, spec, draft,
                                None if self._cluster is None else self._cluster.runner, eager=eager)
        self._engine_args = (cache, sched, seed, pack_weights, spec, draft)  # Probe Pruning's engines per batch
        self._idle_engine = self.engine  # ...and the dense model's, held while the next one is built
        self._spare: CausalLM | None = None  # the compact model, allocated at load, refilled by every batch
        if self._probe is not None and self._probe.active:
            from brisk.compress.probe import first_plan

            self._spare = self._probe.compact_model(first_plan(loaded.config, self._probe.keep))
        self._dense_model = loaded.model
        if self._cluster is not None:
            # The workers live as long as the engine (a server may keep the engine and drop the LLM).
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self.engine, self._cluster.close)

    def with_speculation(self, speculative_config: dict[str, Any] | str | None) -> LLM:
        """The same loaded model and tokenizer behind a fresh engine with other speculative
        decoding settings (None: plain decoding): side-by-side runs without a reload."""
        spec = None if speculative_config is None else SpecConfig.parse(speculative_config)
        if self._cluster is not None:
            raise UserError("with_speculation needs a single-process LLM: speculative decoding does not run "
                             "tensor/pipeline parallel yet")
        other = object.__new__(LLM)
        other.__dict__.update(self.__dict__)
        e = self.engine
        draft = None if spec is None or spec.method != "draft" else \
            other._load_draft(spec, self.config.dtype, self.config.device)
        other.engine = LLMEngine(self.model, self.tokenizer, e.cache_config, e.scheduler_config, self.config.seed,
                                 e.runner.packed_weight_bytes > 0, spec, draft, eager=e.eager)
        other._ids = itertools.count()
        other._stream_buffers = {}
        other._failures = {}
        return other

    def close(self) -> None:
        """Stop the worker processes of a parallel LLM (also at exit or when it is collected);
        nothing to do for a single-process one. The LLM cannot generate afterwards."""
        if self._cluster is not None:
            self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _load_draft(self, spec: SpecConfig, dtype: str, device: str) -> CausalLM:
        """The draft model of method "draft": same tokenizer as the target, or a ValueError."""
        assert spec.model is not None
        quant = None if spec.quantization is None else QuantConfig.parse(spec.quantization, spec.quantization_config)
        draft = load_model(spec.model, dtype=dtype, device=device, max_model_len=self.max_model_len, quant=quant)
        if draft.tokenizer.vocab_size != self.tokenizer.vocab_size or \
                draft.config.vocab_size != self.model_config.vocab_size:
            raise UserError(f"draft model {spec.model!r} has a vocabulary of {draft.config.vocab_size} tokens, the "
                             f"target {self.model_config.vocab_size}: a draft must share the target's tokenizer")
        return draft.model

    def _step(self) -> list[RequestOutput]:
        """One engine step; outputs of open streams go to their buffers, the rest are returned.
        Requests the step ended with an error of their own wait in `_failures` for their caller."""
        outs = []
        step_outputs = self.engine.step()
        self._failures.update(self.engine.take_failures())
        for out in step_outputs:
            buffer = self._stream_buffers.get(out.request_id)
            if buffer is not None:
                buffer.append(out)
            else:
                outs.append(out)
        return outs

    def _raise_failure(self, request_ids: list[str]) -> None:
        """Raise the error that ended one of `request_ids` (the others in its steps went on)."""
        for rid in request_ids:
            error = self._failures.pop(rid, None)
            if error is not None:
                raise RuntimeError(f"generation failed: {error}") from error

    def get_tokenizer(self):  # noqa: ANN201 - the Tokenizer type lives in loader/
        return self.tokenizer

    def _prompt_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise UserError("prompt_token_ids must be a list of integers")
            text = prompt.get("prompt")
        else:
            raise UserError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if not ids:
            raise UserError("the prompt is empty; give at least one token of text")
        if len(ids) >= self.max_model_len:
            raise UserError(f"the prompt has {len(ids)} tokens but the context window is {self.max_model_len} "
                             "tokens (leaving room for at least one new token); shorten the prompt")
        return text, list(ids)

    @staticmethod
    def _params_for(n: int, params: SamplingParams | Sequence[SamplingParams] | None) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise UserError(f"got {len(params)} SamplingParams for {n} prompts; pass one, or one per prompt")
        return list(params)

    def _add(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[str]:
        """Validate and queue every prompt, or none: a bad one aborts those added before it."""
        prepared = [self._prompt_ids(p) for p in prompts]
        arrival = None
        if self._probe is not None and self._probe.active:
            arrival = time.perf_counter()  # the decision is part of each request's time to first token
            self._probe_batch([ids for _, ids in prepared], params)
        ids: list[str] = []
        try:
            for (text, token_ids), p in zip(prepared, params):
                rid = str(next(self._ids))
                self.engine.add_request(rid, token_ids, p, prompt=text, arrival_time=arrival)
                ids.append(rid)
        except ValueError:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return ids

    def _probe_batch(self, prompts: list[list[int]], params: list[SamplingParams]) -> None:
        """Probe Pruning: decide this batch's heads and channels on its prompts, then run it on an
        engine over the compact model they make (KV sized for this batch; the last batch's goes)."""
        assert self._probe is not None
        if self.engine.unfinished_request_ids():
            raise UserError("Probe Pruning decides the kept heads and channels per batch of prompts, and requests "
                             "of an earlier batch are still running: finish or abort them first (or pass all "
                             "prompts to one generate call)")
        started = time.perf_counter()
        decision = self._probe.decide(prompts)
        self.engine = self._idle_engine  # the last batch's engine and KV go before the next is built
        compact = self._spare = self._probe.compact_model(decision.plan, reuse=self._spare)
        cache, sched, seed, pack, spec, draft = self._engine_args
        block = cache.block_size
        need = sum(p.n * -(-(len(ids) + (p.max_tokens or self.max_model_len)) // block) for ids, p in zip(prompts, params))
        room = min(need + len(prompts), num_kv_blocks(cache, kv_block_bytes(compact, block,
                                                                             model_kv_groups(compact, sched.max_model_len))))
        # Packed weights speed up prompt rows only (decode steps run on the plan's own kernels), and
        # packing a compact model costs ~0.1 s: worth it from a few hundred prompt tokens.
        pack = pack and sum(len(ids) for ids in prompts) >= PROBE_PACK_MIN_TOKENS
        self.engine = LLMEngine(compact, self.tokenizer, dataclasses.replace(cache, num_kv_blocks=room), sched, seed,
                                pack, spec, draft, eager=self._idle_engine.eager)
        self.model = compact
        decision.seconds = time.perf_counter() - started  # decision pass, compact model and engine together
        self.last_probe = decision

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output after each step that extends it; `.outputs[i].delta` is the new text.

        Closing the iterator early aborts the request and frees its KV blocks.
        """
        (rid,) = self._add([prompt], [params or SamplingParams()])
        buffer = self._stream_buffers[rid] = []
        try:
            while True:
                while buffer:
                    out = buffer.pop(0)
                    yield out
                    if out.finished:
                        return
                self._raise_failure([rid])
                if rid not in self.engine.unfinished_request_ids():
                    return  # ended without a final output (aborted by a failed step)
                self._step()
        finally:
            del self._stream_buffers[rid]
            self.engine.abort_request(rid)  # no-op once finished

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in order; all prompts run as one continuous batch."""
        batch = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        ids = self._add(batch, self._params_for(len(batch), params))
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm or len(ids) < 2)
        try:
            mine = set(ids)
            while len(results) < len(ids):
                for out in self._step():
                    if out.finished and out.request_id in mine:
                        results[out.request_id] = out
                        bar.update(1)
                self._raise_failure(ids)
        finally:
            bar.close()
            for rid in ids:
                if rid not in results:
                    self.engine.abort_request(rid)
        return [results[rid] for rid in ids]

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


def _check_parallel(cache: CacheConfig, prune: PruneConfig | None, spec: SpecConfig | None) -> None:
    """What tensor/pipeline parallelism cannot run (yet), refused before any worker starts."""
    if prune is not None:
        raise UserError("pruning at load runs in a single process: write the pruned model once with `brisk "
                         "prune ... --out DIR`, then run DIR with tensor/pipeline parallelism")
    cache.check_multi_process()
    if spec is not None and spec.method != "ngram":
        raise UserError(f"speculative method {spec.method!r} runs in a single process for now (its drafts "
                         "need hidden states or KV of their own); with tensor/pipeline parallelism use "
                         '{"method": "ngram"}')
