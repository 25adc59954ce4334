"""KV-cache bookkeeping: the free queue, the block pool, prefix caching and a state-machine property test.

Pure Python (no model, no tensors): the KV content of a block is modelled by a shadow table of the
token ids written into its slots, so a prefix hit on a block holding the wrong tokens is caught.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfleet_engine.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from kvfleet_engine.core.kv_cache_manager import KVCacheManager
from kvfleet_engine.core.messages import EngineCoreRequest
from kvfleet_engine.request import Request
from kvfleet_engine.sampling_params import SamplingParams

BS = 4


def make_req(rid: str, tokens: list[int], block_size: int = BS, cache_salt: str | None = None) -> Request:
    core_request = EngineCoreRequest(
        rid,
        list(tokens),
        SamplingParams(max_tokens=64),
        max_tokens=64,
        stop_token_ids=frozenset({2}),
        arrival_time=0.0,
        cache_salt=cache_salt,
    )
    return Request(core_request, block_size=block_size)


def admit(kv: KVCacheManager, req: Request) -> int:
    """What the scheduler does for a waiting request with room: hit lookup, allocate, run the prompt."""
    hit, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hit, num_hit) is not None
    req.num_computed_tokens = req.num_tokens
    return num_hit


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_blocks_in_eviction_order()]


def pool_state(kv: KVCacheManager):
    pool = kv.block_pool
    return (
        free_ids(pool),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        dict(pool.cached_blocks),
        {rid: list(blocks) for rid, blocks in kv.req_to_blocks.items()},
        dict(kv.num_cached_blocks),
        list(pool._events),
    )


# ---- FreeBlockQueue ------------------------------------------------------------------------------


def test_free_queue_remove_and_append_keep_order():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeBlockQueue(blocks[1:])
    assert [b.block_id for b in q] == [1, 2, 3, 4, 5]
    assert q.num_free == 5

    q.remove(blocks[3])  # from the middle
    q.remove(blocks[1])  # the head
    q.remove(blocks[5])  # the tail
    assert [b.block_id for b in q] == [2, 4]
    assert q.num_free == 2

    q.append(blocks[5])
    q.append(blocks[1])
    q.append(blocks[3])
    assert [b.block_id for b in q] == [2, 4, 5, 1, 3]
    assert [q.popleft().block_id for _ in range(5)] == [2, 4, 5, 1, 3]
    assert q.num_free == 0
    with pytest.raises(ValueError):
        q.popleft()


def test_free_queue_rejects_double_insert_and_missing_remove():
    blocks = [KVCacheBlock(i) for i in range(3)]
    q = FreeBlockQueue(blocks)
    with pytest.raises(RuntimeError):
        q.append(blocks[1])
    q.remove(blocks[1])
    with pytest.raises(RuntimeError):
        q.remove(blocks[1])
    assert q.num_free == 2
    assert [b.block_id for b in q] == [0, 2]


# ---- BlockPool -----------------------------------------------------------------------------------


def test_pool_allocates_lru_first_and_frees_in_given_order():
    pool = BlockPool(6, enable_caching=True)
    assert free_ids(pool) == [1, 2, 3, 4, 5]
    a = pool.get_new_blocks(2)
    assert [b.block_id for b in a] == [1, 2]
    assert all(b.ref_cnt == 1 for b in a)
    pool.free_blocks([a[1], a[0]])
    assert free_ids(pool) == [3, 4, 5, 2, 1]
    assert [b.block_id for b in pool.get_new_blocks(5)] == [3, 4, 5, 2, 1]
    assert pool.get_num_free_blocks() == 0


def test_pool_double_free_raises():
    pool = BlockPool(4, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([b])
    with pytest.raises(RuntimeError):
        pool.free_blocks([pool.blocks[2]])  # never allocated


def test_null_block_is_never_handed_out():
    with pytest.raises(ValueError):
        BlockPool(1, enable_caching=True)
    pool = BlockPool(5, enable_caching=True)
    assert pool.num_usable_blocks == 4
    blocks = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    assert 0 not in free_ids(pool)
    assert pool.null_block.ref_cnt == 1


def test_usage_counts_held_blocks_only():
    kv = KVCacheManager(5, BS)
    assert kv.usage == 0.0
    req = make_req("a", list(range(10, 18)))  # 2 full blocks
    admit(kv, req)
    assert kv.usage == pytest.approx(0.5)
    kv.free(req)
    # Its blocks stay in the prefix cache but are free: they do not count as used.
    assert len(kv.block_pool.cached_blocks) == 2
    assert kv.usage == 0.0


# ---- prefix caching ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_len", "expected_hit_blocks"),
    [(2 * BS, 1), (2 * BS + 1, 2), (BS, 0), (BS + 1, 1), (3 * BS - 1, 2)],
)
def test_prefix_hit_never_covers_the_last_token(prompt_len, expected_hit_blocks):
    kv = KVCacheManager(16, BS)
    tokens = list(range(100, 100 + prompt_len))
    first = make_req("a", tokens + [1] * BS)  # caches every block of `tokens`
    admit(kv, first)
    second = make_req("b", tokens)
    hit, num_hit = kv.get_computed_blocks(second)
    assert len(hit) == expected_hit_blocks
    assert num_hit == expected_hit_blocks * BS
    assert num_hit < second.num_tokens
    assert hit == kv.req_to_blocks["a"][:expected_hit_blocks]


def test_prefix_hits_chain_through_earlier_blocks():
    kv = KVCacheManager(16, BS)
    base = list(range(10, 10 + 3 * BS))
    admit(kv, make_req("a", [*base, 1]))
    same = make_req("b", [*base, 1])
    assert kv.get_computed_blocks(same)[1] == 3 * BS
    # Changing one token of block 0 changes the hash of every later block too, even though
    # blocks 1 and 2 hold the same tokens.
    changed = [99, *base[1:], 1]
    assert kv.get_computed_blocks(make_req("c", changed))[1] == 0
    # A change in block 1 keeps block 0 only.
    changed = [*base[:BS], 99, *base[BS + 1 :], 1]
    assert kv.get_computed_blocks(make_req("d", changed))[1] == BS


def test_cache_salt_separates_tenants():
    kv = KVCacheManager(16, BS)
    tokens = list(range(20, 20 + 2 * BS + 1))
    admit(kv, make_req("a", tokens, cache_salt="tenant-a"))
    assert kv.get_computed_blocks(make_req("b", tokens, cache_salt="tenant-b"))[1] == 0
    assert kv.get_computed_blocks(make_req("c", tokens))[1] == 0  # unsalted: the shared cache
    assert kv.get_computed_blocks(make_req("d", tokens, cache_salt="tenant-a"))[1] == 2 * BS


def test_disabled_caching_never_hits_or_registers():
    kv = KVCacheManager(16, BS, enable_caching=False)
    tokens = list(range(2 * BS + 1))
    admit(kv, make_req("a", tokens))
    assert kv.block_pool.cached_blocks == {}
    assert kv.get_computed_blocks(make_req("b", tokens)) == ([], 0)


def test_shared_hit_blocks_are_ref_counted():
    kv = KVCacheManager(16, BS)
    tokens = list(range(30, 30 + 2 * BS + 1))
    a, b = make_req("a", tokens), make_req("b", tokens)
    admit(kv, a)
    assert admit(kv, b) == 2 * BS
    shared = kv.req_to_blocks["a"][:2]
    assert kv.req_to_blocks["b"][:2] == shared
    assert [blk.ref_cnt for blk in shared] == [2, 2]
    assert kv.req_to_blocks["a"][2] is not kv.req_to_blocks["b"][2]  # the partial block is private
    kv.free(a)
    assert [blk.ref_cnt for blk in shared] == [1, 1]
    kv.free(b)
    assert kv.get_num_free_blocks() == 15


def test_lazy_eviction_keeps_freed_blocks_hittable_until_reused():
    kv = KVCacheManager(5, BS)  # 4 usable blocks
    pool = kv.block_pool
    tokens = list(range(40, 40 + 2 * BS + 1))  # 2 full blocks + 1 partial
    a = make_req("a", tokens)
    admit(kv, a)
    b0, b1, b2 = kv.req_to_blocks["a"]
    kv.free(a)
    # Freed tail first: the partial block, then block 1, then block 0 (the most shareable) last.
    assert free_ids(pool) == [4, b2.block_id, b1.block_id, b0.block_id]
    assert b0.block_hash == a.block_hashes[0] and b1.block_hash == a.block_hashes[1]

    probe = make_req("probe", tokens)
    assert kv.get_computed_blocks(probe) == ([b0, b1], 2 * BS)

    # Two blocks for someone else: block 4 and the old partial block; the cached ones survive.
    other = make_req("other", list(range(500, 500 + 2 * BS)))
    admit(kv, other)
    assert kv.get_computed_blocks(probe) == ([b0, b1], 2 * BS)

    # One more block reuses block 1: its hash is gone, and so is the hit on it.
    other.append_output_token(1)
    kv.allocate_slots(other, 1)
    other.num_computed_tokens += 1
    assert kv.req_to_blocks["other"][-1] is b1
    assert b1.block_hash is None
    assert a.block_hashes[1] not in pool.cached_blocks
    assert kv.get_computed_blocks(probe) == ([b0], BS)


def _cached_blocks(pool: BlockPool, n: int, salt: int) -> list[KVCacheBlock]:
    blocks = pool.get_new_blocks(n)
    pool.cache_full_blocks(blocks, [bytes([salt, i]) * 16 for i in range(n)])
    return blocks


def test_a_reused_prefix_outlives_private_blocks_freed_after_it():
    """Segmented LRU: blocks a prefix hit found are evicted only after every never-reused free block."""
    pool = BlockPool(11, enable_caching=True)  # 10 usable, up to 8 protected
    prefix = _cached_blocks(pool, 3, salt=1)
    pool.touch(prefix)  # a second request hit the prefix
    pool.free_blocks(reversed(prefix))
    pool.free_blocks(reversed(prefix))
    assert all(b.ref_cnt == 0 and b.protected for b in prefix)
    private = _cached_blocks(pool, 7, salt=2)  # cached but never hit: a request's own question/answer
    pool.free_blocks(reversed(private))
    # Plain LRU would hand out the prefix first (freed first); here it goes last, its tail first.
    assert free_ids(pool) == [b.block_id for b in [*reversed(private), *reversed(prefix)]]
    again = pool.get_new_blocks(7)
    assert {b.block_id for b in again} == {b.block_id for b in private}
    assert all(pool.get_cached_block(bytes([1, i]) * 16) is prefix[i] for i in range(3))
    assert pool.get_new_blocks(1) == [prefix[2]]
    assert pool.get_cached_block(bytes([1, 2]) * 16) is None and not prefix[2].reused


def test_protected_blocks_are_capped_and_the_oldest_is_demoted():
    pool = BlockPool(6, enable_caching=True)  # 5 usable, at most 4 protected
    assert pool.max_protected == 4
    blocks = _cached_blocks(pool, 5, salt=3)
    pool.touch(blocks)
    pool.free_blocks(blocks)  # still held once
    pool.free_blocks(blocks)  # freed in order 1..5: protected, the 5th pushes block 1 out
    assert pool.protected.num_free == 4 and pool.probation.num_free == 1
    assert [b.block_id for b in pool.probation] == [blocks[0].block_id]
    assert not blocks[0].reused and not blocks[0].protected
    assert pool.get_cached_block(bytes([3, 0]) * 16) is blocks[0]  # demoted, not evicted
    assert free_ids(pool) == [b.block_id for b in blocks]
    # A hit on the demoted block promotes it again when it is next freed.
    pool.touch([blocks[0]])
    pool.free_blocks([blocks[0]])
    assert blocks[0].protected and pool.probation.num_free == 1  # block 2 was demoted in its place
    assert [b.block_id for b in pool.probation] == [blocks[1].block_id]


def test_blocks_never_hit_or_never_cached_stay_on_probation():
    pool = BlockPool(5, enable_caching=True)
    cached = _cached_blocks(pool, 2, salt=4)
    plain = pool.get_new_blocks(2)
    pool.free_blocks([*cached, *plain])
    assert pool.protected.num_free == 0
    assert free_ids(pool) == [b.block_id for b in [*cached, *plain]]


@pytest.mark.parametrize("warm", [False, True])
def test_a_queued_requests_prefix_is_kept_warm_while_it_waits(warm):
    kv = KVCacheManager(12, BS)  # 11 usable blocks
    prefix = list(range(100, 100 + 3 * BS))
    first = make_req("first", [*prefix, 1])
    admit(kv, first)
    kv.free(first)  # the prefix is cached, never reused: on probation, freed before what follows
    queued = make_req("queued", [*prefix, 2])  # arrives, waits behind other work
    if warm:
        assert kv.keep_warm(queued) == 3
    for i in range(2):  # other requests' private blocks churn through the rest of the cache twice
        churn = [make_req(f"churn{i}{j}", list(range(1000 * (i + 1) + 100 * j, 1000 * (i + 1) + 100 * j + 4 * BS)))
                 for j in range(2)]  # fmt: skip
        for r in churn:
            admit(kv, r)
        for r in churn:
            kv.free(r)
    _, num_hit = kv.get_computed_blocks(queued)
    assert num_hit == (3 * BS if warm else 0)
    assert kv.get_num_free_blocks() == 11  # warming took no references


def test_reset_prefix_cache_only_when_nothing_is_held():
    kv = KVCacheManager(8, BS)
    tokens = list(range(2 * BS + 1))
    a = make_req("a", tokens)
    admit(kv, a)
    kv.record_hit(a.num_tokens, 0)
    assert not kv.reset_prefix_cache()
    assert len(kv.block_pool.cached_blocks) == 2
    assert kv.stats.requests == 1
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.block_pool.cached_blocks == {}
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    assert kv.get_computed_blocks(make_req("b", tokens)) == ([], 0)
    assert kv.stats.requests == 0 and kv.stats.queries == 0
    assert kv.get_num_free_blocks() == 7


def test_record_hit_stats():
    kv = KVCacheManager(8, BS)
    assert kv.stats.hit_rate == 0.0
    kv.record_hit(10, 0)
    kv.record_hit(10, 8)
    kv.record_hit(20, 4)
    assert (kv.stats.requests, kv.stats.queries, kv.stats.hits) == (3, 40, 12)
    assert kv.stats.hit_rate == pytest.approx(0.3)


# ---- KV events -----------------------------------------------------------------------------------


class EventReplay:
    """The consumer side: rebuilds the set of cached hashes from the event stream."""

    def __init__(self) -> None:
        self.batches: list[list[tuple]] = []
        self.hashes: set[bytes] = set()

    def __call__(self, events):
        self.batches.append(list(events))
        for kind, h in events:
            if kind == "stored":
                assert h not in self.hashes
                self.hashes.add(h)
            elif kind == "removed":
                assert h in self.hashes
                self.hashes.remove(h)
            else:
                assert kind == "cleared" and h is None
                self.hashes.clear()


def test_kv_events_arrive_in_order_and_match_the_pool():
    sink = EventReplay()
    kv = KVCacheManager(5, BS, on_event=sink)  # 4 usable blocks
    pool = kv.block_pool

    def flush_and_check():
        pool.flush_events()
        assert sink.hashes == set(pool.cached_blocks)

    a = make_req("a", list(range(60, 60 + 2 * BS + 1)))
    admit(kv, a)
    assert sink.batches == []  # nothing is sent before the step's flush
    flush_and_check()
    assert sink.batches == [[("stored", a.block_hashes[0]), ("stored", a.block_hashes[1])]]

    pool.flush_events()  # nothing new: no empty batch
    assert len(sink.batches) == 1

    kv.free(a)
    b = make_req("b", list(range(80, 80 + 4 * BS)))  # takes every block: evicts both of a's
    admit(kv, b)
    flush_and_check()
    # Blocks are evicted in queue order (a's block 1 before block 0), then b's are stored.
    assert sink.batches[1] == [
        ("removed", a.block_hashes[1]),
        ("removed", a.block_hashes[0]),
        *[("stored", h) for h in b.block_hashes],
    ]

    kv.free(b)
    assert kv.reset_prefix_cache()
    assert sink.batches[2] == [("cleared", None)]  # sent at once
    flush_and_check()
    assert sink.hashes == set()


def test_duplicate_content_is_cached_once():
    sink = EventReplay()
    kv = KVCacheManager(16, BS, on_event=sink)
    tokens = list(range(2 * BS + 1))
    a, b = make_req("a", tokens), make_req("b", tokens)
    # Both allocated before either is cached by a lookup (computed in the same step, no hit).
    assert kv.allocate_slots(a, a.num_tokens) is not None
    assert kv.allocate_slots(b, b.num_tokens) is not None
    kv.block_pool.flush_events()
    assert [kind for batch in sink.batches for kind, _ in batch] == ["stored", "stored"]
    assert all(blk.block_hash is None for blk in kv.req_to_blocks["b"])  # private copies
    assert sink.hashes == set(kv.block_pool.cached_blocks)


# ---- allocation failure ------------------------------------------------------------------------


def test_allocate_slots_failure_changes_nothing():
    kv = KVCacheManager(5, BS)  # 4 usable blocks
    a = make_req("a", list(range(3 * BS)))
    admit(kv, a)
    before = pool_state(kv)
    big = make_req("big", list(range(100, 100 + 2 * BS)))
    hit, num_hit = kv.get_computed_blocks(big)
    assert kv.allocate_slots(big, big.num_tokens - num_hit, hit, num_hit) is None
    assert "big" not in kv.req_to_blocks
    assert pool_state(kv) == before

    # A running request that cannot grow keeps what it has.
    a.append_output_token(7)
    assert kv.allocate_slots(a, 1) is not None  # fits in the 4th block
    a.num_computed_tokens += 1
    for t in range(BS):
        a.append_output_token(t)
    before = pool_state(kv)
    assert kv.allocate_slots(a, BS) is None
    assert pool_state(kv) == before


def test_allocate_slots_counts_revived_hit_blocks_against_free_ones():
    kv = KVCacheManager(6, BS)  # 5 usable blocks
    prefix = list(range(10, 10 + 2 * BS))
    a = make_req("a", [*prefix, 1])
    admit(kv, a)
    kv.free(a)
    assert kv.get_num_free_blocks() == 5

    # 2 hit blocks (free, ref 0) + 4 new ones = 6 > 5: must fail, although 4 new ones alone fit.
    b = make_req("b", [*prefix, *range(50, 50 + 3 * BS + 1)])
    hit, num_hit = kv.get_computed_blocks(b)
    assert (len(hit), num_hit) == (2, 2 * BS)
    assert all(blk.ref_cnt == 0 for blk in hit)
    before = pool_state(kv)
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hit, num_hit) is None
    assert pool_state(kv) == before

    # 2 hit blocks + 3 new ones = 5: fits exactly.
    c = make_req("c", [*prefix, *range(50, 50 + 2 * BS + 1)])
    hit, num_hit = kv.get_computed_blocks(c)
    new = kv.allocate_slots(c, c.num_tokens - num_hit, hit, num_hit)
    assert new is not None and len(new) == 3
    assert kv.req_to_blocks["c"][:2] == hit
    assert kv.get_num_free_blocks() == 0


def test_preempted_before_running_does_not_leave_unwritten_blocks_cached():
    """Blocks are registered when scheduled; if the request is freed before the step runs
    (num_computed_tokens not advanced), those blocks hold no KV and must not be hit later."""
    sink = EventReplay()
    kv = KVCacheManager(8, BS, on_event=sink)
    a = make_req("a", list(range(2 * BS + 1)))
    kv.allocate_slots(a, BS + 2)  # schedules tokens [0, 6): block 0 becomes full and is registered
    assert a.block_hashes[0] in kv.block_pool.cached_blocks
    kv.free(a)  # preempted in the same step: nothing ran
    assert kv.block_pool.cached_blocks == {}
    assert kv.get_computed_blocks(make_req("b", a.prompt_token_ids)) == ([], 0)
    kv.block_pool.flush_events()
    assert sink.hashes == set()


# ---- state machine -------------------------------------------------------------------------------

ALPHABET = st.integers(0, 2)
# A few fixed stems so that independent requests share prefixes (and therefore blocks).
STEMS = [[0, 1, 0, 1, 2, 2, 0, 1, 1, 0, 2, 1], [0, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1], [2, 2, 2, 2, 1, 0, 1, 0]]


class KVCacheMachine(RuleBasedStateMachine):
    """Random admissions, decodes, preemptions, frees and resets against a small pool.

    A shadow ``kv`` table records which token was written into each block slot (what the model
    would compute), so a prefix hit must always land on blocks holding exactly the request's tokens.
    """

    def __init__(self) -> None:
        super().__init__()
        self.kv: KVCacheManager | None = None

    @initialize(num_blocks=st.integers(8, 24))
    def setup(self, num_blocks):
        self.sink = EventReplay()
        self.kv = KVCacheManager(num_blocks, BS, on_event=self.sink)
        self.initial_free = self.kv.get_num_free_blocks()
        self.shadow: dict[int, list[int | None]] = {i: [None] * BS for i in range(num_blocks)}
        self.running: dict[str, Request] = {}
        self.preempted: dict[str, Request] = {}
        self.next_id = 0
        self.hash_tokens: dict[bytes, list[int]] = {}  # every block hash ever seen -> its tokens

    # -- helpers --

    def _remember_hashes(self, req: Request) -> None:
        for i, h in enumerate(req.block_hashes):
            self.hash_tokens[h] = req.all_token_ids[i * BS : (i + 1) * BS]

    def _run(self, req: Request, hit_tokens: int, num_new: int, hit=(), allow_fail=True) -> bool:
        """Allocate like the scheduler, then 'run the model': write the scheduled tokens' KV."""
        self._remember_hashes(req)
        before = pool_state(self.kv)
        new = self.kv.allocate_slots(req, num_new, list(hit), hit_tokens)
        if new is None:
            event("allocation refused")
            assert allow_fail
            assert pool_state(self.kv) == before
            return False
        blocks = self.kv.req_to_blocks[req.request_id]
        assert blocks[: len(hit)] == list(hit)
        start = req.num_computed_tokens + hit_tokens
        for pos in range(start, start + num_new):
            self.shadow[blocks[pos // BS].block_id][pos % BS] = req.all_token_ids[pos]
        req.num_computed_tokens = start + num_new
        return True

    def _admit(self, req: Request) -> bool:
        hit, num_hit = self.kv.get_computed_blocks(req)
        assert num_hit == len(hit) * BS
        assert len(hit) <= (req.num_tokens - 1) // BS
        assert [b.block_hash for b in hit] == req.block_hashes[: len(hit)]
        if hit:
            event("prefix hit" + (" on a free block" if any(b.ref_cnt == 0 for b in hit) else ""))
        return self._run(req, num_hit, req.num_tokens - num_hit, hit)

    def _pick(self, pool: dict[str, Request], index: int) -> Request:
        return pool[sorted(pool)[index % len(pool)]]

    # -- rules --

    @rule(
        stem=st.integers(0, len(STEMS) - 1),
        stem_len=st.integers(0, 12),
        suffix=st.lists(ALPHABET, max_size=10),
        salt=st.sampled_from([None, None, "t1"]),
    )
    def add_request(self, stem, stem_len, suffix, salt):
        tokens = STEMS[stem][:stem_len] + suffix
        if not tokens:
            tokens = [0]
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = make_req(rid, tokens, cache_salt=salt)
        if self._admit(req):
            self.running[rid] = req
        self.kv.block_pool.flush_events()

    @rule(
        stem=st.integers(0, len(STEMS) - 1),
        stem_len=st.integers(1, 12),
        suffix=st.lists(ALPHABET, max_size=3),
    )
    def keep_warm(self, stem, stem_len, suffix):
        """A request arrives and waits: its cached prefix moves in the eviction order, nothing else."""
        req = make_req(f"q{self.next_id}", STEMS[stem][:stem_len] + suffix)
        self.next_id += 1
        before = self.kv.get_num_free_blocks()
        found = self.kv.keep_warm(req)
        assert found == len(self.kv.get_computed_blocks(req)[0])
        assert self.kv.get_num_free_blocks() == before

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 1000), new_tokens=st.lists(ALPHABET, min_size=1, max_size=6))
    def extend(self, index, new_tokens):
        """Decode steps: sampled tokens are appended, then slots for them are allocated and run."""
        req = self._pick(self.running, index)
        for t in new_tokens:
            req.append_output_token(t)
        # If it does not fit the tokens stay pending (the scheduler would preempt or wait).
        self._run(req, 0, req.num_tokens - req.num_computed_tokens)
        self.kv.block_pool.flush_events()

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 1000))
    def finish(self, index):
        req = self._pick(self.running, index)
        self.kv.free(req)
        del self.running[req.request_id]
        self.kv.block_pool.flush_events()

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 1000))
    def preempt(self, index):
        req = self._pick(self.running, index)
        self.kv.free(req)
        req.num_computed_tokens = 0
        del self.running[req.request_id]
        self.preempted[req.request_id] = req
        self.kv.block_pool.flush_events()

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 1000), new_tokens=st.lists(ALPHABET, min_size=1, max_size=6))
    def preempt_after_scheduling(self, index, new_tokens):
        """Scheduled (slots allocated, full blocks registered) but preempted before the step ran."""
        req = self._pick(self.running, index)
        for t in new_tokens:
            req.append_output_token(t)
        self._remember_hashes(req)
        self.kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens)
        self.kv.free(req)
        req.num_computed_tokens = 0
        del self.running[req.request_id]
        self.preempted[req.request_id] = req
        self.kv.block_pool.flush_events()

    @precondition(lambda self: self.preempted)
    @rule(index=st.integers(0, 1000))
    def resume(self, index):
        req = self._pick(self.preempted, index)
        if self._admit(req):
            del self.preempted[req.request_id]
            self.running[req.request_id] = req
        self.kv.block_pool.flush_events()

    @precondition(lambda self: self.preempted)
    @rule(index=st.integers(0, 1000))
    def abort_preempted(self, index):
        req = self._pick(self.preempted, index)
        self.kv.free(req)  # holds nothing: a no-op
        del self.preempted[req.request_id]

    @rule()
    def reset_prefix_cache(self):
        ok = self.kv.reset_prefix_cache()
        assert ok == (not self.running)
        if ok:
            assert self.kv.block_pool.cached_blocks == {}
            assert all(b.block_hash is None for b in self.kv.block_pool.blocks)

    @rule()
    def free_everything(self):
        for req in list(self.running.values()):
            self.kv.free(req)
        self.running.clear()
        self.kv.block_pool.flush_events()
        assert self.kv.get_num_free_blocks() == self.initial_free
        assert self.kv.usage == 0.0

    # -- invariants --

    @invariant()
    def block_accounting(self):
        if self.kv is None:
            return
        pool = self.kv.block_pool
        usable = pool.blocks[1:]
        assert pool.null_block.ref_cnt == 1
        assert all(b.ref_cnt >= 0 for b in usable)
        # Segmented LRU: each free block sits in the queue its flag names, protected ones are reused
        # cached blocks, and the protected queue stays within its cap.
        assert pool.protected.num_free <= pool.max_protected
        assert all(b.protected and b.reused and b.block_hash is not None for b in pool.protected)
        assert not any(b.protected for b in pool.probation)

        queue = list(pool.free_blocks_in_eviction_order())
        queue_ids = [b.block_id for b in queue]
        assert len(queue_ids) == len(set(queue_ids)) == pool.get_num_free_blocks()
        assert 0 not in queue_ids
        assert set(queue_ids) == {b.block_id for b in usable if b.ref_cnt == 0}

        assert set(self.kv.req_to_blocks) == set(self.running)
        holders: dict[int, int] = {}
        for rid, blocks in self.kv.req_to_blocks.items():
            ids = [b.block_id for b in blocks]
            assert len(ids) == len(set(ids)), f"{rid} holds a block twice"
            assert 0 not in ids
            for i in ids:
                holders[i] = holders.get(i, 0) + 1
        assert len(queue_ids) + len(holders) == pool.num_usable_blocks
        for b in usable:
            assert b.ref_cnt == holders.get(b.block_id, 0)

    @invariant()
    def prefix_cache_is_consistent(self):
        if self.kv is None:
            return
        pool = self.kv.block_pool
        for h, block in pool.cached_blocks.items():
            assert block.block_hash == h
            assert block.block_id != 0
        hashed = [b for b in pool.blocks if b.block_hash is not None]
        assert len(hashed) == len(pool.cached_blocks)
        # The KV event consumer sees exactly the pool's cache (every rule flushes).
        assert self.sink.hashes == set(pool.cached_blocks)

    @invariant()
    def requests_hold_their_tokens(self):
        if self.kv is None:
            return
        for rid, req in self.running.items():
            blocks = self.kv.req_to_blocks[rid]
            assert len(blocks) == -(-req.num_computed_tokens // BS)
            for pos in range(req.num_computed_tokens):
                assert self.shadow[blocks[pos // BS].block_id][pos % BS] == req.all_token_ids[pos], (
                    f"{rid} position {pos} reads another token's KV"
                )
            for i, block in enumerate(blocks):
                if block.block_hash is not None:
                    assert block.block_hash == req.block_hashes[i]
        # Every cached block holds the tokens its hash names (else a later hit reads garbage).
        for h, block in self.kv.block_pool.cached_blocks.items():
            assert self.shadow[block.block_id] == self.hash_tokens[h]

    def teardown(self):
        if self.kv is None:
            return
        for req in self.running.values():
            self.kv.free(req)
        assert self.kv.get_num_free_blocks() == self.initial_free


KVCacheMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_cache_state_machine = KVCacheMachine.TestCase
