"""Which KV blocks each request holds, and the prefix cache over full blocks.

A request's tokens map onto its block table in order; only FULL blocks are ever cached:

    all_token_ids   | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 t10 t11 | t12 t13 .. |   (block_size 4)
    block table     [    b7       ][    b3      ][     b9       ][   b12     ]
    block hashes       h0=H(-,b7)    h1=H(h0,b3)    h2=H(h1,b9)     (partial: no hash)

Each hash covers its block's tokens AND, through the parent hash, every token before them, so
the same four tokens after a different prefix get a different hash. Hashes are SHA-256 (a
collision would need a SHA-256 collision) and a hit is additionally verified against the
block's stored token ids.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence

from brisk.core.block_pool import BlockHash, BlockPool, KVBlock
from brisk.request import Request


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained block hash: SHA-256 over the parent's digest and the block's token ids (int64)."""
    h = hashlib.sha256(parent or b"", usedforsecurity=False)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


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


class KVCacheManager:
    """Per-request block tables over a `BlockPool`, plus prefix-cache lookups and statistics.

    Capacity is a return value: `allocate_slots` answers None and changes nothing when the pool is
    short. Blocks of a request are cached (published) as soon as the step that fills them is
    scheduled, as in vLLM v1; a later request in the same step may therefore read them, so the
    runner must write each layer's KV for all scheduled tokens before attention reads the cache.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._blocks: dict[str, list[KVBlock]] = {}  # request id -> block table
        self._hashes: dict[str, list[BlockHash]] = {}  # request id -> hashes of its full blocks
        self._num_cached: dict[str, int] = {}  # request id -> leading blocks already published
        self.prefix_cache_queries = 0  # tokens looked up, once per admission
        self.prefix_cache_hits = 0  # of which found in the cache

    # ----------------------------------------------------------------------------- hashing

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """The request's full-block hashes, extended incrementally to cover all known tokens
        (prompt and generated), so a finished conversation's blocks can be hit later."""
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        for i in range(len(hashes), request.num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, request_tokens(request, i * bs, (i + 1) * bs)))
        return hashes

    # ----------------------------------------------------------------------------- lookup

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest chain of cached full blocks matching the start of the request's tokens.

        Returns (block ids, number of tokens they hold). At least one token is always left to
        compute, so the step produces logits: the hit is capped at num_tokens - 1, rounded down
        to a block.
        """
        if not self.enable_prefix_caching:
            return [], 0
        assert request.request_id not in self._blocks, "prefix lookup is for requests holding no blocks"
        bs = self.block_size
        hashes = self._block_hashes(request)
        hit: list[int] = []
        for i in range(min(len(hashes), (request.num_tokens - 1) // bs)):
            block = self.pool.get_cached_block(hashes[i], request_tokens(request, i * bs, (i + 1) * bs))
            if block is None:
                break
            hit.append(block.block_id)
        return hit, len(hit) * bs

    # ----------------------------------------------------------------------------- allocation

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[int] = ()) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (and the hit blocks).

        Returns the request's whole block table, or None, changing nothing, when the pool lacks
        the blocks. Then publishes the blocks that this step fills.
        """
        rid, bs = request.request_id, self.block_size
        held = self._blocks.get(rid, [])
        hits = [self.pool.blocks[i] for i in new_computed_blocks]
        assert not hits or (not held and request.num_computed_tokens == 0), "hits only at admission"
        num_tokens_after = request.num_computed_tokens + len(hits) * bs + num_new_tokens
        num_needed = max(0, cdiv(num_tokens_after, bs) - len(held) - len(hits))
        # A hit on a free block pulls it out of the free queue: it is not available for new blocks.
        num_revived = sum(1 for b in hits if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_revived:
            return None
        if rid not in self._blocks:
            self._admit(rid, len(hits), request.num_tokens)
            self._blocks[rid] = held
        self.pool.touch(hits)
        held.extend(hits)
        held.extend(self.pool.get_new_blocks(num_needed))
        self._cache_full_blocks(request, held, num_tokens_after)
        return [b.block_id for b in held]

    def _admit(self, request_id: str, num_hit_blocks: int, num_tokens: int) -> None:
        # Statistics are counted here, once per admission, rather than per lookup: a request
        # retried every step while the pool is full would otherwise be counted many times.
        self._num_cached[request_id] = num_hit_blocks
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_blocks * self.block_size

    def _cache_full_blocks(self, request: Request, held: list[KVBlock], num_tokens_after: int) -> None:
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
            self.pool.cache_full_block(held[i], hashes[i], request_tokens(request, i * bs, (i + 1) * bs))
        self._num_cached[rid] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks (preemption or finish). Tail blocks are freed first so
        that eviction takes a prefix's tail before its head, which later requests share."""
        rid = request.request_id
        self.pool.free_blocks(reversed(self._blocks.pop(rid, [])))
        self._hashes.pop(rid, None)
        self._num_cached.pop(rid, None)

    # ----------------------------------------------------------------------------- queries

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, [])]

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
        for rid, blocks in self._blocks.items():
            ids = [b.block_id for b in blocks]
            assert len(set(ids)) == len(ids), f"request {rid} holds a block twice: {ids}"
            for i in ids:
                holders[i] += 1
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
