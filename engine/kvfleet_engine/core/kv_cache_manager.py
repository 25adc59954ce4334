"""Maps requests to KV-cache blocks: prefix-cache lookup, slot allocation and freeing.

The manager only does bookkeeping; the tensors live in the worker. Invariants:
- ``req_to_blocks[r]`` covers tokens ``[0, num_computed_tokens + scheduled)`` of request r, block i
  holding tokens ``[i*block_size, (i+1)*block_size)``;
- a prefix hit never covers a request's last known token: the model must run at least one token
  to produce logits (so at most ``(num_tokens - 1) // block_size`` blocks can be hit);
- only full blocks are ever registered in the prefix cache, under the request's chained hashes;
- a request still missing prompt logprobs gets no hit: its prompt positions must run through the model
  (a cached block holds KV, not the hidden states to score). Its own blocks are cached for others.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet_engine.core.block_pool import BlockPool, KVCacheBlock, KVEventSink
from kvfleet_engine.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters since start (or the last reset), in tokens, for hit-rate metrics."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens served from the cache
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        on_event: KVEventSink | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, on_event)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of leading blocks already cached, and how many tokens that covers."""
        if not self.enable_caching or request.needs_prompt_hidden_states:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    def keep_warm(self, request: Request) -> int:
        """On arrival: protect the cached prefix the request will hit from eviction while it waits
        (``BlockPool.keep_warm``); returns the blocks found."""
        hit, _ = self.get_computed_blocks(request)
        if hit:
            self.block_pool.keep_warm(hit)
        return len(hit)

    def record_hit(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Count a request's first admission in the hit-rate stats (not its retries or recomputes)."""
        self.stats.requests += 1
        self.stats.queries += num_prompt_tokens
        self.stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed (and newly hit) ones.

        Returns the newly allocated blocks, or None (changing nothing) when there are not enough
        free blocks: the scheduler then preempts or stops admitting.

        Called for every running request every step: the usual decode, whose token fits in the
        blocks the request holds and fills no block that still has to be registered in the prefix
        cache, returns at once.
        """
        num_total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        req_blocks = self.req_to_blocks.get(request.request_id)
        if (
            req_blocks is not None
            and not new_computed_blocks
            and num_total <= len(req_blocks) * self.block_size
            and (
                not self.enable_caching
                or num_total // self.block_size <= self.num_cached_blocks.get(request.request_id, 0)
            )
        ):
            return []
        new_computed_blocks = new_computed_blocks or []
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = []
        num_required = -(-num_total // self.block_size)
        num_new_blocks = num_required - len(req_blocks) - len(new_computed_blocks)
        # Hit blocks nobody holds are in the free queue: touching them takes them out of it.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_revived > self.block_pool.get_num_free_blocks():
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None

        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            # Blocks that will be full once this step runs can be shared from now on (within the
            # same forward pass, a layer writes every token's KV before any attention reads it).
            num_full = min(num_total // self.block_size, len(request.block_hashes))
            start = self.num_cached_blocks.get(request.request_id, 0)
            if num_full > start:
                self.block_pool.cache_full_blocks(
                    req_blocks[start:num_full], request.block_hashes[start:num_full]
                )
                self.num_cached_blocks[request.request_id] = num_full
        return new_blocks

    def free(self, request: Request) -> None:
        """Release a finished, aborted or preempted request's blocks (tail first, see BlockPool)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        num_cached = self.num_cached_blocks.pop(request.request_id, 0)
        # Blocks are registered when scheduled, before the step runs. A request preempted in the very
        # step that scheduled it (priority policy) never runs it: the blocks past its computed tokens
        # hold no KV, so they must leave the cache or a later prefix hit would read garbage.
        self.block_pool.uncache_blocks(blocks[request.num_computed_tokens // self.block_size : num_cached])
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        ok = self.block_pool.reset_prefix_cache()
        if ok:
            self.stats = PrefixCacheStats()
        return ok
