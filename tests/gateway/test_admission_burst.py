"""Admission under abuse: a real gateway, real Redis and a simulated replica (``engine serve --simulate``).

``max_concurrent`` holds under parallel bursts (the slot is taken inside the admission round trip) and
every slot comes back exactly once, however the request ended; tokens/min is reserved at admission and
settled to the real usage. Admitted streams are held open by their clients (a simulated decode step costs
50 ms, so a 480-token stream runs ~24 s unless its client leaves): the refusals of a burst cannot race
the admitted requests' ends.
"""

from __future__ import annotations

import queue
import threading
import time

import httpx
import msgspec
import pytest

from kvfleet_common import redis_keys
from kvfleet_common.schemas import ModelPolicy
from kvfleet_devkit.processes import free_port
from tests.gateway.gateway_harness import MODEL, Fleet, signed, wait_until

SIM = ("--simulate", "--sim-prefill-ms-per-1k-tokens", "0", "--sim-decode-ms-per-step", "50",
       "--sim-decode-ms-per-seq", "0", "--sim-step-overhead-ms", "0")  # fmt: skip
PROMPT = [100, 101, 102]  # token ids: the gateway's estimate of the prompt is exact (3 tokens)
LONG = {"prompt": PROMPT, "max_tokens": 480, "stream": True}


@pytest.fixture(scope="module")
def sim(demo_model, tmp_path_factory):
    """Redis, one simulated replica (SIM: a decode step costs 50 ms) and one gateway, for this module."""
    with Fleet(demo_model("llama", "tiny"), tmp_path_factory.mktemp("burst")) as f:
        f.start_engines(1, *SIM)
        f.start_gateway()
        yield f


def complete(gateway, key: str, **body) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **body})  # fmt: skip


class Burst:
    """``n`` requests sent at once (a barrier releases them together). An admitted stream stays open,
    after its first event, until ``close()`` (its client then leaves mid-stream); a refused or
    non-streamed request is read to its end. ``outcomes``: (status, JSON body or None, headers)."""

    def __init__(self, gateway, key: str, n: int, **body) -> None:
        self._results: queue.Queue = queue.Queue()
        self._leave = threading.Event()
        self._barrier = threading.Barrier(n)
        self._threads = [threading.Thread(target=self._one, args=(gateway.url, key, body)) for _ in range(n)]
        for t in self._threads:
            t.start()
        self.outcomes = [self._results.get(timeout=120) for _ in range(n)]
        errors = [o for o in self.outcomes if o[0] == "error"]
        assert not errors, errors

    def _one(self, url: str, key: str, body: dict) -> None:
        try:
            with httpx.Client(timeout=60) as client:
                self._barrier.wait(60)
                with client.stream("POST", f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                   json={"model": MODEL, **body}) as r:  # fmt: skip
                    if r.status_code == 200 and body.get("stream"):
                        chunks = r.iter_bytes()  # kept: a collected iterator closes the response
                        next(chunks)  # in flight: the replica is generating
                        self._results.put((200, None, r.headers))
                        self._leave.wait(120)
                        return  # leaves mid-stream
                    r.read()
                    self._results.put((r.status_code, r.json(), r.headers))
        except Exception as e:  # reported by the constructor
            self._results.put(("error", repr(e), None))

    def statuses(self) -> list:
        return sorted(o[0] for o in self.outcomes)

    def close(self) -> None:
        self._leave.set()
        for t in self._threads:
            t.join(60)


def leases(fleet, tenant: str) -> int:
    return fleet.store().client.zcard(redis_keys.inflight(tenant))


def window_tokens(fleet, tenant: str) -> int:
    """Tokens charged in all of the tenant's rate-limit windows (a test may straddle a minute)."""
    client = fleet.store().client
    return sum(int(client.hget(k, "tokens") or 0) for k in client.keys(f"kvf:ratelimit:{tenant}:*"))


