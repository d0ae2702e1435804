"""The KV manager protocol: what the scheduler asks of a KV layout, in ints and lists.

A KV layout has two halves: a manager here in core/ (who holds which KV slots, capacity, the
prefix cache) and the tensors in runtime/. The scheduler is handed a manager and never builds
one; it asks it three kinds of questions:

- capacity: could one request of n tokens ever be served (`fits_alone`, the scheduler's
  liveness bound), and is there room for this step's tokens now (`allocate_slots` answers None
  and changes nothing when there is not);
- prefix hits at admission (`get_computed_blocks`);
- bookkeeping (`free`, `uncache` after a failed step, statistics, invariants).

Every layout answers in block tables: per KV group, the ids of the `block_size`-token ranges
that hold a request's positions in order (`ScheduledRequest.block_ids`). The paged layout
(`KVCacheManager`) draws them from a shared pool; the virtual layout (`VirtualKVManager`) gives
each request one contiguous row, so its table is a run of consecutive ids (after the tiles of a
cached prefix it reads where another row holds them). Physical memory
that a layout commits or gives back as tokens come and go is described by `take_memory_ops`
(the runtime carries it out); the paged layout's memory is fixed, so it has none.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from brisk.request import Request


@dataclass(frozen=True)
class MemoryOp:
    """Commit (`populate`) or give back (`release`) the pages of tiles [first, first + count) of
    one row of a virtual KV layout, in every layer's keys and values."""

    kind: str  # "populate" | "release"
    row: int
    first: int
    count: int
    ahead: bool = False  # populate only: tiles the next steps will write, not this one (may run beside the forward)


class KVManager(Protocol):
    """What the scheduler needs of a KV layout (see the module docstring)."""

    block_size: int  # tokens per block-table entry
    enable_prefix_caching: bool

    def fits_alone(self, num_tokens: int, chunk: int) -> bool:
        """True when one request of `num_tokens`, computing up to `chunk` tokens a step, could
        hold its KV with the whole cache to itself."""
        ...

    def capacity_error(self, num_tokens: int, chunk: int) -> str:
        """Why a prompt of `num_tokens` can never be served (when `fits_alone` is False)."""
        ...

    def get_computed_blocks(self, request: Request) -> tuple[list[list[int]], int]:
        """Prefix-cache hit at admission: (per group, the hit's block ids; tokens they hold)."""
        ...

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[Sequence[int]] = ()) -> list[list[int]] | None:
        """Room for `num_new_tokens` after the computed ones: the request's block tables, or None
        (nothing changed) when the cache is short."""
        ...

    def free(self, request: Request) -> None:
        """Give the request's KV back (finish, abort or preemption)."""
        ...

    def uncache(self, block_ids: Iterable[int]) -> None:
        """Withdraw blocks from the prefix cache: a failed step wrote no valid KV into them."""
        ...

    def reset_prefix_cache(self) -> None:
        """Withdraw every published block: later requests compute their whole prompt (benchmarks
        rerunning the same prompts). Requests keep the KV they hold."""
        ...

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block tables (empty lists when it holds none)."""
        ...

    def take_memory_ops(self) -> list[MemoryOp]:
        """Page commits and releases decided since the last call, in order."""
        ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def usage(self) -> float:
        """Fraction of the cache's capacity in use."""
        ...

    @property
    def hit_rate(self) -> float: ...

    def check_invariants(self, running_request_ids: Iterable[str]) -> None: ...
