"""Scale from zero at the gateway: a request for a model that has no replica yet, and whose policy says it is
autoscaled (``ModelPolicy.scale_from_zero``), is held until a replica is awake, and the hold is demand in Redis
(``mh:<model>`` in the gateway's load hash, summed by ``FleetStore.model_load``) whichever gateway holds it.

Real processes: Redis, three gateways, and a simulated engine replica (``engine serve --simulate``) that is
started only once the requests are held, as the operator would start one.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from kvfleet_common import redis_keys
from kvfleet_common.schemas import ModelPolicy
from tests.gateway.gateway_harness import MODEL, Fleet, wait_until
from tests.server.slow_requests import SLOW_DECODE

NEVER = "never-started"  # scales from zero, but no replica of it ever comes
FIXED = "fixed-size"  # a policy without scale_from_zero and no replica: today's 503 at once
HOLDS = "kvfleet_gateway_holds_total"


@pytest.fixture(scope="module")
def cold(demo_model, tmp_path_factory):
    """Redis with three model policies and no replica; gateways ``a`` and ``a2`` wait up to 300 s for one,
    gateway ``short`` 1.5 s; ``key``: a tenant's API key."""
    with Fleet(demo_model("llama", "tiny"), tmp_path_factory.mktemp("cold")) as f:
        store = f.store()
        store.put_model_policy(ModelPolicy(model=MODEL, scale_from_zero=True))
        store.put_model_policy(ModelPolicy(model=NEVER, scale_from_zero=True))
        store.put_model_policy(ModelPolicy(model=FIXED))
        a = f.start_gateway("--wake-timeout", "300", "--gateway-id", "gw-a")
        a2 = f.start_gateway("--wake-timeout", "300", "--gateway-id", "gw-a2")
        short = f.start_gateway("--wake-timeout", "1.5", "--gateway-id", "gw-short")
        yield SimpleNamespace(fleet=f, store=store, a=a, a2=a2, short=short, key=a.create_tenant("scaler"))


def chat(gateway, key: str, model: str = MODEL, **body) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      timeout=300, json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 2, **body})  # fmt: skip


def held_field(store, gateway_id: str, model: str) -> int:
    """The gateway's published count of requests it holds for ``model`` (a zero is left out of the hash)."""
    value = store.client.hget(redis_keys.gateway_load(gateway_id), redis_keys.LOAD_FIELD_MODEL_HELD + model)
    return int(value or 0)


def still_held(*requests: Future) -> None:
    for f in requests:
        assert not f.done(), f"a held request ended before any replica came: {f.result().text}"


