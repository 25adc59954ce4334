"""PresencePublisher against a real redis-server, fed by a real BlockPool as in the engine core."""

import logging
import threading
import time

import pytest
import redis

from kvfleet_common import redis_keys as keys
from kvfleet_common.fleet_store.store import FleetStore
from kvfleet_common.hashing import hash_blocks
from kvfleet_common.schemas import ReplicaStats
from kvfleet_engine import presence
from kvfleet_engine.core.block_pool import BlockPool
from kvfleet_engine.presence import PresencePublisher

MODEL = "org/tiny"
BS = 4
TOKENIZER = {"tokenizer.json": b'{"version": "1.0"}', "tokenizer_config.json": b"{}"}


def wait_for(cond, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = cond()
        except redis.ConnectionError:  # the test's own client, across a Redis restart
            value = None
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class Replica:
    """The engine side: a real BlockPool whose events go to the publisher, answering resyncs like the core."""

    def __init__(self, url: str, name: str = "pod-0", epoch: int | None = None, blocks: int = 64, **kw):
        self.stats = ReplicaStats(running=1, waiting=2, kv_usage=0.5, num_kv_blocks=blocks)
        kw = {"heartbeat_interval": 0.1, "ttl": 2.0, "max_backoff": 0.2} | kw
        self.pub = PresencePublisher(
            url, name=name, model=MODEL, base_url=f"http://{name}:8000", block_size=BS, max_model_len=128,
            stats=lambda: self.stats, tokenizer_files=TOKENIZER, epoch=epoch, **kw,
        )  # fmt: skip
        self.pool = BlockPool(blocks, enable_caching=True, on_event=self.pub.push_kv_events)
        self.held: list = []

    def serve(self, prompt: list[int], keep: bool = False) -> list[bytes]:
        """Run one request's prompt through the pool: allocate, cache its full blocks, free (unless kept)."""
        hashes = hash_blocks(prompt, BS)
        blocks = self.pool.get_new_blocks(len(hashes))
        self.pool.cache_full_blocks(blocks, hashes)
        self.pool.flush_events()
        if keep:
            self.held += blocks
        else:
            self.pool.free_blocks(reversed(blocks))
        self.answer_resync()
        return hashes

    def answer_resync(self) -> None:
        if self.pub.resync_requested():
            self.pub.push_snapshot(list(self.pool.cached_blocks))

    def cached(self) -> set[bytes]:
        return set(self.pool.cached_blocks)


def index(store: FleetStore, replica_id: str) -> set[bytes]:
    return store.client.smembers(keys.replica_blocks(replica_id))


def in_sync(rep: Replica, store: FleetStore) -> bool:
    rep.answer_resync()
    hb = store.get_heartbeat(rep.pub.replica_id)
    return (
        hb is not None
        and index(store, rep.pub.replica_id) == rep.cached()
        and hb.kv_seq_applied == rep.pub._seq
    )


@pytest.fixture
def store(redis_server):
    r = FleetStore.from_url(redis_server.url)
    yield r
    r.close()


def test_heartbeat_state_and_kv_index_follow_the_engine(redis_server, store):
    rep = Replica(redis_server.url, ttl=0.5)
    rep.pub.start()
    try:
        hb = wait_for(lambda: store.get_heartbeat(rep.pub.replica_id), what="first heartbeat")
        assert (hb.state, hb.running, hb.waiting, hb.kv_usage, hb.block_size) == ("starting", 1, 2, 0.5, BS)
        assert store.fetch_tokenizer(MODEL, hb.tokenizer_revision) == TOKENIZER
        rep.pub.set_state("awake")
        wait_for(lambda: store.get_heartbeat(rep.pub.replica_id).state == "awake", what="state change")

        a = rep.serve(list(range(40)))  # 10 blocks
        b = rep.serve([*range(20), *range(100, 120)])  # shares 5 blocks with a
        wait_for(lambda: in_sync(rep, store), what="index in sync")
        assert store.prefix_match(MODEL, a, [rep.pub.replica_id]) == {rep.pub.replica_id: 10}
        assert store.prefix_match(MODEL, b, None) == {rep.pub.replica_id: 10}

        for i in range(12):  # 60 distinct blocks through a 63-block pool: evictions -> "removed" events
            rep.serve(list(range(1000 * (i + 1), 1000 * (i + 1) + 20)))
        wait_for(lambda: in_sync(rep, store), what="index in sync after evictions")
        assert rep.pub.resyncs_requested == 0  # everything went through as ordered events
        assert store.prefix_match(MODEL, a, [rep.pub.replica_id])[rep.pub.replica_id] < 10

        time.sleep(1.0)  # two TTLs: alive only because the thread keeps beating
        assert [h.replica_id for h in store.live_replicas(MODEL)] == [rep.pub.replica_id]
        assert store.get_heartbeat(rep.pub.replica_id).kv_seq_emitted == rep.pub._seq
    finally:
        rep.pub.stop(deregister=True)
    assert store.live_replicas(MODEL) == [] and store.client.keys("kvf:replica:*") == []


def test_new_epoch_clears_what_the_previous_boot_left(redis_server, store):
    old = Replica(redis_server.url, epoch=1000)
    old.pub.start()
    old.serve(list(range(40)), keep=True)
    wait_for(lambda: in_sync(old, store), what="old index")
    old.pub.stop(deregister=False)  # crashed, as far as Redis can tell: its records are still there
    assert index(store, "pod-0#1000")

    new = Replica(redis_server.url, epoch=2000)
    new.pub.start()
    try:
        wait_for(lambda: store.get_heartbeat("pod-0#2000"), what="new heartbeat")
        assert not store.client.exists(keys.replica("pod-0#1000"), keys.replica_blocks("pod-0#1000"))
        assert [h.replica_id for h in store.live_replicas(MODEL)] == ["pod-0#2000"]
        assert store.prefix_match(MODEL, hash_blocks(list(range(40)), BS)) == {"pod-0#2000": 0}

        # the old process coming back to life may not publish over the new one
        zombie = Replica(redis_server.url, epoch=1000)
        zombie.pub.start()
        wait_for(lambda: zombie.pub.superseded, what="zombie superseded")
        zombie.pub.stop()
        assert [h.replica_id for h in store.live_replicas(MODEL)] == ["pod-0#2000"]
    finally:
        new.pub.stop()


def test_survives_redis_restart_and_resyncs(redis_server, store, caplog):
    rep = Replica(redis_server.url)
    rep.pub.start()
    try:
        rep.serve(list(range(40)))
        wait_for(lambda: in_sync(rep, store), what="index")
        caplog.set_level(logging.WARNING, logger="kvfleet_engine.presence")

        redis_server.stop()
        # the engine keeps serving: pushes return while the thread fails to reach Redis
        for i in range(8):
            rep.serve(list(range(500 + 40 * i, 540 + 40 * i)))
            time.sleep(0.05)
        wait_for(lambda: not rep.pub.connected, what="outage noticed")
        assert rep.pub._queued_events > 0 or rep.pub.resync_requested()

        redis_server.start()  # same port, empty: Redis lost everything
        wait_for(lambda: in_sync(rep, store), what="index rebuilt after restart")
        assert rep.pub.resyncs_requested >= 1
        assert (
            store.fetch_tokenizer(MODEL, store.get_heartbeat(rep.pub.replica_id).tokenizer_revision)
            == TOKENIZER
        )
        assert [h.replica_id for h in store.live_replicas(MODEL)] == [rep.pub.replica_id]
        outage_logs = [r for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(outage_logs) == 1  # once per outage, not once per retry
    finally:
        rep.pub.stop()


def test_dropped_connections_replay_queued_events_without_resync(redis_server, store):
    rep = Replica(redis_server.url)
    rep.pub.start()
    try:
        rep.serve(list(range(40)))
        wait_for(lambda: in_sync(rep, store), what="index")
        for i in range(5):
            store.client.client_kill_filter(_type="normal", skipme=True)  # Redis keeps its data
            rep.serve(list(range(2000 + 40 * i, 2040 + 40 * i)))
        wait_for(lambda: in_sync(rep, store), what="index after reconnects")
        assert rep.pub.resyncs_requested == 0  # the sequence check proved nothing was lost
    finally:
        rep.pub.stop()


def test_queue_overflow_during_outage_requests_a_resync(redis_server, store):
    rep = Replica(redis_server.url, max_queued_events=10)
    redis_server.stop()
    rep.pub.start()  # Redis is down from the start: the engine must still come up and serve
    try:
        for i in range(6):
            rep.serve(list(range(100 * i, 100 * i + 16)))  # 4 stored events each
        assert rep.pub.resync_requested() is False  # answered at once by serve()
        assert rep.pub.events_dropped > 0 and rep.pub.resyncs_requested >= 1
        redis_server.start()
        wait_for(lambda: in_sync(rep, store), what="index after overflow")
    finally:
        rep.pub.stop()


def test_push_never_waits_for_a_hung_redis(redis_server, store):
    rep = Replica(redis_server.url)
    rep.pub.start()
    try:
        wait_for(lambda: store.get_heartbeat(rep.pub.replica_id), what="heartbeat")
        with redis.Redis.from_url(redis_server.url) as admin:  # Redis keeps connections but answers nothing
            admin.execute_command("CLIENT", "PAUSE", "600000", "ALL")
        done = threading.Event()

        def engine_steps():
            for i in range(50):
                rep.serve(list(range(3000 + 8 * i, 3008 + 8 * i)))
            done.set()

        threading.Thread(target=engine_steps, daemon=True).start()
        assert done.wait(15), "push_kv_events blocked on Redis"  # a blocking push would wait forever
        wait_for(lambda: not rep.pub.connected, what="the publisher's write timing out")
        redis_server.restart()  # the only way out of a 10-minute pause (Redis 7.0 pauses UNPAUSE too)
        wait_for(lambda: in_sync(rep, store), what="index after the hang")
    finally:
        rep.pub.stop()


def test_large_snapshot_uploads_in_slices_between_heartbeats(redis_server, store, monkeypatch):
    monkeypatch.setattr(presence, "SNAPSHOT_SLICE", 7)
    rep = Replica(redis_server.url, blocks=256)
    for i in range(10):
        rep.serve(list(range(100 * i, 100 * i + 64)), keep=True)  # 160 blocks, held
    rep.pub.start()
    try:
        wait_for(lambda: in_sync(rep, store), what="index")
        store.client.delete(keys.replica_blocks(rep.pub.replica_id))  # lose the index behind its back ...
        rep.pub.push_snapshot(list(rep.pool.cached_blocks))  # ... and resend it: 23 slices
        wait_for(lambda: in_sync(rep, store), what="index after a sliced snapshot")
        assert len(index(store, rep.pub.replica_id)) == 160
    finally:
        rep.pub.stop()


def test_bad_arguments_are_rejected_early(redis_server):
    with pytest.raises(ValueError, match="heartbeat_interval"):
        PresencePublisher(redis_server.url, name="p", model=MODEL, base_url="u", block_size=4, max_model_len=8,
                          stats=ReplicaStats, heartbeat_interval=5, ttl=5)  # fmt: skip
    with pytest.raises(ValueError, match="invalid model"):
        PresencePublisher(redis_server.url, name="p", model="a:b", base_url="u", block_size=4, max_model_len=8,
                          stats=ReplicaStats)  # fmt: skip
    pub = PresencePublisher(redis_server.url, name="p", model=MODEL, base_url="u", block_size=4, max_model_len=8,
                            stats=ReplicaStats)  # fmt: skip
    with pytest.raises(ValueError, match="unknown replica state"):
        pub.set_state("asleep")


def test_real_engine_blocks_are_found_by_gateway_side_hashes(redis_server, store, demo_model, test_device):
    """The whole contract: the engine caches a prompt, the gateway hashes the same tokens and finds it."""
    from kvfleet_engine import LLM, SamplingParams

    llm = LLM(demo_model(arch="llama"), device=test_device, use_tqdm=False, max_model_len=256, block_size=8)
    pub = PresencePublisher(
        redis_server.url, name="llm-0", model=MODEL, base_url="http://llm-0:8000", block_size=8, max_model_len=256,
        stats=ReplicaStats, heartbeat_interval=0.1, ttl=2.0,
    )  # fmt: skip
    pool = llm.engine.scheduler.kv.block_pool
    pool.on_event = pub.push_kv_events  # what EngineCore(on_kv_event=...) wires in the core process
    pub.start()
    try:
        prompt = "The river flows past the old mill and the quiet town, carrying leaves toward the sea."
        llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        token_ids = llm.tokenizer.encode(prompt)
        hashes = hash_blocks(token_ids, 8)
        assert len(hashes) >= 2
        expected = len(hashes)
        found = wait_for(
            lambda: (
                store.prefix_match(MODEL, hashes, [pub.replica_id])[pub.replica_id] == expected and expected
            ),
            what="the engine's prompt blocks in the index",
        )
        assert found == expected
        # another tenant's salt names different blocks: no cross-tenant hit
        assert store.prefix_match(MODEL, hash_blocks(token_ids, 8, salt="tenant-b"), [pub.replica_id]) == {
            pub.replica_id: 0
        }
        assert index(store, pub.replica_id) == set(pool.cached_blocks)
    finally:
        pub.stop()
