"""The fleet store against a real redis-server: replicas, KV index, prefix matching, records, purge."""

import asyncio
import hashlib
import time

import msgspec
import pytest
import redis
import redis.asyncio

from kvfleet_common import redis_keys as keys
from kvfleet_common.fleet_store.admission import Admission, UsageRecord
from kvfleet_common.fleet_store.runner import FleetStoreError, SupersededError
from kvfleet_common.fleet_store.store import AsyncFleetStore, FleetStore
from kvfleet_common.hashing import hash_blocks
from kvfleet_common.schemas import Heartbeat, ModelPolicy, TenantRecord

MODEL = "org/tiny-llama"
BS = 4


def heartbeat(replica_id: str, model: str = MODEL, **kw) -> Heartbeat:
    name, _ = keys.parse_replica_id(replica_id)
    now = time.time()
    fields = dict(
        replica_id=replica_id, name=name, model=model, base_url=f"http://{name}:8000", state="awake",
        block_size=BS, max_model_len=256, started_at=now, updated_at=now,
    )  # fmt: skip
    fields.update(kw)
    return Heartbeat(**fields)


class CountingConnection(redis.Connection):
    """Counts writes to the socket: one per round trip (a pipeline is sent as one write)."""

    sends = 0

    def send_packed_command(self, command, check_health=True):
        CountingConnection.sends += 1
        return super().send_packed_command(command, check_health)


class AsyncCountingConnection(redis.asyncio.Connection):
    sends = 0

    async def send_packed_command(self, command, check_health=True):
        AsyncCountingConnection.sends += 1
        return await super().send_packed_command(command, check_health)


@pytest.fixture
def store(redis_server):
    r = FleetStore.from_url(redis_server.url)
    yield r
    r.close()


def register(store: FleetStore, replica_id: str, model: str = MODEL, ttl: float = 5.0, **kw) -> None:
    name, _ = keys.parse_replica_id(replica_id)
    store.claim_name(name, replica_id, ttl=ttl)
    assert (
        store.publish_heartbeat(heartbeat(replica_id, model, **kw), ttl=ttl) is False
    )  # first beat creates it


def members(store: FleetStore, replica_id: str) -> set[bytes]:
    return store.client.smembers(keys.replica_blocks(replica_id))


def test_decode_responses_client_is_refused(redis_server):
    with pytest.raises(ValueError, match="decode_responses"):
        FleetStore(redis.Redis.from_url(redis_server.url, decode_responses=True))


