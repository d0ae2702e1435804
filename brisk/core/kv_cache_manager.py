"""Which KV blocks each request holds, and the prefix cache over full blocks.

A request's tokens map onto its block table in order; only FULL blocks are ever cached:

    all_token_ids   | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 t10 t11 | t12 t13 .. |   (block_size 4)
    block table     [    b7       ][    b3      ][     b9       ][   b12     ]
    block hashes       h0=H(-,b7)    h1=H(h0,b3)    h2=H(h1,b9)     (partial: no hash)

Each hash covers its block's tokens AND, through the parent hash, every token before them, so
the same four tokens after a different prefix get a different hash. Hashes are SHA-256 (a
collision would need a SHA-256 collision) and a hit is additionally verified against the
block's stored token ids.

With several KV groups (core/kv_groups.py) a request holds one table per group, all covering
the same positions; a group's cached blocks are keyed by the hash and the group. A sliding
group's table lets go of the blocks wholly before the window of the next token to compute
(`NO_BLOCK` takes their place), and a prefix hit there needs only the blocks of the window
before the hit's end:

    sliding, window 6   | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 t10 t11 | t12 ..   next query: t12
    table                 NO_BLOCK      [   b3     ][     b9       ][  b12     sees t7 .. t12
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence

from brisk.core.block_pool import BlockHash, BlockPool, KVBlock
from brisk.core.kv_manager import MemoryOp
from brisk.errors import UserError
from brisk.request import Request


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained block hash: SHA-256 over the parent's digest and the block's token ids (int64)."""
    h = hashlib.sha256(parent or b"", usedforsecurity=False)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(hashes: list[BlockHash], request: Request, block_size: int) -> list[BlockHash]:
    """`hashes` (the request's full-block hashes so far) extended in place to cover all its known
    tokens (prompt and generated), so a finished conversation's blocks can be hit later."""
    for i in range(len(hashes), request.num_tokens // block_size):
        tokens = request_tokens(request, i * block_size, (i + 1) * block_size)
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens))
    return hashes


def request_tokens(request: Request, start: int, end: int) -> list[int]:
    """`request.all_token_ids[start:end]` without concatenating the whole prompt and output."""
    prompt = request.prompt_token_ids
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return request.output_token_ids[start - n:end - n]
    return prompt[start:] + request.output_token_ids[:end - n]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


NO_BLOCK = -1  # a table entry whose block was let go: wholly before a sliding group's window


