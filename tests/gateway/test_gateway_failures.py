"""The gateway when things break: a second gateway, Redis restarting, replicas dying (in that order:
the tests share one fleet and the last one kills a replica)."""

from __future__ import annotations

import hashlib
import json

import httpx
import openai
import pytest

from kvfleet_common import redis_keys
from tests.gateway.gateway_harness import MODEL, kill_tree, wait_until

LONG = "Tell me everything about the history of computing, from the abacus to the present day. " * 3


def sdk(gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=60)


def ask(gateway, key: str, prompt: str = "hello", **kw) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key}", "x-kvfleet-debug": gateway.admin_token},
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 2, **kw})  # fmt: skip


@pytest.fixture(scope="module")
def second(fleet):
    return fleet.start_gateway()


def test_two_gateways_share_tenants_limits_and_load(fleet, second):
    a, b = fleet.gateway, second
    key = a.create_tenant("shared", requests_per_minute=3)
    assert ask(b, key).status_code == 200  # created on a, usable on b at once
    assert ask(a, key).status_code == 200
    assert ask(b, key).status_code == 200
    for g in (a, b):
        r = ask(g, key)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    # concurrency: a stream held open on a counts on b (shared within one load-report interval)
    k2 = a.create_tenant("single", max_concurrent=1)
    assert ask(b, k2).status_code == 200  # warm (tokenizer loaded): the check below must be quick
    # That request still counts on b until b's next load report (up to one 50 ms interval): wait for it,
    # or a would rightly refuse the stream below.
    store = fleet.store()

    def tenant_in_flight() -> int:
        """What admission counts: the tenant's concurrency leases in Redis (b's is removed by its next
        report; the load hash's per-tenant count may reach 0 a report earlier, so it is not the signal)."""
        return store.client.zcard(redis_keys.inflight("single"))

    wait_until(lambda: tenant_in_flight() == 0, 5, 0.01, "b to release the finished request's lease")
    with httpx.stream("POST", f"{a.url}/v1/completions", headers={"Authorization": f"Bearer {k2}"}, timeout=60,
                      json={"model": MODEL, "prompt": "x", "max_tokens": 480, "stream": True, "ignore_eos": True}) as s:  # fmt: skip
        chunks = s.iter_bytes()  # keep the iterator: a collected one closes the response
        next(chunks)
        r = wait_until(lambda: (r := ask(b, k2)).status_code == 429 and r, 10, 0.05, "b to see a's request")
        assert "concurrent" in r.json()["error"]["message"]
    wait_until(lambda: ask(b, k2).status_code == 200, 10, 0.1, "the slot to free on b")
    assert len(store.client.zrange(redis_keys.gateways(), 0, -1)) == 2


def test_redis_restart(fleet, second):
    g = fleet.gateway
    key = g.create_tenant("survivor")
    key_hash = hashlib.sha256(key.encode()).hexdigest()
    store = fleet.store()
    record = store.tenant_for_key_hash(key_hash)
    assert ask(g, key, LONG).status_code == 200
    fallbacks = g.metric("kvfleet_gateway_routing_fallbacks_total", reason="redis_unavailable")

    fleet.redis.stop()
    # the gateway keeps serving from what it knew: the tenant (cached) and the replicas (snapshot)
    for _ in range(3):
        r = ask(g, key, LONG)
        assert r.status_code == 200, r.text
    assert g.metric("kvfleet_gateway_routing_fallbacks_total", reason="redis_unavailable") >= fallbacks + 3
    assert json.loads(r.headers["x-kvfleet-route"])["fallbacks"] == ["redis_unavailable"]
    assert httpx.get(f"{g.url}/health").json()["registry"] == "ok"  # within the staleness bound

    fleet.redis.start()  # empty: no persistence; engines re-register, the operator would re-assert tenants
    store = fleet.store()
    store.put_tenant(record)
    store.add_api_key(record.name, key_hash)
    wait_until(lambda: len(store.live_replicas(MODEL)) == 2, 30, 0.2, "the replicas to re-register")

    def routed_with_redis():
        r = ask(g, key, LONG)
        return r.status_code == 200 and json.loads(r.headers["x-kvfleet-route"])["fallbacks"] == []

    wait_until(routed_with_redis, 30, 0.2, "routing with Redis again")
    # and prefix predictions are exact again (the engines resynced their KV index)
    r1 = ask(g, key, LONG + " again")

    def predicted_hit():
        r = ask(g, key, LONG + " again")
        return json.loads(r.headers["x-kvfleet-route"])["candidates"][0]["indexed_tokens"] > 0 and r

    r2 = wait_until(predicted_hit, 10, 0.1, "the replica's KV events to reach the new Redis")
    route = json.loads(r2.headers["x-kvfleet-route"])
    assert r1.status_code == 200
    assert (
        route["candidates"][0]["matched_tokens"]
        == r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        > 0
    )


def test_a_stale_fleet_snapshot_is_not_used_forever(fleet):
    g = fleet.start_gateway("--registry-max-staleness", "2")
    key = g.create_tenant("brief")
    assert ask(g, key).status_code == 200
    fleet.redis.stop()
    try:
        r = wait_until(lambda: (r := ask(g, key)).status_code == 503 and r, 20, 0.2, "the bound to pass")
        assert r.json()["error"]["code"] == "registry_unavailable" and r.headers["retry-after"]
        wait_until(lambda: httpx.get(f"{g.url}/ready").status_code == 503, 10, 0.2, "not ready")
        r = g.admin("POST", "/admin/tenants", json={"name": "while-down"})  # the admin API needs Redis itself
        assert r.status_code == 503 and r.json()["error"]["code"] == "registry_unavailable", r.text
    finally:
        fleet.redis.start()
        store = fleet.store()  # the next test needs the replicas registered again
        wait_until(lambda: len(store.live_replicas(MODEL)) == 2, 30, 0.2, "the replicas to re-register")
        for other in fleet.gateways:
            wait_until(lambda o=other: o.metric("kvfleet_gateway_replicas", model=MODEL, state="awake") == 2, 10,
                       0.1, "the gateways to see them")  # fmt: skip


def test_a_replica_dying_mid_stream_and_between_requests(fleet):
    g = fleet.gateway
    key = g.create_tenant("failover")
    # mid-stream: the client gets an SSE error event and the end of the stream, never a hang
    events = []
    with httpx.stream("POST", f"{g.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": MODEL, "prompt": "doomed", "max_tokens": 480, "stream": True, "ignore_eos": True}) as s:  # fmt: skip
        assert s.status_code == 200, s.read()
        victim = fleet.engine_for(s.headers["x-kvfleet-replica"])
        for line in s.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:
                    kill_tree(victim.proc.pid)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])
    assert err["error"]["code"] == "upstream_failed"
    # new requests avoid it at once (its heartbeat is still in Redis for a few seconds)
    for i in range(6):
        r = ask(g, key, f"after the crash {i}")
        assert r.status_code == 200, r.text
        assert r.headers["x-kvfleet-replica"].split("#")[0] != victim.url  # served by the survivor
    survivor = {e.url for e in fleet.engines} - {victim.url}
    assert len(survivor) == 1
    store = fleet.store()
    wait_until(lambda: len(store.live_replicas(MODEL)) == 1, 30, 0.2, "the dead replica to leave Redis")
    assert g.metric("kvfleet_gateway_upstream_errors_total", kind="midstream") >= 1
    # a second gateway that never saw the failure retries on the survivor before the first byte
    other = fleet.gateways[1]
    for i in range(3):
        assert ask(other, key, f"other gateway {i}").status_code == 200
