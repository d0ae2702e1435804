"""Pure-decode steps at static shapes, replayed as CUDA graphs.

A decode step of a small model on a GPU is bound by the host: on an H200 a SmolLM2-135M step
launched ~1,200 kernels (34 ms) for 2-4 ms of GPU work (BENCHMARKS.md, "On a GPU"). A CUDA graph
records the step's kernels once and replays them with one launch. It needs every tensor at a fixed
address and shape, and no host synchronisation inside. So a step of `n` single-token sequences is
padded to a bucket `(batch, width)`: `batch` a power of two >= n, `width` a power of two >= the
longest block table. Its inputs (token ids, positions, KV slots, block tables, KV lengths) are
packed into one int64 buffer at the bucket's fixed offsets and land on the device in one copy;
the attention masks are computed inside the graph from the KV lengths. Padding rows are
sequences of one token at position 0 that write their KV into a block no request owns (the
runner allocates one block more than the pool hands out) and read only it.

The path is the runner's padded-SDPA attention (model/paged_attention.py) with fixed shapes, so
on the CPU it runs too, without capture (tests check it against the ordinary step there). A
capture that fails (an operator that syncs with the host, memory) warns once and leaves the steps
eager: the engine's results never depend on graphs being available. The graphs end at the final
hidden states: the LM head runs eagerly on the real rows only (a [batch, vocab] output per graph
would hold GBs for a 128k vocabulary). Buckets are captured on first use, and captured again
when the model's modules change (`modules_version`, moved by `modules_changed`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from brisk.core.kv_cache_manager import NO_BLOCK
from brisk.model.attention import KVCache
from brisk.model.base import CausalLM
from brisk.model.paged_attention import PagedAttention, PaddedSpans

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 256  # wider decode batches run eagerly (they are compute-bound anyway)
MIN_WIDTH = 4  # blocks: the narrowest table bucket
# a bucket whose padded keys and values (one layer's gather) would pass this runs eagerly: the
# gather is materialised per layer, and graphs keep their intermediates for their whole life
MAX_GATHER_BYTES = 512 * 2**20


class DecodeStep(Protocol):
    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[list[int]]
    sample: bool


def bucket(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor)."""
    return 1 << (max(n, floor) - 1).bit_length()


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: run `_forward` directly (no capture: CPU, tests)
    hidden: torch.Tensor  # [batch, hidden]: the final normed hidden states, written by each replay


