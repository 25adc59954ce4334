"""The gateway's Redis contract: one-round-trip admission + routing facts, load reports, usage."""

from __future__ import annotations

import redis
from test_redis_registry import BS, MODEL, CountingConnection, register
from test_redis_registry import reg as reg  # the fixture

from kvfleet_common import redis_keys as keys
from kvfleet_common.hashing import hash_blocks
from kvfleet_common.registry import Admission, Registry, UsageRecord, op_report_gateway, rate_retry_after
from kvfleet_common.schemas import TenantRecord

NOW = 1_800_000_000.0  # the start of a rate-limit minute


def admission(tenant: TenantRecord, candidates=(), hashes=(), local=0, gw="gw-a") -> Admission:
    return Admission(gw, tenant, local, MODEL, list(candidates), list(hashes))


def test_admit_counts_requests_and_refuses_over_the_minute_limit(reg):
    t = TenantRecord(name="acme", requests_per_minute=3)
    for _ in range(3):
        assert reg.admit(admission(t), now=NOW).refused is None
    refused = reg.admit(admission(t), now=NOW + 1)
    assert (refused.refused, refused.used, refused.window) == ("requests", 3, (3, 0))
    window = reg.client.hgetall(keys.ratelimit("acme", int(NOW // 60)))
    assert window == {b"requests": b"3"}  # the refused request was not counted
    assert 0 < reg.client.ttl(keys.ratelimit("acme", int(NOW // 60))) <= keys.RATELIMIT_TTL_S
    # a sliding minute: crossing the boundary frees nothing at once (no 2x burst around it) ...
    refused = reg.admit(admission(t), now=NOW + 60)
    assert (refused.refused, refused.used, refused.window) == ("requests", 3, (0, 3))
    # ... the previous minute fades out: room for one more once 3 x (1 - f) <= 2, at f = 1/3
    wait = rate_retry_after(3, (3, 0), NOW + 1)
    assert wait == 79.0
    assert reg.admit(admission(t), now=NOW + 1 + wait - 1).refused == "requests"
    assert reg.admit(admission(t), now=NOW + 1 + wait).refused is None
    assert reg.last_activity(MODEL) == NOW + 1 + wait


def test_retry_after_of_the_sliding_minute():
    assert rate_retry_after(10, (3, 0), NOW + 30) == 0.0  # room now
    # estimate 3 + 20 x (1 - f) must fall to 9: at f = 0.7, 12 s from now
    assert abs(rate_retry_after(10, (3, 20), NOW + 30) - 12.0) < 1e-9
    assert abs(rate_retry_after(10, (0, 30), NOW) - 42.0) < 1e-9
    # this minute alone is over: wait for the boundary, then for 10 x (1 - f) to fall to 9 (f = 0.1)
    assert abs(rate_retry_after(10, (10, 5), NOW + 30) - 36.0) < 1e-9


def test_tokens_per_minute_are_charged_from_reported_usage(reg):
    t = TenantRecord(name="acme", tokens_per_minute=100)
    assert reg.admit(admission(t), now=NOW).refused is None
    reg.report_gateway("gw-a", {}, {}, [UsageRecord("acme", MODEL, 60, 40, cached_tokens=16)], now=NOW + 1)
    refused = reg.admit(admission(t), now=NOW + 2)
    assert (refused.refused, refused.used) == ("tokens", 100)
    usage = reg.tenant_usage(["acme"], now=NOW + 2)["acme"]
    assert usage["total"] == {
        "requests": 1,
        "prompt_tokens": 60,
        "completion_tokens": 40,
        "cached_tokens": 16,
    }
    assert usage["models"] == {MODEL: usage["total"]}
    assert usage["this_minute"] == {"requests": 1, "tokens": 100}


def test_a_report_sums_many_finished_requests_into_one_increment_per_counter(reg):
    records = [UsageRecord("acme", MODEL, 10, 5, cached_tokens=8)] * 40 + [
        UsageRecord("acme", "other", 1, 2)
    ] * 3
    records += [UsageRecord("zeta", MODEL, 7, 1)]
    cmds = next(op_report_gateway("gw-a", {}, {}, records, NOW)).commands
    # per tenant: 4 totals + 4 per model (acme has 2 models) + the tokens/min window: not one per request
    assert sum(1 for c in cmds if c[0] == "HINCRBY") == (4 + 8 + 1) + (4 + 4 + 1)
    reg.report_gateway("gw-a", {}, {}, records, now=NOW)
    usage = reg.tenant_usage(["acme", "zeta"], now=NOW)
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


def test_concurrency_sums_live_gateways_and_the_local_count(reg):
    t = TenantRecord(name="acme", max_concurrent=3)
    reg.report_gateway("gw-b", {}, {"acme": 2}, now=NOW)
    assert reg.admit(admission(t, local=0), now=NOW).refused is None
    refused = reg.admit(admission(t, local=1), now=NOW)
    assert (refused.refused, refused.used) == ("concurrency", 3)
    # the asking gateway's own report is not double counted: it passes its exact local count instead
    reg.report_gateway("gw-a", {}, {"acme": 1}, now=NOW)
    assert reg.admit(admission(t, local=0), now=NOW).refused is None
    # a gateway that stopped reporting no longer holds anything (its load TTL passed)
    assert reg.admit(admission(t, local=1), now=NOW + keys.GATEWAY_LOAD_TTL_S + 1).refused is None


def test_admit_reports_prefix_matches_and_other_gateways_load(reg):
    hashes = hash_blocks(range(10 * BS), BS)
    for rid, n in [("r-0#1", 10), ("r-1#1", 4), ("r-2#1", 0)]:
        register(reg, rid)
        if n:
            reg.apply_kv_events(rid, [("stored", h) for h in hashes[:n]], 1)
    reg.apply_kv_events("r-2#1", [("stored", hashes[1])], 1)  # not a leading block: no match
    reg.report_gateway("gw-b", {"r-0#1": (2, 300), "r-1#1": (1, 0)}, {}, now=NOW)
    reg.report_gateway("gw-c", {"r-0#1": (1, 50)}, {}, now=NOW)
    reg.report_gateway("gw-a", {"r-2#1": (9, 999)}, {}, now=NOW)  # the asker's own: excluded
    t = TenantRecord(name="acme")
    res = reg.admit(admission(t, ["r-0#1", "r-1#1", "r-2#1"], hashes), now=NOW + 1)
    assert res.refused is None
    assert res.matched_blocks == (10, 4, 0)
    assert res.inflight == (3, 1, 0)
    assert res.pending_tokens == (350, 0, 0)


def test_admit_is_one_round_trip(redis_server, reg):
    hashes = hash_blocks(range(64 * BS), BS)
    register(reg, "r-0#1")
    reg.apply_kv_events("r-0#1", [("stored", h) for h in hashes], 1)
    pool = redis.ConnectionPool.from_url(redis_server.url, connection_class=CountingConnection)
    counted = Registry(redis.Redis(connection_pool=pool))
    counted.client.ping()
    t = TenantRecord(name="acme", requests_per_minute=1000, tokens_per_minute=10**6, max_concurrent=10)
    counted.admit(admission(t, ["r-0#1"], hashes))  # loads the script
    CountingConnection.sends = 0
    assert counted.admit(admission(t, ["r-0#1"], hashes)).matched_blocks == (64,)
    assert CountingConnection.sends == 1
    CountingConnection.sends = 0
    counted.report_gateway("gw-a", {"r-0#1": (1, 5)}, {"acme": 1}, [UsageRecord("acme", MODEL, 1, 1)])
    assert CountingConnection.sends == 1
    counted.close()


def test_a_gateway_report_replaces_its_previous_one_and_expires(reg):
    reg.report_gateway("gw-a", {"r-0#1": (2, 10)}, {"acme": 2}, now=NOW)
    reg.report_gateway("gw-a", {"r-1#1": (1, 0)}, {}, now=NOW)
    assert reg.client.hgetall(keys.gateway_load("gw-a")) == {b"ri:r-1#1": b"1", b"rp:r-1#1": b"0"}
    assert 0 < reg.client.pttl(keys.gateway_load("gw-a")) <= keys.GATEWAY_LOAD_TTL_S * 1000
    reg.remove_gateway("gw-a")
    assert reg.client.exists(keys.gateway_load("gw-a"), keys.gateways()) == 0


def test_deleting_a_tenant_deletes_its_usage(reg):
    reg.put_tenant(TenantRecord(name="acme"))
    reg.report_gateway("gw-a", {}, {}, [UsageRecord("acme", MODEL, 3, 4)])
    assert reg.tenant_usage(["acme"])["acme"]["total"]["requests"] == 1
    assert reg.delete_tenant("acme")
    assert reg.client.exists(keys.usage("acme")) == 0
