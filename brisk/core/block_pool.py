"""The pool of KV cache blocks: reference counts, the free queue and the prefix-cache map.

Pure bookkeeping: a block is an integer id naming a `[block_size]` slot range in the runner's
KV tensors. The pool never sees tokens' KV, only who holds which block and what content a
cached block holds.

Free queue (eviction order, front is evicted first):

    front                                                           end
    [ never-cached / emptied blocks | cached blocks, least recently freed ... most recently ]
        popped by get_new_blocks ──►                    ◄── free_blocks appends cached ones

A freed block keeps its cached hash while it sits in the queue, so a later request can revive it
with `touch` (a prefix hit); only `get_new_blocks` evicts, one popped block at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from brisk.errors import UserError

BlockHash = bytes  # SHA-256 digest of (parent hash, token ids); see kv_cache_manager.hash_block


@dataclass(eq=False, slots=True)
class KVBlock:
    """One KV block. `block_hash`/`token_ids` are set only while the block is in the prefix cache.

    The token ids are stored with the hash so that a hit is verified by comparing tokens, not
    trusted on the hash alone.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None


class BlockPool:
    """All KV blocks of one cache, with O(1) allocate, free, touch and evict.

    Invariants (checked by `KVCacheManager.check_invariants`): a block is in the free queue iff
    its ref_cnt is 0; every entry of the cache map points at a block carrying that hash.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise UserError(f"a KV cache needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        # OrderedDict keyed by block id: O(1) pop from the front, append, and removal from the
        # middle (a prefix hit on a free block pulls it out of the queue).
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}

    # ----------------------------------------------------------------------------- allocation

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take `n` blocks from the front of the free queue, evicting their cached content.

        The caller checks `num_free_blocks` first: running out here is a bug, not a capacity event.
        """
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks but only {len(self._free)} are free")
        out: list[KVBlock] = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take another reference on blocks found in the prefix cache (reviving free ones)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each, in the given order (the caller passes eviction priority).

        A block reaching ref_cnt 0 joins the free queue. A cached one goes to the END, keeping its
        hash so a later hit can revive it until it is evicted (LRU). One that holds no cached
        content goes to the FRONT: it is worth nothing, so it is reused before any cached block.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if not block.is_cached:
                    self._free.move_to_end(block.block_id, last=False)

    # ----------------------------------------------------------------------------- prefix cache

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Publish a full block's content. A no-op when caching is off, when the block is already
        cached, or when another block already holds this content (the first one stays published;
        the duplicate simply remains private to its request)."""
        if not self.enable_caching or block.is_cached or block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        """The cached block with this hash, if its stored tokens are exactly `token_ids`."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def uncache(self, block_ids: Iterable[int]) -> None:
        """Withdraw these blocks' published content (their KV may never have been written: a
        step that failed after scheduling). Free ones move to the front: they hold nothing now."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            self._evict(block)
            if block.ref_cnt == 0:
                self._free.move_to_end(block_id, last=False)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None

    # ----------------------------------------------------------------------------- queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by at least one request (cached free blocks count as free)."""
        return (self.num_blocks - len(self._free)) / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """The free queue front to back: the order in which blocks will be handed out."""
        return list(self._free)

    def cached_items(self) -> list[tuple[BlockHash, KVBlock]]:
        return list(self._cached.items())
