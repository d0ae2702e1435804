"""SchedulerOutput -> one forward over a flat mixed batch -> logits of the rows to sample.

This is the one place where the scheduler's ints and lists become tensors (habit 2): token ids,
positions, the slot (block, offset) of every new token, block tables and the attention spans.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from brisk.core.kv_cache_manager import NO_BLOCK
from brisk.core.kv_groups import KVGroup, kv_groups, layer_slots
from brisk.core.outputs import ScheduledRequest
from brisk.model.attention import KVCache
from brisk.model.base import CausalLM
from brisk.model.paged_attention import (
    HAVE_PAGED_KERNEL,
    KERNEL_MAX_QUERY,
    GatherSpan,
    PagedAttention,
    causal_mask,
    padded_spans,
)
from brisk.runtime.decode_graphs import DecodeGraphs
from brisk.runtime.decode_plan import Adapters, DecodePlans
from brisk.runtime.model_runner import sdpa_context
from brisk.runtime.step import RunnerOutput, StepBatch, run_step
from brisk.runtime.virtual_kv import VirtualKV


def model_kv_groups(model: CausalLM, max_model_len: int | None = None) -> tuple[KVGroup, ...]:
    """The KV groups of `model` serving sequences of up to `max_model_len` (its rotary tables' length)."""
    return kv_groups(model.config, max_model_len or model.max_positions)


def _slot_heads(model: CausalLM, groups: tuple[KVGroup, ...]) -> list[int | None]:
    """KV heads of each slot (layer j of every group shares slot j's tensors); None for a slot no
    layer of this process uses (pipeline stages hold some layers only)."""
    heads = model.kv_heads_per_layer()
    out: list[int | None] = [None] * len(groups[0].layers)
    for group in groups:
        for j, layer in enumerate(group.layers):
            h = heads[layer]
            if h is not None:
                assert out[j] in (None, h), "layers sharing a KV slot hold the same number of KV heads"
                out[j] = h
    return out


def kv_block_bytes(model: CausalLM, block_size: int, groups: tuple[KVGroup, ...] | None = None) -> int:
    """Bytes of one block: keys and values of the layers (one per slot) and KV heads this process holds."""
    cfg = model.config
    itemsize = torch.tensor([], dtype=model.dtype).element_size()
    heads = sum(h for h in _slot_heads(model, groups or model_kv_groups(model)) if h is not None)
    return 2 * heads * block_size * cfg.head_dim * itemsize


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, but on the CPU from calloc (numpy.zeros): a large block comes from fresh
    mmap'd pages the kernel zeroes when first touched, so a KV cache costs neither load time (a
    2 GiB torch.zeros wrote every page: ~0.7 s of Gemma 3's load) nor memory until it is used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    if dtype == torch.bfloat16:  # numpy has no bfloat16; zero bits are +0.0 in every float type
        return torch.from_numpy(np.zeros(shape, dtype=np.int16)).view(torch.bfloat16)
    try:
        np_dtype = torch.empty((), dtype=dtype).numpy().dtype
    except TypeError:  # a dtype numpy lacks
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(shape, dtype=np_dtype))


def allocate_paged_kv(model: CausalLM, num_blocks: int, block_size: int,
                      groups: tuple[KVGroup, ...] | None = None) -> list[KVCache | None]:
    """Per layer: keys [blocks, kv_heads, head_dim, block_size], values [blocks, kv_heads,
    block_size, head_dim], the tensors of its KV slot (shared with layer j of the other groups);
    None for a layer another pipeline stage holds."""
    groups = groups or model_kv_groups(model)
    hd, dtype, device = model.config.head_dim, model.dtype, model.device
    slots = [None if heads is None else
             (kv_zeros((num_blocks, heads, hd, block_size), dtype, device),
              kv_zeros((num_blocks, heads, block_size, hd), dtype, device))
             for heads in _slot_heads(model, groups)]
    _, slot_of = layer_slots(groups, model.config.num_hidden_layers)
    return [None if heads is None else slots[slot_of[layer]] for layer, heads in enumerate(model.kv_heads_per_layer())]


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn: PagedAttention
    sample_rows: list[int]  # flat-batch row of each sampled request's last token
    sample_ids: list[str]  # those requests, in the same order
    all_rows: dict[str, tuple[int, int]]  # request -> (first row, count) for those wanting every row

    def logit_rows(self) -> tuple[list[int], dict[str, tuple[int, int]]]:
        """The flat-batch rows to project through the LM head, and each request's (first, count)
        among them: the sampled row alone, or every row for requests in `all_rows`."""
        index: list[int] = []
        rows: dict[str, tuple[int, int]] = {}
        for rid, row in zip(self.sample_ids, self.sample_rows):
            if rid not in self.all_rows:
                rows[rid] = (len(index), 1)
                index.append(row)
        for rid, (first, n) in self.all_rows.items():
            rows[rid] = (len(index), n)
            index.extend(range(first, first + n))
        return index, rows


class PagedModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, pack_weights: bool = True,
                 groups: tuple[KVGroup, ...] | None = None, virtual: VirtualKV | None = None,
                 graphs: bool | None = None, eager: bool = False) -> None:
        """`virtual`: the virtual layout's reserved tensors (runtime/virtual_kv.py) instead of a
        block pool; `num_blocks` is then its rows x tiles, and there is one KV group. `graphs`:
        replay pure-decode steps as CUDA graphs (runtime/decode_graphs.py); None: on CUDA unless
        `eager`. `eager` (`LLM(enforce_eager=True)`): every step runs module by module, without
        the C++ decode plan (runtime/decode_plan.py) or CUDA graphs."""
        self.model = model
        self.plans = DecodePlans(model, enabled=not eager)  # the CPU's decode steps in C++
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = model.device
        self.virtual = virtual
        self.groups = groups or model_kv_groups(model)  # the scheduler's KV groups: one table each
        assert virtual is None or len(self.groups) == 1, "the virtual layout gives every layer its own row"
        self.layer_group, _ = layer_slots(self.groups, model.config.num_hidden_layers)
        if graphs is None:
            graphs = self.device.type == "cuda" and not eager
        graphs = graphs and virtual is None
        # with graphs, one block more than the pool hands out: the padding rows' KV lands there
        self.kv_caches = allocate_paged_kv(model, num_blocks + int(graphs), block_size, self.groups) \
            if virtual is None else virtual.kv_caches
        # Batched rows (prefill chunks, decode batches) through oneDNN-packed weights on CPU; the
        # copies cost as much memory as the weights again (`pack_weights=False` saves it).
        self.packed_weight_bytes = model.pack_weights() if pack_weights and self.device.type == "cpu" else 0
        cfg = model.config
        # The kernel's fixed-size buffers: query heads per KV head <= 16, head_dim <= 256, block <= 256.
        fits = (cfg.num_attention_heads // cfg.num_key_value_heads <= 16 and cfg.head_dim <= 256
                and block_size <= 256)
        kernel = (HAVE_PAGED_KERNEL and fits and self.device.type == "cpu"
                  and model.dtype in (torch.float32, torch.bfloat16))
        # How spans of <= KERNEL_MAX_QUERY new tokens attend: brisk's CPU kernel; one padded SDPA
        # (accelerators, where per-sequence launches would dominate); or one by one like long chunks.
        self.short_spans = "kernel" if kernel else "padded" if self.device.type != "cpu" else "gather"
        self.graphs = DecodeGraphs(model, self.kv_caches, block_size, num_blocks, len(self.groups),
                                   self.layer_group, capture=self.device.type == "cuda") if graphs else None
        # Speculative Streaming: keep the residual stream entering this layer for the sampled rows
        # (StepLogits.captured); None: the forward runs whole
        self.capture_layer: int | None = None

    def _uses_kernel(self, step: ScheduledRequest) -> bool:
        """True: the step is one of the batched short spans laid out first."""
        return self.short_spans != "gather" and len(step.token_ids) <= KERNEL_MAX_QUERY

    def prepare(self, steps: Sequence[ScheduledRequest], all_rows_for: frozenset[str] = frozenset()) -> StepInputs:
        """Lay the batch out kernel spans first (see model/paged_attention.py) and build its tensors."""
        kernel = [s for s in steps if self._uses_kernel(s)]
        gather = [s for s in steps if not self._uses_kernel(s)]
        num_groups = len(self.groups)
        ids: list[int] = []
        positions: list[int] = []
        blocks: list[list[int]] = [[] for _ in range(num_groups)]
        offsets: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        query_start = [0]
        spans: list[GatherSpan] = []
        all_rows: dict[str, tuple[int, int]] = {}
        bs, dev = self.block_size, self.device
        for i, step in enumerate([*kernel, *gather]):
            n = len(step.token_ids)
            first = len(ids)
            pos = range(step.start_pos, step.start_pos + n)
            ids.extend(step.token_ids)
            positions.extend(pos)
            for group_blocks, table in zip(blocks, step.block_ids):
                group_blocks.extend(table[p // bs] for p in pos)
            offsets.extend(p % bs for p in pos)
            if step.sample:
                sample_rows.append(first + n - 1)
                sample_ids.append(step.request_id)
            if step.request_id in all_rows_for:
                all_rows[step.request_id] = (first, n)
            kv_len = step.start_pos + n
            if i < len(kernel):
                query_start.append(first + n)
            else:
                run = _run_start(step.block_ids[0]) if self.virtual is not None else None
                tables = [] if run is not None else [  # a row of its own is sliced: no ids to gather
                    torch.tensor(_readable(t[: -(-kv_len // bs)]), dtype=torch.long, device=dev)
                    for t in step.block_ids]
                spans.append(GatherSpan(first, n, kv_len, tables, causal_mask(n, kv_len, dev), run))
        width = max((len(s.block_ids[0]) for s in kernel), default=1)
        # padded with the table's own first block: masked, but read (padded SDPA), and on a virtual
        # layout's device pages block 0 may be unmapped while this request runs
        tables = [[_pad(_readable(s.block_ids[g]), width) for s in kernel] for g in range(num_groups)]
        kv_lens = [s.start_pos + len(s.token_ids) for s in kernel]
        attn = PagedAttention(
            kv_caches=self.kv_caches,
            slot_blocks=[torch.tensor(b, dtype=torch.long, device=dev) for b in blocks],
            slot_offsets=torch.tensor(offsets, dtype=torch.long, device=dev),
            num_kernel_tokens=query_start[-1],
            block_tables=[torch.tensor(t or [[0]], dtype=torch.int32, device=dev) for t in tables],
            query_start=torch.tensor(query_start, dtype=torch.int32, device=dev),
            kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=dev),
            gather_spans=spans,
            scale=self.model.config.attn_scale,
            layer_group=self.layer_group,
            padded=padded_spans(tables, [len(s.token_ids) for s in kernel], kv_lens, bs, dev)
            if kernel and self.short_spans == "padded" else None,
        )
        return StepInputs(torch.tensor(ids, dtype=torch.long, device=dev),
                          torch.tensor(positions, dtype=torch.long, device=dev), attn, sample_rows, sample_ids,
                          all_rows)

    def execute_model(self, batch: StepBatch) -> RunnerOutput:
        """One engine step: the forward, then the sampled ids (runtime/step.py)."""
        return run_step(self, batch)

    def check(self) -> None:
        """Nothing ends under a single process but the process (the Runner protocol)."""

    def info(self) -> dict[str, float]:
        return {}

    @torch.inference_mode()
    def execute(self, steps: Sequence[ScheduledRequest], all_rows_for: frozenset[str] = frozenset(),
                head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> StepLogits:
        """Run one forward; return float32 logits of each sampled request's last token and, for the
        requests in `all_rows_for`, of every token they computed this step (prompt logprobs,
        speculative verification), projected through the LM head in one call (`head`: another
        projection to [rows, vocab], e.g. a draft's subset of the vocabulary)."""
        plain = not all_rows_for and head is None and self.capture_layer is None
        key = self.graphs.key(steps) if self.graphs is not None and plain else None
        if key is not None:
            with sdpa_context(self.device):
                done = self.graphs.run(steps, key)
            if done is not None:
                ids = [s.request_id for s in steps]
                return StepLogits(done[0], {rid: (i, 1) for i, rid in enumerate(ids)}, ids, done[1])
        inputs = self.prepare(steps, all_rows_for)
        captured = None
        with sdpa_context(self.device):
            if self.capture_layer is None:
                hidden = self.plans.forward(inputs.input_ids, inputs.positions, inputs.attn)  # [num_tokens, hidden]
            else:
                hidden, captured = self._forward_capturing(inputs)
        index, rows = inputs.logit_rows()
        if not index:
            return StepLogits(hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32), {}, [],
                              hidden[:0], None if captured is None else captured[:0])
        picked = pick_rows(hidden, index)
        logits = (head or self.model.compute_logits)(picked)  # [len(index), vocab]
        return StepLogits(logits, rows, inputs.sample_ids, picked,
                          None if captured is None else pick_rows(captured, index))

    def _forward_capturing(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward in two runs of layers (the decode plan serves each), keeping the residual
        stream between them: final hidden states and that stream, [num_tokens, hidden] each."""
        model, cut, layers = self.model, self.capture_layer, self.plans.run_layers
        h, residual = layers(model.embed(inputs.input_ids), None, inputs.positions, inputs.attn, 0, cut)
        stream = h if residual is None else h + residual
        h, residual = layers(h, residual, inputs.positions, inputs.attn, cut, model.config.num_hidden_layers)
        return model.final_norm(h, residual), stream

    def adapted_plans(self, adapters: Adapters, module_context: Callable[[], AbstractContextManager[None]],
                      model: Any = None) -> DecodePlans:
        """Decode plans over this runner's model (or `model`: another stack of layers over the
        same KV cache, e.g. quantized copies of its top layers) with low-rank adapters on some
        Linears (`DecodePlans`; eager when this runner is), for `run_rows`."""
        return DecodePlans(model or self.model, enabled=self.plans.enabled, adapters=adapters,
                           module_context=module_context)

    @torch.inference_mode()
    def run_rows(self, steps: Sequence[ScheduledRequest], h: torch.Tensor, start: int, plans: DecodePlans
                 ) -> torch.Tensor:
        """Rows `h` [num tokens, hidden], laid out as `steps` (whose token ids are not read), through
        layers `start`.. with `plans` (the decode plan where it serves them, else the modules), their
        keys and values written to the steps' slots: final-normed hidden states [num tokens, hidden]."""
        inputs = self.prepare(steps)
        with sdpa_context(self.device):
            h, residual = plans.run_layers(h, None, inputs.positions, inputs.attn, start,
                                           self.model.config.num_hidden_layers)
        return self.model.final_norm(h, residual)

    @torch.inference_mode()
    def exit_hidden(self, steps: Sequence[ScheduledRequest], num_layers: int) -> torch.Tensor:
        """Early exit: run the first `num_layers` layers (writing their KV) and return the normed
        hidden state of each step's last token, in step order: [len(steps), hidden]."""
        inputs = self.prepare(steps)
        with sdpa_context(self.device):
            hidden = self.plans.forward(inputs.input_ids, inputs.positions, inputs.attn, num_layers)  # [num_tokens, hidden]
        order = {rid: row for rid, row in zip(inputs.sample_ids, inputs.sample_rows)}
        return hidden[torch.tensor([order[s.request_id] for s in steps], device=self.device)]


def _run_start(table: list[int]) -> int | None:
    """The first id of a table of consecutive ids (a virtual row of its own), else None (it
    reads a shared prefix where another row holds it: gathered like paged blocks)."""
    return table[0] if table and table[-1] - table[0] == len(table) - 1 else None


def _pad(table: list[int], width: int) -> list[int]:
    return table + [table[0] if table else 0] * (width - len(table))


def _readable(table: list[int]) -> list[int]:
    """A table as the kernels take it: NO_BLOCK entries (before a sliding window, never read) as block 0."""
    return [0 if b == NO_BLOCK else b for b in table] if NO_BLOCK in table else table


def pick_rows(hidden: torch.Tensor, index: list[int]) -> torch.Tensor:
    """Rows `index` of hidden [n, hidden]; the tensor itself when that is every row in order."""
    if index == list(range(hidden.shape[0])):
        return hidden
    return hidden[torch.tensor(index, device=hidden.device)]


@dataclass
class StepLogits:
    """The logits one step produced: `rows[request] = (first, count)` into `logits`."""

    logits: torch.Tensor  # [rows, vocab] float32
    rows: dict[str, tuple[int, int]]  # count 1: the sampled row only; else every computed token's row
    sample_ids: list[str]  # requests that reached the end of their known tokens, in batch order
    hidden: torch.Tensor  # [rows, hidden]: the final hidden states the logits came from (Medusa heads read them)
    captured: torch.Tensor | None = None  # [rows, hidden]: the residual stream entering `capture_layer`

    def of(self, request_id: str) -> torch.Tensor:
        """Every row of one request: [count, vocab]."""
        first, n = self.rows[request_id]
        return self.logits[first:first + n]

    def last_rows(self, request_ids: list[str]) -> torch.Tensor:
        """The sampled (last) row of each request, in order: [len(request_ids), vocab]."""
        index = [self.rows[rid][0] + self.rows[rid][1] - 1 for rid in request_ids]
        if index == list(range(self.logits.shape[0])):
            return self.logits
        return self.logits[torch.tensor(index, device=self.logits.device)]