def test_heartbeat_liveness_expires_with_ttl_and_prunes(store):
    register(store, "a#1", ttl=0.4)
    register(store, "b#1", ttl=30)
    store.apply_kv_events("a#1", [("stored", b"\x01" * 16)], first_seq=1)
    assert [hb.replica_id for hb in store.live_replicas(MODEL)] == ["a#1", "b#1"]
    assert store.publish_heartbeat(heartbeat("a#1", running=2), ttl=0.4) is True  # refresh of a live one
    assert store.get_heartbeat("a#1").running == 2
    assert 0 < store.client.pttl(keys.replica_blocks("a#1")) <= 400
    assert 0 < store.client.pttl(keys.replica_name("a")) <= 400

    deadline = time.monotonic() + 5
    while store.client.exists(keys.replica("a#1")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [hb.replica_id for hb in store.live_replicas(MODEL)] == ["b#1"]
    assert store.client.smembers(keys.model_replicas(MODEL)) == {b"b#1"}  # pruned lazily by the read
    assert not store.client.exists(keys.replica_blocks("a#1"), keys.replica_name("a"))  # same lifetime


def test_a_malformed_heartbeat_does_not_hide_the_others(store):
    register(store, "good#1")
    register(store, "bad#1")
    store.client.hset(keys.replica("bad#1"), "state", "hibernating")  # e.g. written by a newer engine
    assert [hb.replica_id for hb in store.live_replicas(MODEL)] == ["good#1"]


def test_kv_events_apply_in_order_with_sequence_numbers(store):
    register(store, "a#1")
    h = [bytes([i]) * 16 for i in range(6)]
    res = store.apply_kv_events(
        "a#1", [("stored", h[0]), ("stored", h[1]), ("removed", h[0]), ("stored", h[2])], 1
    )
    assert (res.ok, res.seq, res.reason) == (True, 4, "applied")
    assert members(store, "a#1") == {h[1], h[2]}
    # order matters within a batch: removed-then-stored keeps it, a clear wipes what came before
    store.apply_kv_events("a#1", [("removed", h[3]), ("stored", h[3]), ("cleared", None), ("stored", h[4])], 5)
    assert members(store, "a#1") == {h[4]}
    assert store.get_heartbeat("a#1").kv_seq_applied == 8
    # a retried batch (reply lost) is recognised and not re-applied
    dup = store.apply_kv_events(
        "a#1", [("stored", h[3]), ("stored", h[5]), ("removed", h[4]), ("stored", h[0])], 5
    )
    assert (dup.ok, dup.reason) == (True, "duplicate") and members(store, "a#1") == {h[4]}
    # a gap (events 9..10 lost) is refused: the replica must resync
    gap = store.apply_kv_events("a#1", [("stored", h[5])], first_seq=11)
    assert (gap.resync_needed, gap.reason, gap.seq) == (True, "gap", 8)
    assert members(store, "a#1") == {h[4]}
    # unchecked mode just continues the sequence
    assert store.apply_kv_events("a#1", [("stored", h[5])]).seq == 9
    # the block set carries the heartbeat's TTL even after being recreated by an event
    assert store.client.pttl(keys.replica_blocks("a#1")) > 0


def test_events_without_a_heartbeat_ask_for_resync(store):
    res = store.apply_kv_events("ghost#1", [("stored", b"\x00" * 16)], first_seq=1)
    assert (res.resync_needed, res.reason) == (True, "no-heartbeat")
    assert not store.client.exists(keys.replica_blocks("ghost#1"))
    with pytest.raises(ValueError, match="16-byte"):
        store.apply_kv_events("ghost#1", [("stored", b"short")])


def test_full_resync_replaces_the_index_in_chunks(store):
    register(store, "a#1")
    store.apply_kv_events("a#1", [("stored", b"\xff" * 16)], first_seq=1)
    hashes = [hashlib.md5(str(i).encode()).digest() for i in range(2500)]  # > 2 upload chunks
    res = store.replace_replica_blocks("a#1", hashes, seq=40)
    assert (res.ok, res.seq) == (True, 40)
    assert members(store, "a#1") == set(hashes)
    assert not store.client.exists(keys.replica_resync("a#1"))
    assert store.client.pttl(keys.replica_blocks("a#1")) > 0
    assert store.apply_kv_events("a#1", [("removed", hashes[0])], first_seq=41).ok
    assert store.replace_replica_blocks("a#1", [], seq=41).ok and members(store, "a#1") == set()
    assert store.replace_replica_blocks("nobody#1", hashes[:3]).reason == "no-heartbeat"
    assert not store.client.exists(keys.replica_resync("nobody#1"), keys.replica_blocks("nobody#1"))


def test_staged_upload_commits_only_when_complete(store):
    register(store, "a#1")
    hashes = [hashlib.md5(str(i).encode()).digest() for i in range(30)]
    store.stage_blocks("a#1", hashes[:10], fresh=True)
    store.stage_blocks("a#1", hashes[10:])
    assert store.commit_staged_blocks("a#1", 30, seq=7).ok and members(store, "a#1") == set(hashes)
    store.stage_blocks("a#1", hashes[:10], fresh=True)
    store.client.srem(keys.replica_resync("a#1"), hashes[0])  # e.g. staging expired or Redis restarted
    res = store.commit_staged_blocks("a#1", 10, seq=9)
    assert (res.resync_needed, res.reason, res.seq) == (True, "incomplete", 9)
    assert members(store, "a#1") == set(hashes) and store.get_heartbeat("a#1").kv_seq_applied == 7  # untouched
    assert not store.client.exists(keys.replica_resync("a#1"))


def test_prefix_match_counts_leading_blocks_with_gaps_and_salts(store):
    tokens = list(range(40))  # 10 blocks of 4
    shared = hash_blocks(tokens, BS)
    salted = hash_blocks(tokens, BS, salt="tenant-a")
    assert set(shared).isdisjoint(salted)
    for rid in ["full#1", "gap#1", "salted#1", "empty#1"]:
        register(store, rid)
    store.apply_kv_events("full#1", [("stored", h) for h in shared], 1)
    store.apply_kv_events(
        "gap#1", [("stored", h) for i, h in enumerate(shared) if i != 3], 1
    )  # block 3 evicted
    store.apply_kv_events("salted#1", [("stored", h) for h in salted[:6]], 1)
    ids = ["full#1", "gap#1", "salted#1", "empty#1", "unknown#9"]
    assert store.prefix_match(MODEL, shared, ids) == {
        "full#1": 10,
        "gap#1": 3,
        "salted#1": 0,
        "empty#1": 0,
        "unknown#9": 0,
    }
    assert store.prefix_match(MODEL, salted, ids)["salted#1"] == 6
    # a request sharing only 5 blocks then diverging
    other = hash_blocks([*tokens[:20], 999, *tokens[21:]], BS)
    assert store.prefix_match(MODEL, other, ["full#1", "gap#1"]) == {"full#1": 5, "gap#1": 3}
    # without ids: every registered replica of the model
    assert store.prefix_match(MODEL, shared) == {"full#1": 10, "gap#1": 3, "salted#1": 0, "empty#1": 0}
    assert store.prefix_match(MODEL, [], ["full#1"]) == {"full#1": 0}
    assert store.prefix_match(MODEL, shared, []) == {}


def test_prefix_match_is_one_round_trip(redis_server, store):
    hashes = [hashlib.md5(str(i).encode()).digest() for i in range(600)]  # several SMISMEMBER chunks
    ids = [f"r{i}#1" for i in range(8)]
    for i, rid in enumerate(ids):
        register(store, rid)
        store.replace_replica_blocks(rid, hashes[: i * 80])
    pool = redis.ConnectionPool.from_url(redis_server.url, connection_class=CountingConnection)
    counted = FleetStore(redis.Redis(connection_pool=pool))
    counted.client.ping()  # connection set-up is not part of the call
    counted.client.script_flush()  # Redis forgot the script: EVALSHA fails once, EVAL reloads it
    CountingConnection.sends = 0
    counted.prefix_match(MODEL, hashes, ids)
    assert CountingConnection.sends == 2  # the counter sees every round trip
    CountingConnection.sends = 0
    result = counted.prefix_match(MODEL, hashes, ids)
    assert CountingConnection.sends == 1
    assert result == {rid: i * 80 for i, rid in enumerate(ids)}
    CountingConnection.sends = 0
    assert counted.prefix_match(MODEL, hashes) == result
    assert CountingConnection.sends == 1
    counted.close()


def test_claim_name_clears_the_previous_epoch(store):
    register(store, "pod-0#100")
    store.apply_kv_events("pod-0#100", [("stored", bytes([i]) * 16) for i in range(50)], 1)
    assert store.claim_name("pod-0", "pod-0#200") == "pod-0#100"
    assert not store.client.exists(keys.replica("pod-0#100"), keys.replica_blocks("pod-0#100"))
    assert store.client.smembers(keys.model_replicas(MODEL)) == set()
    assert store.client.get(keys.replica_name("pod-0")) == b"pod-0#200"
    store.publish_heartbeat(heartbeat("pod-0#200"))
    # the old process, if still alive, may not come back
    with pytest.raises(SupersededError):
        store.publish_heartbeat(heartbeat("pod-0#100"))
    with pytest.raises(SupersededError):
        store.claim_name("pod-0", "pod-0#150")
    assert store.claim_name("pod-0", "pod-0#200") is None  # idempotent for the holder
    assert [hb.replica_id for hb in store.live_replicas(MODEL)] == ["pod-0#200"]
    with pytest.raises(ValueError, match="does not belong"):
        store.claim_name("pod-1", "pod-0#300")


def test_deregister_removes_the_replica_now(store):
    register(store, "a#1")
    store.apply_kv_events("a#1", [("stored", b"\x02" * 16)], 1)
    assert store.deregister_replica("a#1") is True
    assert store.live_replicas(MODEL) == []
    assert store.client.keys("kvf:replica:*") == [] and store.client.keys("kvf:name:*") == []
    assert store.deregister_replica("a#1") is False


def test_list_models_shows_configured_or_live_models(store):
    register(store, "a#1", model="live-only", ttl=0.3)
    register(store, "b#1", model="both")
    store.put_model_policy(ModelPolicy(model="both"))
    store.put_model_policy(ModelPolicy(model="scaled-to-zero"))
    assert store.list_models() == ["both", "live-only", "scaled-to-zero"]
    wait = time.monotonic() + 5
    while store.client.exists(keys.replica("a#1")) and time.monotonic() < wait:
        time.sleep(0.05)
    assert store.list_models() == ["both", "scaled-to-zero"]  # its only replica died
    assert not store.client.exists(keys.model_replicas("live-only"))
    store.publish_heartbeat(heartbeat("a#1", model="live-only"))  # back: listed again
    assert "live-only" in store.list_models()


def test_tenant_crud_and_api_keys(store):
    acme = TenantRecord(
        name="acme", models=["org/*"], requests_per_minute=100, max_concurrent=4, cache_salt="x"
    )
    store.put_tenant(acme)
    store.put_tenant(TenantRecord(name="beta"))
    assert store.get_tenant("acme") == acme and store.get_tenant("nobody") is None
    assert [t.name for t in store.list_tenants()] == ["acme", "beta"]

    k1, k2 = hashlib.sha256(b"sk-one").hexdigest(), hashlib.sha256(b"sk-two").hexdigest()
    id1 = store.add_api_key("acme", k1)
    assert store.add_api_key("acme", k1) == id1  # idempotent
    id2 = store.add_api_key("acme", k2)
    assert store.list_api_keys("acme") == {id1: k1, id2: k2}
    assert store.tenant_for_key_hash(k1) == acme
    assert store.tenant_for_key_hash(hashlib.sha256(b"sk-unknown").hexdigest()) is None
    with pytest.raises(FleetStoreError, match="another tenant"):
        store.add_api_key("beta", k1)
    with pytest.raises(FleetStoreError, match="unknown tenant"):
        store.add_api_key("nobody", k1)

    updated = msgspec.structs.replace(acme, requests_per_minute=5)
    store.put_tenant(updated)
    assert store.tenant_for_key_hash(k2) == updated  # lookups follow the record
    assert store.remove_api_key("acme", id1) is True and store.remove_api_key("acme", id1) is False
    assert store.tenant_for_key_hash(k1) is None and store.tenant_for_key_hash(k2) == updated

    assert store.delete_tenant("acme") is True and store.delete_tenant("acme") is False
    assert store.tenant_for_key_hash(k2) is None
    assert [t.name for t in store.list_tenants()] == ["beta"]
    assert store.client.keys("kvf:apikey:*") == [] and not store.client.exists(keys.tenant_keys("acme"))


def test_tenant_create_is_create_only_update_never_recreates_and_upsert_does_both(redis_server, store):
    acme = TenantRecord(name="acme", requests_per_minute=5)
    assert store.create_tenant(acme) is True
    assert store.create_tenant(TenantRecord(name="acme", requests_per_minute=99)) is False
    assert store.get_tenant("acme") == acme  # the refused create wrote nothing
    assert store.update_tenant(TenantRecord(name="acme", requests_per_minute=6)) is True
    assert store.update_tenant(TenantRecord(name="gone")) is False and store.get_tenant("gone") is None
    assert store.upsert_tenant(TenantRecord(name="team-a.prod")) is True
    assert store.upsert_tenant(TenantRecord(name="team-a.prod", priority=2)) is False
    assert [t.name for t in store.list_tenants()] == ["acme", "team-a.prod"]
    assert store.get_tenant("team-a.prod").priority == 2
    for bad in ["org/team", "Acme", "a_b", "a-", "a..b", "a.-b", "x" * 64]:  # all fine as key parts
        with pytest.raises(ValueError, match="invalid tenant name"):
            store.create_tenant(TenantRecord(name=bad))
        with pytest.raises(ValueError, match="invalid tenant name"):
            store.upsert_tenant(TenantRecord(name=bad))
    assert store.create_tenant(TenantRecord(name=".".join(["a" * 63] * 3))) is True  # labels of 63: fine

    async def race() -> list[bool]:  # ten concurrent creates of one name: exactly one wins
        astore = AsyncFleetStore.from_url(redis_server.url)
        try:
            return await asyncio.gather(
                *(astore.create_tenant(TenantRecord(name="racy", priority=i)) for i in range(10))
            )
        finally:
            await astore.aclose()

    assert sorted(asyncio.run(race())) == [False] * 9 + [True]


def test_model_records_activity_tokenizer_and_locks(store):
    policy = ModelPolicy(model=MODEL, routing_policy="round-robin", sleep_idle_seconds=60)
    store.put_model_policy(policy)
    assert store.get_model_policy(MODEL) == policy and MODEL in store.list_models()
    assert store.last_activity(MODEL) is None
    store.touch_activity(MODEL, now=1234.5)
    assert store.last_activity(MODEL) == 1234.5

    files = {
        "tokenizer.json": b'{"model": {}}',
        "tokenizer_config.json": b"{}\n",
        "blob.bin": bytes(range(256)),
    }
    rev = store.publish_tokenizer(MODEL, files)
    assert store.publish_tokenizer(MODEL, files) == rev
    assert store.fetch_tokenizer(MODEL, rev) == files
    assert store.fetch_tokenizer(MODEL, "0" * 64) is None

    assert store.acquire_wake_lock(MODEL, "gw-1") is True
    assert store.acquire_wake_lock(MODEL, "gw-2") is False
    assert store.release_wake_lock(MODEL, "gw-2") is False and store.release_wake_lock(MODEL, "gw-1") is True
    assert store.acquire_wake_lock(MODEL, "gw-2", ttl_ms=50) is True
    assert 0 < store.client.pttl(keys.model_wake_lock(MODEL)) <= 50

    assert store.record_usage("acme", 1, 100, now=600) == (1, 100)
    assert store.record_usage("acme", 1, 20, now=659) == (2, 120)
    assert store.record_usage("acme", 1, 5, now=660) == (1, 5)  # next minute
    assert 0 < store.client.ttl(keys.ratelimit("acme", 10)) <= keys.RATELIMIT_TTL_S

    assert store.delete_model_policy(MODEL) is True and store.get_model_policy(MODEL) is None


def _full_scenario(store: FleetStore) -> str:
    """Touch every kind of key the platform writes; returns a tokenizer revision."""
    register(store, "m1-0#1", model=MODEL)
    register(store, "m2-0#1", model="other")
    for rid in ["m1-0#1", "m2-0#1"]:
        store.apply_kv_events(rid, [("stored", h) for h in hash_blocks(range(16), BS)], 1)
    store.client.sadd(keys.replica_resync("m1-0#1"), b"\x00" * 16)  # a resync interrupted mid-upload
    rev = store.publish_tokenizer(MODEL, {"tokenizer.json": b"{}"})
    store.publish_tokenizer("other", {"tokenizer.json": b"[]"})
    for m in [MODEL, "other"]:
        store.put_model_policy(ModelPolicy(model=m))
        store.touch_activity(m)
        store.acquire_wake_lock(m, "gw")
    store.put_tenant(TenantRecord(name="acme"))
    store.add_api_key("acme", "ab" * 32)
    store.record_usage("acme", 1, 10)
    store.report_gateway("gw-1", {"m1-0#1": (1, 100)}, {"acme": 1}, [UsageRecord("acme", MODEL, 10, 5)])
    limited = TenantRecord(name="acme", max_concurrent=2)
    assert store.admit(Admission("gw-1", limited, MODEL, [], [], lease="gw-1/1")).refused is None
    return rev


def test_every_key_written_is_described_by_redis_keys(store):
    _full_scenario(store)
    found = store.client.keys("*")
    assert len(found) >= len(keys.KEY_SPECS)
    undescribed = [k for k in found if keys.spec_for(k) is None]
    assert undescribed == []
    kinds = {keys.spec_for(k).pattern for k in found}
    assert kinds == {s.pattern for s in keys.KEY_SPECS}  # the scenario covered every kind
    for k in found:  # and each key has the documented Redis type
        assert store.client.type(k).decode() == keys.spec_for(k).type, k


def test_purge_model_leaves_no_key_of_that_model(store):
    rev = _full_scenario(store)
    before_other = sorted(k for k in store.client.keys("*") if b"other" in k or b"m2-0" in k)
    store.purge_model(MODEL)
    left = store.client.keys("*")
    assert [k for k in left if MODEL.encode() in k or b"m1-0" in k or rev.encode() in k] == []
    assert MODEL not in store.list_models() and "other" in store.list_models()
    assert sorted(k for k in left if b"other" in k or b"m2-0" in k) == before_other  # others untouched
    assert store.get_tenant("acme") is not None


def test_async_store_speaks_the_same_contract(redis_server, store):
    register(store, "a#1")
    hashes = hash_blocks(range(32), BS)
    store.apply_kv_events("a#1", [("stored", h) for h in hashes[:5]], 1)

    async def main():
        pool = redis.asyncio.ConnectionPool.from_url(
            redis_server.url, connection_class=AsyncCountingConnection
        )
        astore = AsyncFleetStore(redis.asyncio.Redis(connection_pool=pool))
        try:
            await astore.client.ping()
            assert await astore.prefix_match(MODEL, hashes, ["a#1"]) == {"a#1": 5}
            AsyncCountingConnection.sends = 0
            await astore.prefix_match(MODEL, hashes, ["a#1"])
            sends = AsyncCountingConnection.sends
            live = await astore.live_replicas(MODEL)
            await astore.put_tenant(TenantRecord(name="acme"))
            key_id = await astore.add_api_key("acme", "cd" * 32)
            tenant = await astore.tenant_for_key_hash("cd" * 32)
            names = await asyncio.gather(*(astore.list_models() for _ in range(3)))
            return sends, live, key_id, tenant, names
        finally:
            await astore.aclose()

    sends, live, key_id, tenant, names = asyncio.run(main())
    assert sends == 1
    assert [hb.replica_id for hb in live] == ["a#1"]
    assert key_id in store.list_api_keys("acme") and tenant.name == "acme"
    assert names == [[MODEL]] * 3


def test_async_store_with_an_ops_limit_queues_commands_instead_of_failing(redis_server, store):
    """More concurrent operations than the limit: each waits its turn on one of the limit's connections
    (redis-py's default pool fails the 101st concurrent command with "Too many connections")."""
    register(store, "a#1")
    hashes = hash_blocks(range(32), BS)
    store.apply_kv_events("a#1", [("stored", h) for h in hashes[:3]], 1)

    async def main():
        astore = AsyncFleetStore.from_url(redis_server.url, max_concurrent_ops=4)
        try:
            results = await asyncio.gather(*(astore.prefix_match(MODEL, hashes, ["a#1"]) for _ in range(300)))
            pool = astore.client.connection_pool
            return results, len(pool._available_connections) + len(pool._in_use_connections)
        finally:
            await astore.aclose()

    results, connections = asyncio.run(main())
    assert results == [{"a#1": 3}] * 300
    assert connections <= 4


def test_stores_reconnect_after_a_redis_restart(redis_server):
    """Every pooled connection is dead after a restart; a transaction on one must not fail (redis-py's
    default policy does not retry MULTI/EXEC). Usage recording is a transaction."""
    sync = FleetStore.from_url(redis_server.url)
    usage = UsageRecord(tenant="acme", model=MODEL, prompt_tokens=3, completion_tokens=4)

    async def run_async(store: AsyncFleetStore) -> None:
        await asyncio.gather(*(store.report_gateway("gw-a", {}, {}, [usage]) for _ in range(4)))  # pooled conns

    async def scenario() -> dict:
        store = AsyncFleetStore.from_url(redis_server.url)
        await run_async(store)
        sync.report_gateway("gw-b", {}, {}, [usage])
        redis_server.restart()
        await run_async(store)  # the first use of each stale connection
        sync.report_gateway("gw-b", {}, {}, [usage])
        out = await store.tenant_usage(["acme"])
        await store.client.aclose()
        return out

    usage_after = asyncio.run(scenario())
    assert usage_after["acme"]["total"]["requests"] == 5  # exactly once each after the restart
