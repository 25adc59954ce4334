"""The gateway's Redis contract: one-round-trip admission + routing facts, load reports, usage."""

from __future__ import annotations

import asyncio

import redis

from kvfleet_common import redis_keys as keys
from kvfleet_common.fleet_store.admission import (
    Admission,
    Reservation,
    UsageRecord,
    op_report_gateway,
    rate_retry_after,
)
from kvfleet_common.fleet_store.store import AsyncFleetStore, FleetStore
from kvfleet_common.hashing import hash_blocks
from kvfleet_common.schemas import TenantRecord
from tests.common.test_fleet_store import BS, MODEL, CountingConnection, register
from tests.common.test_fleet_store import store as store  # the fixture

NOW = 1_800_000_000.0  # the start of a rate-limit minute


def admission(
    tenant: TenantRecord, candidates=(), hashes=(), gw="gw-a", lease="", reserve=0, released=()
) -> Admission:
    return Admission(gw, tenant, MODEL, list(candidates), list(hashes), lease, reserve, list(released))


def leases(store: FleetStore, tenant: str = "acme") -> set[str]:
    return {m.decode() for m in store.client.zrange(keys.inflight(tenant), 0, -1)}


def test_admit_counts_requests_and_refuses_over_the_minute_limit(store):
    t = TenantRecord(name="acme", requests_per_minute=3)
    for _ in range(3):
        assert store.admit(admission(t), now=NOW).refused is None
    refused = store.admit(admission(t), now=NOW + 1)
    assert (refused.refused, refused.used, refused.window) == ("requests", 3, (3, 0))
    window = store.client.hgetall(keys.ratelimit("acme", int(NOW // 60)))
    assert window == {b"requests": b"3"}  # the refused request was not counted
    assert 0 < store.client.ttl(keys.ratelimit("acme", int(NOW // 60))) <= keys.RATELIMIT_TTL_S
    # a sliding minute: crossing the boundary frees nothing at once (no 2x burst around it) ...
    refused = store.admit(admission(t), now=NOW + 60)
    assert (refused.refused, refused.used, refused.window) == ("requests", 3, (0, 3))
    # ... the previous minute fades out: room for one more once 3 x (1 - f) <= 2, at f = 1/3
    wait = rate_retry_after(3, (3, 0), NOW + 1)
    assert wait == 79.0
    assert store.admit(admission(t), now=NOW + 1 + wait - 1).refused == "requests"
    assert store.admit(admission(t), now=NOW + 1 + wait).refused is None
    assert store.last_activity(MODEL) == NOW + 1 + wait


def test_retry_after_of_the_sliding_minute():
    assert rate_retry_after(10, (3, 0), NOW + 30) == 0.0  # room now
    # estimate 3 + 20 x (1 - f) must fall to 9: at f = 0.7, 12 s from now
    assert abs(rate_retry_after(10, (3, 20), NOW + 30) - 12.0) < 1e-9
    assert abs(rate_retry_after(10, (0, 30), NOW) - 42.0) < 1e-9
    # this minute alone is over: wait for the boundary, then for 10 x (1 - f) to fall to 9 (f = 0.1)
    assert abs(rate_retry_after(10, (10, 5), NOW + 30) - 36.0) < 1e-9


def test_tokens_per_minute_are_charged_from_reported_usage(store):
    t = TenantRecord(name="acme", tokens_per_minute=100)
    admitted = store.admit(admission(t, reserve=150), now=NOW)  # larger than the budget: still admitted alone
    assert (admitted.refused, admitted.minute) == (None, int(NOW // 60))
    assert store.tenant_usage(["acme"], now=NOW)["acme"]["this_minute"] == {"requests": 1, "tokens": 150}
    store.report_gateway("gw-a", {}, {}, [UsageRecord("acme", MODEL, 60, 40, cached_tokens=16)], now=NOW + 1,
                       refunds=[Reservation("acme", admitted.minute, 150)])  # fmt: skip
    refused = store.admit(admission(t), now=NOW + 2)
    assert (refused.refused, refused.used) == ("tokens", 100)
    usage = store.tenant_usage(["acme"], now=NOW + 2)["acme"]
    assert usage["total"] == {
        "requests": 1,
        "prompt_tokens": 60,
        "completion_tokens": 40,
        "cached_tokens": 16,
    }
    assert usage["models"] == {MODEL: usage["total"]}
    assert usage["this_minute"] == {"requests": 1, "tokens": 100}


def test_a_report_sums_many_finished_requests_into_one_increment_per_counter(store):
    records = [UsageRecord("acme", MODEL, 10, 5, cached_tokens=8)] * 40 + [
        UsageRecord("acme", "other", 1, 2)
    ] * 3
    records += [UsageRecord("zeta", MODEL, 7, 1)]
    cmds = next(op_report_gateway("gw-a", {}, {}, records, NOW)).commands
    # per tenant: 4 totals + 4 per model (acme has 2 models) + the tokens/min window: not one per request
    assert sum(1 for c in cmds if c[0] == "HINCRBY") == (4 + 8 + 1) + (4 + 4 + 1)
    store.report_gateway("gw-a", {}, {}, records, now=NOW)
    usage = store.tenant_usage(["acme", "zeta"], now=NOW)
    assert usage["acme"]["total"] == {"requests": 43, "prompt_tokens": 403, "completion_tokens": 206,
                                      "cached_tokens": 320}  # fmt: skip
    assert usage["acme"]["models"]["other"] == {"requests": 3, "prompt_tokens": 3, "completion_tokens": 6,
                                                "cached_tokens": 0}  # fmt: skip
    assert usage["acme"]["this_minute"]["tokens"] == 403 + 206
    assert usage["zeta"]["total"] == {
        "requests": 1,
        "prompt_tokens": 7,
        "completion_tokens": 1,
        "cached_tokens": 0,
    }


def test_tokens_are_reserved_at_admission_and_settled_to_real_usage(store):
    t = TenantRecord(name="acme", tokens_per_minute=100)
    minute = int(NOW // 60)
    # admitted while the window is under the limit, each reserving its estimate: the burst overruns the
    # budget by less than one estimate (4 x 30 = 120 < 100 + 30), and the 5th is refused
    results = [store.admit(admission(t, reserve=30), now=NOW + i) for i in range(5)]
    assert [r.refused for r in results] == [None] * 4 + ["tokens"]
    assert (results[4].used, results[4].window) == (120, (120, 0))
    window = lambda m: int(store.client.hget(keys.ratelimit("acme", m), "tokens") or 0)  # noqa: E731
    assert window(minute) == 120
    # settled: real usage charged, reservations handed back -> the window holds exactly the real usage
    used = [UsageRecord("acme", MODEL, 5, 7)] * 3  # 36 tokens
    store.report_gateway("gw-a", {}, {}, used, now=NOW + 10, refunds=[Reservation("acme", minute, 30)] * 3)
    assert window(minute) == 30 + 36  # the fourth request is still running: its reservation stands
    assert store.admit(admission(t, reserve=30), now=NOW + 11).refused is None
    # a reservation made last minute is taken back from last minute's window, the usage charged to this one
    store.report_gateway("gw-a", {}, {}, [UsageRecord("acme", MODEL, 1, 1)], now=NOW + 61,
                       refunds=[Reservation("acme", minute, 30)])  # fmt: skip
    assert (window(minute), window(minute + 1)) == (30 + 36 + 30 - 30, 2)
    # a reservation older than the sliding minute no longer counts: its refund is dropped, not misapplied
    store.report_gateway("gw-a", {}, {}, [], now=NOW + 125, refunds=[Reservation("acme", minute, 30)])
    assert window(minute + 2) == 0 and window(minute + 1) == 2
    assert store.tenant_usage(["acme"], now=NOW + 61)["acme"]["total"]["prompt_tokens"] == 5 * 3 + 1


def test_concurrency_leases_are_taken_in_the_admission_and_released_once(store):
    t = TenantRecord(name="acme", max_concurrent=2)
    assert store.admit(admission(t, lease="gw-a/1"), now=NOW).refused is None
    assert store.admit(admission(t, lease="gw-b/1", gw="gw-b"), now=NOW).refused is None
    refused = store.admit(admission(t, lease="gw-a/2"), now=NOW)
    assert (refused.refused, refused.used) == ("concurrency", 2)
    assert leases(store) == {"gw-a/1", "gw-b/1"}  # a refused request takes nothing
    # gw-a's finished request: removed by its next admission of the tenant, in the same round trip
    assert store.admit(admission(t, lease="gw-a/3", released=["gw-a/1"]), now=NOW).refused is None
    assert leases(store) == {"gw-a/3", "gw-b/1"}
    # ... or by its next report; a lease released twice frees one slot, never someone else's
    store.report_gateway("gw-b", {}, {}, now=NOW, released={"acme": ["gw-b/1", "gw-b/1"]})
    store.report_gateway("gw-b", {}, {}, now=NOW, released={"acme": ["gw-b/1"]})
    assert leases(store) == {"gw-a/3"}
    assert store.admit(admission(t, lease="gw-a/4"), now=NOW).refused is None
    assert store.admit(admission(t, lease="gw-a/5"), now=NOW).refused == "concurrency"


def test_leases_of_a_gateway_that_stops_renewing_them_expire(store):
    t = TenantRecord(name="acme", max_concurrent=1)
    ttl = keys.LEASE_TTL_S
    assert store.admit(admission(t, lease="gw-a/1"), now=NOW).refused is None
    assert store.admit(admission(t, lease="gw-b/1", gw="gw-b"), now=NOW + ttl - 1).refused == "concurrency"
    # renewed by its gateway's report: still held after the first TTL
    store.report_gateway("gw-a", {}, {}, now=NOW + ttl - 1, leases={"acme": ["gw-a/1"]})
    assert store.admit(admission(t, lease="gw-b/1", gw="gw-b"), now=NOW + ttl + 1).refused == "concurrency"
    # gw-a died: nobody renews, and the slot is free one TTL after the last renewal
    assert store.admit(admission(t, lease="gw-b/1", gw="gw-b"), now=NOW + 2 * ttl).refused is None
    assert leases(store) == {"gw-b/1"}
    # a renewal racing the lease's removal never brings it back (ZADD XX)
    store.report_gateway("gw-a", {}, {}, now=NOW + 2 * ttl, leases={"acme": ["gw-a/1"]})
    assert leases(store) == {"gw-b/1"}
    assert 0 < store.client.pttl(keys.inflight("acme")) <= ttl * 1000


def test_a_parallel_burst_takes_exactly_max_concurrent_leases(redis_server, store):
    t = TenantRecord(name="acme", max_concurrent=5)

    async def burst(first: int) -> list[str | None]:
        astore = AsyncFleetStore.from_url(redis_server.url)
        try:
            admissions = [admission(t, lease=f"gw-{i % 3}/{first + i}", gw=f"gw-{i % 3}") for i in range(30)]
            return [r.refused for r in await asyncio.gather(*(astore.admit(a) for a in admissions))]
        finally:
            await astore.aclose()

    refused = asyncio.run(burst(0))
    assert refused.count(None) == 5 and set(refused) == {None, "concurrency"}
    held = leases(store)
    assert len(held) == 5
    by_gateway = {}
    for lease in held:
        by_gateway.setdefault(lease.split("/")[0], []).append(lease)
    for gw, ids in by_gateway.items():  # every gateway releases its own
        store.report_gateway(gw, {}, {}, released={"acme": ids})
    assert leases(store) == set()
    assert asyncio.run(burst(100)).count(None) == 5


def test_admit_reports_prefix_matches_and_other_gateways_load(store):
    hashes = hash_blocks(range(10 * BS), BS)
    for rid, n in [("r-0#1", 10), ("r-1#1", 4), ("r-2#1", 0)]:
        register(store, rid)
        if n:
            store.apply_kv_events(rid, [("stored", h) for h in hashes[:n]], 1)
    store.apply_kv_events("r-2#1", [("stored", hashes[1])], 1)  # not a leading block: no match
    store.report_gateway("gw-b", {"r-0#1": (2, 300), "r-1#1": (1, 0)}, {}, now=NOW)
    store.report_gateway("gw-c", {"r-0#1": (1, 50)}, {}, now=NOW)
    store.report_gateway("gw-a", {"r-2#1": (9, 999)}, {}, now=NOW)  # the asker's own: excluded
    t = TenantRecord(name="acme")
    res = store.admit(admission(t, ["r-0#1", "r-1#1", "r-2#1"], hashes), now=NOW + 1)
    assert res.refused is None
    assert res.matched_blocks == (10, 4, 0)
    assert res.inflight == (3, 1, 0)
    assert res.pending_tokens == (350, 0, 0)


def test_admit_is_one_round_trip(redis_server, store):
    hashes = hash_blocks(range(64 * BS), BS)
    register(store, "r-0#1")
    store.apply_kv_events("r-0#1", [("stored", h) for h in hashes], 1)
    pool = redis.ConnectionPool.from_url(redis_server.url, connection_class=CountingConnection)
    counted = FleetStore(redis.Redis(connection_pool=pool))
    counted.client.ping()
    t = TenantRecord(name="acme", requests_per_minute=1000, tokens_per_minute=10**6, max_concurrent=10)
    counted.admit(admission(t, ["r-0#1"], hashes, lease="gw-a/1", reserve=9))  # loads the script
    CountingConnection.sends = 0
    admitted = counted.admit(admission(t, ["r-0#1"], hashes, lease="gw-a/2", reserve=9, released=["gw-a/1"]))
    assert admitted.matched_blocks == (64,)
    assert CountingConnection.sends == 1
    CountingConnection.sends = 0
    counted.report_gateway("gw-a", {"r-0#1": (1, 5)}, {"acme": 1}, [UsageRecord("acme", MODEL, 1, 1)],
                           leases={"acme": ["gw-a/2"]}, released={"acme": ["gw-a/1"]},
                           refunds=[Reservation("acme", admitted.minute, 9)])  # fmt: skip
    assert CountingConnection.sends == 1
    counted.close()


def test_a_gateway_report_replaces_its_previous_one_and_expires(store):
    store.report_gateway("gw-a", {"r-0#1": (2, 10)}, {"acme": 2}, now=NOW)
    store.report_gateway("gw-a", {"r-1#1": (1, 0)}, {}, now=NOW)
    assert store.client.hgetall(keys.gateway_load("gw-a")) == {b"ri:r-1#1": b"1", b"rp:r-1#1": b"0"}
    assert 0 < store.client.pttl(keys.gateway_load("gw-a")) <= keys.GATEWAY_LOAD_TTL_S * 1000
    store.remove_gateway("gw-a")
    assert store.client.exists(keys.gateway_load("gw-a"), keys.gateways()) == 0


def test_deleting_a_tenant_deletes_its_usage(store):
    store.put_tenant(TenantRecord(name="acme", max_concurrent=1))
    store.report_gateway("gw-a", {}, {}, [UsageRecord("acme", MODEL, 3, 4)])
    assert store.admit(admission(store.get_tenant("acme"), lease="gw-a/1")).refused is None
    assert store.tenant_usage(["acme"])["acme"]["total"]["requests"] == 1
    assert store.delete_tenant("acme")
    assert store.client.exists(keys.usage("acme"), keys.inflight("acme")) == 0