def settled(fleet, tenant: str) -> bool:
    """Every request of the tenant ended and the gateway's reports took its lease and settlement along."""
    g = fleet.gateway
    return leases(fleet, tenant) == 0 and g.metric("kvfleet_gateway_inflight_requests", model=MODEL) == 0


def gateway_id(gateway) -> str:
    return httpx.get(f"{gateway.url}/health", timeout=10).json()["gateway_id"]


def assert_concurrency_429(outcome) -> None:
    status, body, headers = outcome
    assert status == 429 and headers["retry-after"] == "1"
    assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "rate_limit_error"
    assert "concurrent requests limit 5" in body["error"]["message"]


def test_a_parallel_burst_admits_exactly_max_concurrent_and_frees_the_slots_after(sim):
    g = sim.gateway
    key = g.create_tenant("burst", max_concurrent=5)
    for round_ in range(2):  # the second burst finds every slot of the first one free again
        burst = Burst(g, key, 30, **LONG)
        try:
            assert burst.statuses() == [200] * 5 + [429] * 25, round_
            for outcome in burst.outcomes:
                if outcome[0] == 429:
                    assert_concurrency_429(outcome)
            assert leases(sim, "burst") == 5
            assert g.metric("kvfleet_gateway_inflight_requests", model=MODEL) == 5
        finally:
            burst.close()  # the clients leave mid-stream: each slot released on the disconnect
        wait_until(lambda: settled(sim, "burst"), 20, 0.05, "the slots to be released")
    # 30 parallel non-streamed completions (each ~5 s of simulated decoding): 5 run, 25 are refused, and
    # the 5 finished ones free their slots
    burst = Burst(g, key, 30, prompt=PROMPT, max_tokens=100)
    assert burst.statuses() == [200] * 5 + [429] * 25
    assert all(o[1]["usage"]["completion_tokens"] == 100 for o in burst.outcomes if o[0] == 200)
    wait_until(lambda: settled(sim, "burst"), 20, 0.05, "the slots to be released")