def test_held_until_a_replica_is_awake_then_served_and_in_flight(cold):
    store, a, a2 = cold.store, cold.a, cold.a2
    assert store.live_replicas(MODEL) == []
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(chat, a, cold.key)
        # (a) held: in this gateway's load hash, in the summed model load, in its per-model gauge
        wait_until(lambda: held_field(store, "gw-a", MODEL) == 1, 30, 0.02, "gw-a to publish mh:tiny=1")
        wait_until(lambda: store.model_load(MODEL).held == 1, 10, 0.02, "model_load to count the hold")
        wait_until(lambda: a.metric("kvfleet_gateway_model_requests_held", model=MODEL) == 1, 10, 0.05,
                   "gw-a's held gauge")  # fmt: skip
        # (d) another gateway holds one too: both are demand in Redis, summed for the operator
        second = pool.submit(chat, a2, cold.key)
        load = wait_until(
            lambda: (x := store.model_load(MODEL)).held == 2 and x, 30, 0.02, "both holds summed"
        )
        assert load.gateways >= 2 and load.in_flight == 0
        assert held_field(store, "gw-a", MODEL) == held_field(store, "gw-a2", MODEL) == 1
        still_held(first, second)

        cold.fleet.start_engines(1, *SLOW_DECODE)  # the replica appears only now (starting, then awake)
        answers = [first.result(timeout=300), second.result(timeout=300)]
    for r in answers:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
    for g in (a, a2):
        assert g.metric(HOLDS, model=MODEL, kind="cold_start", outcome="served") == 1
        assert g.metric(HOLDS, model=MODEL, outcome="timeout") == 0
        assert g.metric("kvfleet_gateway_hold_seconds_count", model=MODEL, kind="cold_start") == 1
        assert g.metric("kvfleet_gateway_model_requests_held", model=MODEL) == 0
    wait_until(lambda: held_field(store, "gw-a", MODEL) == held_field(store, "gw-a2", MODEL) == 0, 10, 0.02,
               "the holds to be unpublished")  # fmt: skip
    assert store.model_load(MODEL).held == 0

    # (e) in flight: a long stream on the (simulated, 100 ms a token) replica, left after its first event
    with httpx.stream("POST", f"{a.url}/v1/completions", headers={"Authorization": f"Bearer {cold.key}"},
                      timeout=60, json={"model": MODEL, "prompt": [100, 101, 102], "max_tokens": 400,
                                        "ignore_eos": True, "stream": True}) as r:  # fmt: skip
        assert r.status_code == 200
        events = r.iter_bytes()  # kept: a collected iterator would close the response (the client leaving)
        next(events)
        assert a.metric("kvfleet_gateway_model_requests_in_flight", model=MODEL) == 1
        assert a.metric("kvfleet_gateway_model_requests_held", model=MODEL) == 0
        load_key = redis_keys.gateway_load("gw-a")
        wait_until(lambda: store.client.hget(load_key, redis_keys.LOAD_FIELD_MODEL_REQUESTS + MODEL) == b"1", 10,
                   0.02, "gw-a to publish mi:tiny=1")  # fmt: skip
        assert store.model_load(MODEL).in_flight == 1
    wait_until(lambda: a.metric("kvfleet_gateway_model_requests_in_flight", model=MODEL) == 0, 10, 0.05,
               "the stream's end")  # fmt: skip
    wait_until(lambda: store.model_load(MODEL).in_flight == 0, 10, 0.02, "the stream's end to be published")

    # a wake is a hold too (its own kind): the model put to sleep, a request wakes it and is served
    assert a.admin("POST", f"/admin/models/{MODEL}/sleep", params={"level": 1}).status_code == 200
    wait_until(lambda: a.metric("kvfleet_gateway_replicas", model=MODEL, state="sleeping") == 1, 20, 0.05,
               "gw-a to see the replica asleep")  # fmt: skip
    assert chat(a, cold.key).status_code == 200
    assert a.metric(HOLDS, model=MODEL, kind="wake", outcome="served") == 1
    assert a.metric("kvfleet_gateway_model_requests_held", model=MODEL) == 0


def test_no_replica_within_the_wake_timeout_is_a_clear_503(cold):
    g = cold.short
    r = chat(g, cold.key, NEVER)
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "30"
    err = r.json()["error"]
    assert (
        err["code"] == "model_cold_start" and "scaled to zero" in err["message"] and NEVER in err["message"]
    )
    assert g.metric(HOLDS, model=NEVER, kind="cold_start", outcome="timeout") == 1
    assert g.metric(HOLDS, model=NEVER, outcome="served") == 0
    assert g.metric("kvfleet_gateway_rejected_requests_total", reason="cold_start_timeout") == 1
    assert g.metric("kvfleet_gateway_model_requests_held", model=NEVER) == 0
    wait_until(lambda: held_field(cold.store, "gw-short", NEVER) == 0, 10, 0.02, "the hold to be unpublished")


def test_a_model_that_does_not_scale_from_zero_gets_no_replica_without_a_hold(cold):
    g = cold.a
    before = g.metric("kvfleet_gateway_rejected_requests_total", reason="no_replica")
    r = chat(g, cold.key, FIXED)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "no_replica" and r.headers["retry-after"] == "5"
    assert g.metric("kvfleet_gateway_rejected_requests_total", reason="no_replica") == before + 1
    assert g.metric(HOLDS, model=FIXED) == 0  # never held
    assert g.metric("kvfleet_gateway_hold_seconds_count", model=FIXED) == 0
    # known (by its policy alone), so listed with a zero gauge, not a 404
    assert 'kvfleet_gateway_model_requests_held{model="fixed-size"}' in g.metrics()


def test_shutdown_during_a_hold_answers_503_gateway_shutdown(cold):
    g = cold.fleet.start_gateway(
        "--wake-timeout", "300", "--shutdown-grace", "0.5", "--gateway-id", "gw-stop"
    )
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(chat, g, cold.key, NEVER)
        wait_until(
            lambda: held_field(cold.store, "gw-stop", NEVER) == 1, 30, 0.02, "gw-stop to publish the hold"
        )
        assert g.stop() == 0  # SIGTERM: the hold outlives the grace period
        r = held.result(timeout=60)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "gateway_shutdown" and r.headers["retry-after"] == "1"
    assert not cold.store.client.exists(redis_keys.gateway_load("gw-stop"))  # its demand left with it
    assert "Exception in ASGI application" not in g.log()
