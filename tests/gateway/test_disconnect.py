"""A client that leaves a non-streaming request: the gateway drops the replica's connection (the engine
aborts the request) and frees the tenant's concurrency slot at once. Real processes: Redis, two simulated
replicas decoding a token every 100 ms (a 300-token answer takes ~30 s), the gateway."""

from __future__ import annotations

import time

import httpx
import pytest

from kvfleet_common import redis_keys
from tests.gateway.gateway_harness import MODEL, Fleet, wait_until
from tests.server.slow_requests import SLOW_DECODE, LeavingClient, running

BODY = {"model": MODEL, "prompt": [100, 101, 102], "ignore_eos": True}


@pytest.fixture(scope="module")
def slow_fleet(demo_model, tmp_path_factory):
    with Fleet(demo_model("llama", "tiny"), tmp_path_factory.mktemp("leaving")) as f:
        f.start_engines(2, *SLOW_DECODE)
        yield f


def complete(gateway, key: str, max_tokens: int) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={**BODY, "max_tokens": max_tokens})  # fmt: skip


def gateway(fleet, fast_path: bool):
    """A gateway serving the proxied endpoints ahead of FastAPI (``fast_path``), or through it."""
    if not fleet.gateways:  # started once for the module, both
        fleet.start_gateway()
        fleet.start_gateway("--no-fast-path")
    return fleet.gateways[0 if fast_path else 1]


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "fastapi"])
def test_leaving_a_non_streaming_request_frees_the_slot_and_the_engine_within_2_s(slow_fleet, fast_path):
    g = gateway(slow_fleet, fast_path)
    tenant = f"one-slot-{'fast' if fast_path else 'fastapi'}"
    key = g.create_tenant(tenant, max_concurrent=1)
    redis = slow_fleet.store().client
    assert complete(g, key, 1).status_code == 200  # warm: the tokenizer is loaded, the slot comes back
    wait_until(lambda: redis.zcard(redis_keys.inflight(tenant)) == 0, 10, 0.05, "the warm-up's slot")
    finished_499 = g.metric("kvfleet_gateway_requests_total", status="499")

    rid = f"leaves-{tenant}"
    client = LeavingClient(f"{g.url}/v1/completions", {**BODY, "max_tokens": 300},
                           {"Authorization": f"Bearer {key}", "x-request-id": rid})  # fmt: skip
    wait_until(lambda: sum(running(e) for e in slow_fleet.engines) == 1, 30, 0.05, "the replica to run it")
    assert g.metric("kvfleet_gateway_inflight_requests", model=MODEL) == 1
    refused = complete(g, key, 1)
    assert refused.status_code == 429 and "concurrent" in refused.json()["error"]["message"]

    client.leave()
    t0 = time.monotonic()
    wait_until(lambda: sum(running(e) for e in slow_fleet.engines) == 0, 2, 0.05, "the engine to abort it")
    wait_until(lambda: g.metric("kvfleet_gateway_inflight_requests", model=MODEL) == 0, 2, 0.05, "the gauge")
    wait_until(lambda: redis.zcard(redis_keys.inflight(tenant)) == 0, 2, 0.05, "the lease to go")
    assert time.monotonic() - t0 < 2.0
    assert complete(g, key, 1).status_code == 200  # the slot is free
    assert g.metric("kvfleet_gateway_requests_total", status="499") == finished_499 + 1
    assert f"{rid} tenant={tenant} model={MODEL} completions status=499" in g.log()
    wait_until(lambda: any(f"{rid} model={MODEL} status=499" in e.log() for e in slow_fleet.engines), 5, 0.1,
               "the engine's log line")  # fmt: skip