def test_slots_are_released_exactly_once_on_finish_error_disconnect_and_retry(sim):
    g, store = sim.gateway, sim.store()
    key = g.create_tenant("once", max_concurrent=2)
    # finished: one after the other, each finds its predecessor's slot free at once (no 429, no waiting)
    for _ in range(4):
        assert complete(g, key).status_code == 200
    for _ in range(2):
        with httpx.stream("POST", f"{g.url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                          timeout=60, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}) as r:  # fmt: skip
            assert r.status_code == 200 and b"[DONE]" in r.read()
    # refused by the replica (a token id outside the vocabulary): an error, and the slot comes back
    for _ in range(3):
        r = complete(g, key, prompt=[10**7])
        assert r.status_code == 400, r.text
    # the client leaves mid-stream
    for _ in range(3):
        with httpx.stream("POST", f"{g.url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                          timeout=60, json={"model": MODEL, **LONG}) as r:  # fmt: skip
            assert r.status_code == 200
            next(r.iter_bytes())
        wait_until(lambda: settled(sim, "once"), 20, 0.05, "the disconnect to release the slot")
    # retried on another replica: a ghost that refuses connections ranks first every other request
    [live] = store.live_replicas(MODEL)
    nobody = f"http://127.0.0.1:{free_port()}"
    # signed like a genuine replica of the model (a forged one would never be routed to: test_forged_replica)
    ghost = signed(msgspec.structs.replace(live, replica_id="ghost#1", name="ghost", base_url=nobody,
                                           updated_at=time.time()))  # fmt: skip
    store.put_model_policy(ModelPolicy(model=MODEL, routing_policy="round-robin"))
    store.publish_heartbeat(ghost, ttl=120)
    try:
        wait_until(lambda: g.metric("kvfleet_gateway_replicas", model=MODEL, state="awake") == 2, 10, 0.05,
                   "the gateway to see the ghost")  # fmt: skip
        fallbacks = "kvfleet_gateway_routing_fallbacks_total"
        before = g.metric(fallbacks, model=MODEL, reason="retry_connect")
        for _ in range(2):  # round-robin: one of two consecutive requests tries the ghost first
            assert complete(g, key).status_code == 200
        assert g.metric(fallbacks, model=MODEL, reason="retry_connect") >= before + 1
    finally:
        store.deregister_replica("ghost#1")
        store.delete_model_policy(MODEL)
    # every path gave its slot back once: none leaked (the limit is still 2, not less) and none was freed
    # twice (not more)
    wait_until(lambda: settled(sim, "once"), 20, 0.05, "the slots to be released")
    load = redis_keys.gateway_load(gateway_id(g))  # the local count is back to 0, not below
    wait_until(lambda: store.client.hget(load, "t:once") is None, 10, 0.05, "the report of no request")
    burst = Burst(g, key, 10, **LONG)
    try:
        assert burst.statuses() == [200] * 2 + [429] * 8
    finally:
        burst.close()
    wait_until(lambda: settled(sim, "once"), 20, 0.05, "the slots to be released")


def test_a_token_burst_overruns_the_budget_by_less_than_one_estimate(sim):
    g = sim.gateway
    key = g.create_tenant("tpm-burst", tokens_per_minute=100)
    # Each request reserves 3 prompt + 5 completion tokens and uses exactly that (a simulated replica runs
    # to max_tokens). Not at the end of a minute: the sliding window would let the previous minute fade.
    wait_until(lambda: time.time() % 60 < 45, 20, 0.2, "a minute with room to spare")
    burst = Burst(g, key, 30, prompt=PROMPT, max_tokens=5)
    admitted = [o for o in burst.outcomes if o[0] == 200]
    # admitted while the window is below 100: 13 x 8 = 104 < 100 + 8 (the old after-the-fact charging
    # let all 30 through)
    assert len(admitted) == 13, burst.statuses()
    refused = [o for o in burst.outcomes if o[0] != 200]
    assert all(o[0] == 429 and "tokens per minute limit 100" in o[1]["error"]["message"] for o in refused)
    assert all(1 <= int(o[2]["retry-after"]) <= 120 for o in refused)
    used = sum(o[1]["usage"]["prompt_tokens"] + o[1]["usage"]["completion_tokens"] for o in admitted)
    assert used == 13 * 8
    wait_until(lambda: window_tokens(sim, "tpm-burst") == used, 10, 0.05, "the settlement")


def test_tokens_are_settled_to_real_usage(sim):
    g = sim.gateway
    key = g.create_tenant("settle", tokens_per_minute=100_000)
    first = complete(g, key, max_tokens=8)
    assert first.status_code == 200
    text = first.json()["choices"][0]["text"]
    # the same prompt again gives the same text (the simulation is deterministic): a stop string from its
    # middle ends the completion early, well under the 8 tokens reserved
    short = complete(g, key, max_tokens=8, stop=[text[len(text) // 2 :].strip()[:3]])
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] < 8
    rejected = complete(g, key, prompt=[10**7], max_tokens=8)  # reserved 9, refused by the replica: refunded
    assert rejected.status_code == 400
    used = sum(r.json()["usage"]["total_tokens"] for r in (first, short))
    wait_until(lambda: window_tokens(sim, "settle") == used, 10, 0.05, "the settlement")
    usage = g.admin("GET", "/admin/usage", params={"tenant": "settle"}).json()["data"]["settle"]["total"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == used and usage["requests"] == 2
    # a client leaving mid-stream never reports its usage: its reservation (3 + 480) stands as its charge
    with httpx.stream("POST", f"{g.url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                      timeout=60, json={"model": MODEL, **LONG}) as r:  # fmt: skip
        assert r.status_code == 200
        next(r.iter_bytes())
    wait_until(lambda: g.metric("kvfleet_gateway_inflight_requests", model=MODEL) == 0, 20, 0.05, "the end")
    wait_until(lambda: window_tokens(sim, "settle") == used + 483, 10, 0.05, "the reservation to stand")