class KVCacheManager:
    """The paged layout's manager (core/kv_manager.py's protocol): per-request block tables (one per KV group) over one `BlockPool`, plus prefix-cache lookups
    and statistics.

    Capacity is a return value: `allocate_slots` answers None and changes nothing when the pool is
    short. Blocks of a request are cached (published) as soon as the step that fills them is
    scheduled, as in vLLM v1; a later request in the same step may therefore read them, so the
    runner must write each layer's KV for all scheduled tokens before attention reads the cache.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 windows: Sequence[int] = (0,)) -> None:
        if block_size < 1:
            raise UserError(f"block_size must be >= 1, got {block_size}")
        if not windows or any(w < 0 for w in windows):
            raise UserError(f"KV groups need windows >= 0 (0: full attention), got {list(windows)}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)  # per KV group: 0 full, else its sliding window
        self._sliding = any(self.windows)
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._blocks: dict[str, list[list[KVBlock | None]]] = {}  # request id -> a table per group
        self._hashes: dict[str, list[BlockHash]] = {}  # request id -> hashes of its full blocks
        self._num_cached: dict[str, int] = {}  # request id -> leading blocks already published
        self.prefix_cache_queries = 0  # tokens looked up, once per admission
        self.prefix_cache_hits = 0  # of which found in the cache

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    # ----------------------------------------------------------------------------- sizes

    def window_blocks(self, window: int, chunk: int) -> int:
        """The most blocks a sliding group holds for a request computing up to `chunk` tokens a
        step: the window before the step's first token, the step's tokens, one partial block."""
        return cdiv(window - 1 + chunk, self.block_size) + 1

    def blocks_needed(self, num_tokens: int, chunk: int) -> int:
        """Blocks one request of `num_tokens` may hold at once over all groups, computing up to
        `chunk` tokens a step (the scheduler's liveness bound and prompt check)."""
        n = cdiv(num_tokens, self.block_size)
        return sum(n if not w else min(n, self.window_blocks(w, chunk)) for w in self.windows)

    def fits_alone(self, num_tokens: int, chunk: int) -> bool:
        return self.blocks_needed(num_tokens, chunk) <= self.pool.num_blocks

    def capacity_error(self, num_tokens: int, chunk: int) -> str:
        return (f"prompt has {num_tokens} tokens and needs {self.blocks_needed(num_tokens, chunk)} KV blocks of "
                f"{self.block_size} tokens, but the KV cache has only {self.pool.num_blocks} blocks; shorten the "
                "prompt or give the cache more memory")

    # ----------------------------------------------------------------------------- hashing

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        return extend_block_hashes(self._hashes.setdefault(request.request_id, []), request, self.block_size)

    @staticmethod
    def _key(block_hash: BlockHash, group: int) -> BlockHash:
        """The cache key of a block of `group`: the same tokens hold other layers' KV in another group."""
        return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

    # ----------------------------------------------------------------------------- lookup

    def get_computed_blocks(self, request: Request) -> tuple[list[list[int]], int]:
        """Longest run of cached full blocks at the start of the request's tokens that every group
        can serve (a sliding group: the blocks of the window before its end).

        Returns (per group, the block ids of the hit, NO_BLOCK where a sliding group needs none;
        the number of tokens they hold). At least one token is always left to compute, so the step
        produces logits: the hit is capped at num_tokens - 1, rounded down to a block.
        """
        empty: list[list[int]] = [[] for _ in self.windows]
        if not self.enable_prefix_caching:
            return empty, 0
        assert request.request_id not in self._blocks, "prefix lookup is for requests holding no blocks"
        bs = self.block_size
        hashes = self._block_hashes(request)
        limit = min(len(hashes), (request.num_tokens - 1) // bs)
        found: list[list[KVBlock | None]] = [[] for _ in self.windows]
        for i in range(limit):
            tokens = request_tokens(request, i * bs, (i + 1) * bs)
            for g, w in enumerate(self.windows):
                found[g].append(self.pool.get_cached_block(self._key(hashes[i], g), tokens))
            if any(found[g][i] is None for g, w in enumerate(self.windows) if not w):
                break  # a full group's chain ends here
        num = self._hit_blocks(found)
        hit = [[NO_BLOCK if i < self._window_start(w, num * bs) else blocks[i].block_id  # type: ignore[union-attr]
                for i in range(num)] for blocks, w in zip(found, self.windows)]
        return (hit, num * bs) if num else (empty, 0)

    def _hit_blocks(self, found: list[list[KVBlock | None]]) -> int:
        """The most leading blocks every group can serve, given what each found cached."""
        num = min(len(f) for f in found)
        for f, w in zip(found, self.windows):
            if not w:
                num = min(num, next((i for i, b in enumerate(f) if b is None), len(f)))
        while num > 0:
            if all(all(b is not None for b in f[self._window_start(w, num * self.block_size):num])
                   for f, w in zip(found, self.windows) if w):
                return num
            num -= 1
        return 0

    def _window_start(self, window: int, first_pos: int) -> int:
        """The first block a sliding group needs when the next token to compute is at `first_pos`
        (0 for a full group): the queries from `first_pos` on see keys from first_pos - window + 1."""
        return max(0, first_pos - window + 1) // self.block_size if window else 0

    # ----------------------------------------------------------------------------- allocation

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[Sequence[int]] = ()) -> list[list[int]] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (and the hit blocks).

        Returns the request's block tables (one per group, NO_BLOCK where a sliding group let a
        block go), or None, changing nothing that matters, when the pool lacks the blocks (blocks
        no query will read again may have been let go). Then publishes the blocks that this step fills.
        """
        rid, bs = request.request_id, self.block_size
        tables = self._blocks.get(rid)
        num_hit = len(new_computed_blocks[0]) if new_computed_blocks else 0
        assert not num_hit or (tables is None and request.num_computed_tokens == 0), "hits only at admission"
        first_pos = request.num_computed_tokens + num_hit * bs  # the first token computed this step
        num_tokens_after = first_pos + num_new_tokens
        if tables is None:
            tables = self._admit_tables(request, new_computed_blocks, num_tokens_after)
            if tables is None:
                return None
        else:
            if self._sliding:
                self._release_outside_windows(tables, first_pos)
            # every group's table covers the same positions: each needs the same number of blocks
            num_new = max(0, cdiv(num_tokens_after, bs) - len(tables[0]))
            if num_new * self.num_groups > self.pool.num_free_blocks:
                return None
            if num_new:
                for table in tables:
                    table.extend(self.pool.get_new_blocks(num_new))
        self._cache_full_blocks(request, tables, num_tokens_after)
        return [self._ids(table, w) for table, w in zip(tables, self.windows)]

    def _admit_tables(self, request: Request, hit_ids: Sequence[Sequence[int]], num_tokens_after: int
                      ) -> list[list[KVBlock | None]] | None:
        """A new request's tables: its prefix hits, then new blocks; None when they do not fit."""
        hits = [[None if i == NO_BLOCK else self.pool.blocks[i] for i in ids] for ids in hit_ids] \
            or [[] for _ in self.windows]
        num_new = max(0, cdiv(num_tokens_after, self.block_size) - len(hits[0]))
        # A hit on a free block pulls it out of the free queue: it is not available for new blocks.
        num_revived = sum(1 for group in hits for b in group if b is not None and b.ref_cnt == 0)
        if num_new * self.num_groups > self.pool.num_free_blocks - num_revived:
            return None
        self._admit(request.request_id, len(hits[0]), request.num_tokens)
        for group in hits:
            self.pool.touch(b for b in group if b is not None)
            group.extend(self.pool.get_new_blocks(num_new))
        self._blocks[request.request_id] = hits
        return hits

    @staticmethod
    def _ids(table: list[KVBlock | None], window: int) -> list[int]:
        if not window:  # a full group never lets a block go
            return [b.block_id for b in table]  # type: ignore[union-attr]
        return [NO_BLOCK if b is None else b.block_id for b in table]

    def _release_outside_windows(self, tables: list[list[KVBlock | None]], first_pos: int) -> None:
        """Let go of each sliding group's blocks that no query from `first_pos - 1` on can see
        (one token early: draft slots are allocated after their step's decode token, whose query
        is at `first_pos - 1`). They stay in the prefix cache: a later hit's window may need them."""
        for table, w in zip(tables, self.windows):
            if not w:
                continue
            cut = self._window_start(w, max(0, first_pos - 1))
            gone = [b for b in table[:cut] if b is not None]
            if gone:
                table[:cut] = [None] * cut
                self.pool.free_blocks(reversed(gone))

    def _admit(self, request_id: str, num_hit_blocks: int, num_tokens: int) -> None:
        # Statistics are counted here, once per admission, rather than per lookup: a request
        # retried every step while the pool is full would otherwise be counted many times.
        self._num_cached[request_id] = num_hit_blocks
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_blocks * self.block_size

    def _cache_full_blocks(self, request: Request, tables: list[list[KVBlock | None]], num_tokens_after: int) -> None:
        """Publish the blocks that are full once this step's tokens are computed."""
        if not self.enable_prefix_caching:
            return
        rid, bs = request.request_id, self.block_size
        start = self._num_cached.get(rid, 0)
        num_full = min(num_tokens_after, request.num_tokens) // bs
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        for i in range(start, num_full):
            tokens = request_tokens(request, i * bs, (i + 1) * bs)
            for g, table in enumerate(tables):
                block = table[i]
                if block is not None:
                    self.pool.cache_full_block(block, self._key(hashes[i], g), tokens)
        self._num_cached[rid] = num_full

    def uncache(self, block_ids: Iterable[int]) -> None:
        self.pool.uncache(b for b in block_ids if b != NO_BLOCK)

    def reset_prefix_cache(self) -> None:
        self.pool.uncache([block.block_id for _, block in self.pool.cached_items()])

    def take_memory_ops(self) -> list[MemoryOp]:
        return []  # the pool's tensors are allocated once, whole

    def free(self, request: Request) -> None:
        """Release the request's blocks (preemption or finish). Tail blocks are freed first so
        that eviction takes a prefix's tail before its head, which later requests share."""
        rid = request.request_id
        for table in self._blocks.pop(rid, []):
            self.pool.free_blocks(b for b in reversed(table) if b is not None)
        self._hashes.pop(rid, None)
        self._num_cached.pop(rid, None)

    # ----------------------------------------------------------------------------- queries

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's tables, one per group (empty lists when it holds none)."""
        tables = self._blocks.get(request_id)
        if tables is None:
            return [[] for _ in self.windows]
        return [self._ids(table, w) for table, w in zip(tables, self.windows)]

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up tokens found in the prefix cache (0.0 before any lookup)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def check_invariants(self, running_request_ids: Iterable[str]) -> None:
        """Assert the bookkeeping is consistent (tests call this after every step)."""
        running = set(running_request_ids)
        assert set(self._blocks) == running, f"block holders {sorted(self._blocks)} != running {sorted(running)}"
        holders = [0] * self.pool.num_blocks
        for rid, tables in self._blocks.items():
            assert len(tables) == self.num_groups and len({len(t) for t in tables}) == 1, (
                f"request {rid}: tables of lengths {[len(t) for t in tables]} for {self.num_groups} groups")
            ids = [b.block_id for table in tables for b in table if b is not None]
            assert len(set(ids)) == len(ids), f"request {rid} holds a block twice: {ids}"
            for i in ids:
                holders[i] += 1
            for table, w in zip(tables, self.windows):
                lets_go = [b is None for b in table]
                assert w or not any(lets_go), f"request {rid}: a full group let a block go"
                assert lets_go == sorted(lets_go, reverse=True), f"request {rid}: a block let go after a kept one"
        free = set(self.pool.free_block_ids())
        cached = dict(self.pool.cached_items())
        for block in self.pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but held by {holders[block.block_id]} requests")
            assert (block.ref_cnt == 0) == (block.block_id in free), f"block {block.block_id} free-queue mismatch"
            assert (block.block_hash is None) == (block.token_ids is None)
            assert block.block_hash is None or cached.get(block.block_hash) is block, (
                f"block {block.block_id} carries a hash the cache map does not point back from")
        for block_hash, block in cached.items():
            assert block.block_hash == block_hash, f"cache entry points at block {block.block_id} with another hash"
            assert block.token_ids is not None and len(block.token_ids) == self.block_size
        assert len(free) == self.pool.num_free_blocks, "free queue holds a block twice"
