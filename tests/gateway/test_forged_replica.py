"""A replica registered by someone who can write Redis but holds no key of the model never receives traffic
or a credential: real Redis, real engines (signing with the model's key), a real gateway (holding the root),
and a fake "replica" that records every request it gets."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest

from kvfleet_common.schemas import Heartbeat, ModelPolicy
from tests.gateway.gateway_harness import MODEL, engine_admin_token, model_key, signed, wait_until
from tests.server.server_harness import ADMIN_TOKEN


class RecordingReplica:
    """An HTTP server that answers anything with 200 and records (method, path, headers) of every request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                recorder.requests.append((self.command, self.path, dict(self.headers)))
                self.rfile.read(int(self.headers.get("content-length") or 0))
                body = json.dumps({"status": "awake"}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_replica() -> Iterator[RecordingReplica]:
    rec = RecordingReplica()
    try:
        yield rec
    finally:
        rec.close()


def forged(genuine: Heartbeat, name: str, url: str, state: str = "awake", **changes) -> Heartbeat:
    now = time.time()
    fields = {"replica_id": f"{name}#{int(now * 1000)}", "name": name, "base_url": url, "state": state,
              "running": 0, "waiting": 0, "kv_usage": 0.0, "updated_at": now}  # fmt: skip
    return msgspec.structs.replace(genuine, **(fields | changes))


def test_forged_replicas_get_no_traffic_and_no_credentials(fleet, fake_replica):
    g, store = fleet.gateway, fleet.store()
    tenant_key = g.create_tenant("forgery-victim")
    genuine = store.live_replicas(MODEL)
    assert len(genuine) == 2 and all(hb.signature for hb in genuine)
    url = fake_replica.url
    fakes = [
        forged(genuine[0], "unsigned", url, signature=""),
        signed(forged(genuine[0], "other-models-key", url), key=model_key("another-model")),
        # a genuine heartbeat redirected: the copied signature does not cover the new URL
        msgspec.structs.replace(genuine[0], replica_id="redirected#1", name="redirected", base_url=url),
        # signed with the right key long ago (a captured heartbeat, replayed): stale
        signed(forged(genuine[0], "replayed", url, updated_at=time.time() - 600)),
        forged(genuine[0], "sleeper", url, state="sleeping", signature=""),  # a target for wake calls
    ]
    # round-robin: were a fake in the snapshot, every other request would go to it
    store.put_model_policy(ModelPolicy(model=MODEL, routing_policy="round-robin"))
    for hb in fakes:
        store.publish_heartbeat(hb, ttl=300)
    try:
        wait_until(lambda: g.metric("kvfleet_gateway_unverified_replicas", model=MODEL) == len(fakes), 20, 0.1,
                   "the gateway to count the forged replicas")  # fmt: skip
        assert g.metric("kvfleet_gateway_replicas", model=MODEL, state="awake") == 2

        headers = {"Authorization": f"Bearer {tenant_key}"}
        for i in range(8):
            r = httpx.post(f"{g.url}/v1/chat/completions", headers=headers, timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 2})  # fmt: skip
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text

        [listed] = [m for m in g.admin("GET", "/admin/models").json()["data"] if m["name"] == MODEL]
        assert sorted(rep["id"] for rep in listed["replicas"]) == sorted(hb.replica_id for hb in genuine)
        assert listed["unverified_replicas"] == len(fakes)

        # admin calls: the model's sleep reaches the genuine replicas only, with the model's derived token
        # (the engines hold that one, not the platform token: a 200 proves which was sent)
        r = g.admin("POST", f"/admin/models/{MODEL}/sleep", params={"level": 1})
        assert r.status_code == 200 and sorted(r.json()["replicas"]) == sorted(
            hb.replica_id for hb in genuine
        )
        for name in ("unsigned", "sleeper", "redirected"):
            assert g.admin("POST", f"/admin/models/{MODEL}/replicas/{name}/wake").status_code == 404
        wait_until(lambda: g.metric("kvfleet_gateway_replicas", model=MODEL, state="sleeping") == 2, 20, 0.1,
                   "the gateway to see the genuine replicas asleep")  # fmt: skip
        # wake-on-request: the wake goes to the genuine sleepers, never to the forged sleeper
        r = httpx.post(f"{g.url}/v1/chat/completions", headers=headers, timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "wake up"}], "max_tokens": 2})  # fmt: skip
        assert r.status_code == 200, r.text
        assert g.metric("kvfleet_gateway_wakes_total", model=MODEL, outcome="woke") >= 1
    finally:
        for hb in fakes:
            store.deregister_replica(hb.replica_id)
        store.delete_model_policy(MODEL)
    assert fake_replica.requests == []  # no request, so no Authorization header, ever reached it
    log = g.log()
    for hb in fakes:
        assert hb.replica_id in log
    assert (
        "does not verify" in log
        and "bad signature" in log
        and "unsigned" in log
        and "stale or replayed" in log
    )


def test_the_engines_admin_token_is_the_models_not_the_platforms(fleet):
    e = fleet.engines[0]
    assert e.admin_token == engine_admin_token() != ADMIN_TOKEN
    r = httpx.get(f"{e.url}/is_sleeping", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
    assert r.status_code == 401  # the platform admin token opens no engine
    assert httpx.get(f"{e.url}/is_sleeping", headers=e.admin_headers, timeout=10).status_code == 200
