"""Physical KV-cache blocks: ref counts, O(1) free queues and the prefix-cache hash map.

Invariants (checked by the property tests):
- a block is in exactly one free queue  <=>  its ``ref_cnt`` is 0 (block 0, the null block, is never
  in one);
- a block with a ``block_hash`` is in ``cached_blocks`` under that hash until it is evicted, i.e.
  re-handed out by ``get_new_blocks`` (lazy eviction: freeing a block keeps its contents reusable);
- freed blocks go to the *tail* of their queue in eviction order, allocation pops from a *head*.

Eviction is a segmented LRU. Freed blocks that a prefix-cache hit found since they were filled go to
the *protected* queue, all others to *probation*; allocation takes probation's least recently used
block first and touches protected blocks only when probation is empty. Why: in a serving fleet most
freed blocks are a request's own question and answer, never read again, while a shared system prompt
is read by every request of its group. Under plain LRU every finished request's private blocks push
the shared prompts towards eviction, so a prompt whose group paused for a few requests was recomputed:
with five 2,000-token prompts in a 12,288-token cache, LRU found 91.8 % of the prompt tokens and this
policy 99.8 % (``bench/kv_eviction.py``, docs/BENCHMARKS.md). The protected queue is capped at ``PROTECTED_FRACTION`` of
the cache, its least recently used block demoted to probation's tail, so prompts that were hot once
cannot fill the cache for ever and a new prompt still gets the room to be found a second time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvfleet_common.hashing import BlockHash

# Most of the free blocks the protected queue may hold (see the module docstring).
PROTECTED_FRACTION = 0.8


class KVCacheBlock:
    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "protected", "ref_cnt", "reused")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # A prefix-cache hit found the block since it was last filled: it goes to the protected queue.
        self.reused = False
        self.protected = False  # which free queue holds it (meaningless while ref_cnt > 0)
        # Intrusive doubly linked list: O(1) removal from the middle of the free queue.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinel head and tail."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self):
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free


# KV events, in the order they happened: ("stored", hash), ("removed", hash) or ("cleared", None).
# The engine server turns them into the Redis KV index the gateway's router reads; None offline.
KVEvent = tuple[str, BlockHash | None]
KVEventSink = Callable[[list[KVEvent]], None]


class BlockPool:
    """Owns every ``KVCacheBlock``. Block 0 is reserved as the null block (padding in block tables)."""

    def __init__(self, num_blocks: int, enable_caching: bool, on_event: KVEventSink | None = None):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # never freed, never handed out
        self.probation = FreeBlockQueue(self.blocks[1:])
        self.protected = FreeBlockQueue(())
        self.max_protected = int(PROTECTED_FRACTION * self.num_usable_blocks)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        self.on_event = on_event
        self._events: list[KVEvent] = []

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.probation.num_free + self.protected.num_free

    def free_blocks_in_eviction_order(self):
        """Every free block, the next one ``get_new_blocks`` would hand out first."""
        yield from self.probation
        yield from self.protected

    def usage(self) -> float:
        """Fraction of usable blocks held by running requests (cached-but-free blocks count as free)."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        free = self.get_num_free_blocks()
        if n > free:
            raise ValueError(f"cannot allocate {n} blocks, only {free} free")
        out = []
        for _ in range(n):
            block = (self.probation if self.probation.num_free else self.protected).popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found by a prefix-cache hit (reviving them if they were free)."""
        for block in blocks:
            if block.ref_cnt == 0:
                (self.protected if block.protected else self.probation).remove(block)
            block.ref_cnt += 1
            block.reused = True

    def keep_warm(self, blocks: list[KVCacheBlock]) -> None:
        """Blocks a queued request will hit when it is scheduled: count them as reused and move the free
        ones to the protected queue's most recent end (the prefix's first block last, so it goes last).

        No reference is taken (a queued request holds no memory); only the eviction order changes, so
        a prompt found at arrival is not evicted by other requests' churn while this one waits."""
        for block in reversed(blocks):
            block.reused = True
            if block.ref_cnt == 0:
                (self.protected if block.protected else self.probation).remove(block)
                self._enqueue(block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue tail in this order.

        Callers pass a request's blocks in *reverse*: the tail of a prompt is the least likely to be
        shared, so it should be evicted first.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._enqueue(block)

    def _enqueue(self, block: KVCacheBlock) -> None:
        if not (block.reused and block.block_hash is not None):
            block.protected = False
            self.probation.append(block)
            return
        block.protected = True
        self.protected.append(block)
        if self.protected.num_free > self.max_protected:
            demoted = self.protected.popleft()
            demoted.protected = demoted.reused = False
            self.probation.append(demoted)

    def cache_full_blocks(self, blocks: list[KVCacheBlock], hashes: list[BlockHash]) -> None:
        """Register full blocks under their chained hashes so later requests can share them."""
        if not self.enable_caching:
            return
        for block, h in zip(blocks, hashes, strict=True):
            if block.block_hash is not None:
                continue  # already cached (a prefix hit, or cached in an earlier step)
            if h in self.cached_blocks:
                # Same content computed twice concurrently: keep the first copy as the canonical one;
                # this block stays private to its request and is recycled when freed.
                continue
            block.block_hash = h
            self.cached_blocks[h] = block
            if self.on_event is not None:
                self._events.append(("stored", h))

    def _evict(self, block: KVCacheBlock) -> None:
        block.reused = False
        h = block.block_hash
        if h is None:
            return
        block.block_hash = None
        if self.cached_blocks.get(h) is block:
            del self.cached_blocks[h]
            if self.on_event is not None:
                self._events.append(("removed", h))

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop blocks from the prefix cache at once (their KV was never written, see KVCacheManager.free)."""
        for block in blocks:
            self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only possible when no request holds blocks (like vLLM)."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for block in list(self.protected):
            self.protected.remove(block)
            self.probation.append(block)
        for block in self.blocks[1:]:
            block.block_hash = None
            block.reused = block.protected = False
        self.cached_blocks.clear()
        if self.on_event is not None:
            self._events = [("cleared", None)]
            self.flush_events()
        return True

    def flush_events(self) -> None:
        """Hand the events gathered since the last flush to the sink (once per engine step)."""
        if self.on_event is not None and self._events:
            events, self._events = self._events, []
            self.on_event(events)