class DecodeGraphs:
    """Static-shape decode steps of one runner's model and KV tensors (see module docstring)."""

    def __init__(self, model: CausalLM, kv_caches: list[KVCache | None], block_size: int, trash_block: int,
                 num_groups: int, layer_group: list[int] | None, capture: bool = True) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.trash = trash_block  # a block no request owns: the padding rows' KV goes there
        self.num_groups = num_groups
        self.layer_group = layer_group
        self.capture = capture
        self.device = model.device
        self.max_width = bucket(-(-model.max_positions // block_size), MIN_WIDTH)
        cfg = model.config
        heads = max((h for h in model.kv_heads_per_layer() if h is not None), default=cfg.num_key_value_heads)
        itemsize = torch.tensor([], dtype=model.dtype).element_size()
        self._key_bytes = 2 * heads * block_size * cfg.head_dim * itemsize  # keys + values of one block, one layer
        # table cells (batch x width) of the widest bucket allowed: MAX_GATHER_BYTES bounds them, so a
        # model of long context does not pin batch x max width ids
        self._max_cells = min(MAX_GRAPH_BATCH * self.max_width, MAX_GATHER_BYTES // self._key_bytes)
        size = MAX_GRAPH_BATCH * (4 + num_groups) + num_groups * self._max_cells
        self._staged = torch.zeros(size, dtype=torch.long, device=self.device)  # every graph's inputs
        self._host = torch.zeros(size, dtype=torch.long, pin_memory=self.device.type == "cuda")
        # set when a copy out of `_host` is queued: the next step waits for it before refilling
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self._key_pos = torch.arange(self.max_width * block_size, device=self.device).view(1, 1, 1, -1)
        self._rows = torch.arange(MAX_GRAPH_BATCH, device=self.device)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool: object | None = None  # one memory pool for every graph (they never run at once)
        self._version = model.modules_version  # the modules the graphs hold pointers into
        self.disabled: str | None = None  # why graphs stopped (a failed capture): steps run eagerly
        self.replays = 0  # steps served here (tests, metrics)

    def key(self, steps: Sequence[DecodeStep]) -> tuple[int, int] | None:
        """The bucket of a step this class can run; None: run it eagerly."""
        if self.disabled or not steps or len(steps) > MAX_GRAPH_BATCH:
            return None
        if self.model.modules_version != self._version:
            self.reset()
        if any(len(s.token_ids) != 1 or not s.sample for s in steps):
            return None
        blocks = max(s.start_pos // self.block_size + 1 for s in steps)
        if blocks > self.max_width:
            return None
        key = (bucket(len(steps)), bucket(blocks, MIN_WIDTH))
        if key[0] * key[1] > self._max_cells:
            return None
        return key

    def reset(self) -> None:
        """Drop every graph (the modules changed); buckets are captured again on use."""
        self._graphs.clear()
        self._pool = None
        self._version = self.model.modules_version

    def run(self, steps: Sequence[DecodeStep], key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Float32 logits [len(steps), vocab] and final hidden states of one decode step (the
        hidden states a copy: the graph's are overwritten by the next replay); None when a capture
        just failed (the caller runs the step eagerly)."""
        self._stage(steps, key)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._build(key)
            if graph is None:
                return None
            self._graphs[key] = graph
        elif graph.graph is not None:
            graph.graph.replay()
        else:
            graph.hidden = self._forward(key)
        self.replays += 1
        hidden = graph.hidden[: len(steps)].clone()
        return self.model.compute_logits(hidden).float(), hidden

    def _layout(self, key: tuple[int, int]) -> tuple[int, ...]:
        """Offsets of ids, positions, offsets, kv lengths, slot blocks [groups, batch] and tables
        [groups, batch, width] in the staged buffer, and its used length."""
        b, w = key
        g = self.num_groups
        return (0, b, 2 * b, 3 * b, 4 * b, 4 * b + g * b, 4 * b + g * b + g * b * w)

    def _stage(self, steps: Sequence[DecodeStep], key: tuple[int, int]) -> None:
        """Pack the step's inputs at the bucket's offsets and copy them to the device at once."""
        b, w = key
        bs, pad = self.block_size, b - len(steps)
        ids = [s.token_ids[0] for s in steps] + [0] * pad
        pos = [s.start_pos for s in steps] + [0] * pad
        offsets = [p % bs for p in pos]
        kv_lens = [p + 1 for p in pos]
        slots: list[int] = []
        tables: list[int] = []
        # NO_BLOCK (before a sliding window: masked, never read) as the spare block, never a block
        # a request owns
        trash = self.trash
        for g in range(self.num_groups):
            slots += [s.block_ids[g][s.start_pos // bs] for s in steps] + [trash] * pad
        if NO_BLOCK in slots:
            raise ValueError("a decode step's own KV slot has no block (NO_BLOCK): the KV manager gave it none")
        for g in range(self.num_groups):
            for s in steps:
                row = [trash if x == NO_BLOCK else x for x in s.block_ids[g][: s.start_pos // bs + 1]]
                tables += row + [trash] * (w - len(row))
            tables += [trash] * (w * pad)
        flat = ids + pos + offsets + kv_lens + slots + tables
        n = self._layout(key)[-1]
        assert len(flat) == n
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read `_host`
        self._host[:n] = torch.tensor(flat, dtype=torch.long)
        self._staged[:n].copy_(self._host[:n], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _forward(self, key: tuple[int, int]) -> torch.Tensor:
        """The step on the staged inputs: every tensor a view of fixed buffers (capturable)."""
        b, w = key
        g = self.num_groups
        o_ids, o_pos, o_off, o_len, o_slot, o_tab, end = self._layout(key)
        s = self._staged
        ids, pos, offsets, kv_lens = s[o_ids:o_pos], s[o_pos:o_off], s[o_off:o_len], s[o_len:o_slot]
        slots = s[o_slot:o_tab].view(g, b)
        tables = s[o_tab:end].view(g, b, w)
        key_pos = self._key_pos[..., : w * self.block_size]  # [1, 1, 1, keys]
        kv = kv_lens.view(b, 1, 1, 1)
        padded = PaddedSpans(list(tables.unbind(0)), self._rows[:b], 1, key_pos < kv, kv - 1, key_pos)
        cfg = self.model.config
        attn = PagedAttention(kv_caches=self.kv_caches, slot_blocks=list(slots.unbind(0)), slot_offsets=offsets,
                              num_kernel_tokens=b, block_tables=[], query_start=kv_lens[:0], kv_lens=kv_lens,
                              gather_spans=[], scale=cfg.attn_scale, layer_group=self.layer_group, padded=padded)
        return self.model(ids, pos, attn)  # [b, hidden]

    def _build(self, key: tuple[int, int]) -> _Graph | None:
        """Run the staged step once and record it (with capture); None if capture failed."""
        if not self.capture:
            return _Graph(None, self._forward(key))
        try:
            # warm-up on a side stream, as torch asks (lazy initialisations must not be captured);
            # it writes the step's KV, which the replay below writes again, to the same slots
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward(key)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of other threads (the server's) neither break the capture
            # nor fail because of it
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                hidden = self._forward(key)
            graph.replay()
        except Exception as e:  # noqa: BLE001 (whatever refused capture, the step still runs eagerly)
            self.disabled = f"CUDA graph capture failed ({type(e).__name__}: {e}); decode steps run eagerly"
            log.warning(self.disabled)
            self._graphs.clear()
            torch.cuda.synchronize(self.device)
            return None
        return _Graph(graph, hidden)
