"""A real engine server announcing itself in a real Redis: heartbeats, KV index, tokenizer, sleep, drain."""

from __future__ import annotations

import signal
import time

import httpx

from kvfleet_common.fleet_store.store import FleetStore
from kvfleet_common.hashing import hash_blocks
from kvfleet_engine.tokenizer import load_tokenizer
from tests.server.server_harness import run_server


def wait_until(predicate, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    return predicate()


def test_replica_lifecycle_in_redis(demo_model, tmp_path, redis_server):
    model_dir = demo_model("llama", "tiny")
    store = FleetStore.from_url(redis_server.url)
    args = ("--max-model-len", "512", "--redis-url", redis_server.url, "--replica-name", "pod-a")
    with run_server(model_dir, tmp_path, *args) as server:
        [hb] = wait_until(lambda: [h for h in store.live_replicas("tiny") if h.state == "awake"])
        assert hb.name == "pod-a" and hb.replica_id.startswith("pod-a#")
        assert hb.base_url == server.url
        assert hb.block_size == 16 and hb.max_model_len == 512 and hb.num_kv_blocks > 0

        # the gateway can tokenize exactly like the engine from what the replica published
        files = store.fetch_tokenizer("tiny", hb.tokenizer_revision)
        assert files["tokenizer.json"] == (model_dir / "tokenizer.json").read_bytes()

        # after a request, the replica's cached blocks are in the index under the contract's hashes
        prompt = "The history of computing " * 10
        r = httpx.post(
            f"{server.url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2}
        )
        assert r.status_code == 200
        ids = load_tokenizer(model_dir).encode(prompt)
        hashes = hash_blocks(ids, 16)
        assert len(hashes) >= 3
        match = wait_until(lambda: store.prefix_match("tiny", hashes).get(hb.replica_id) == len(hashes))
        assert match
        # a salted request (another tenant) is cached under other hashes: no cross-tenant match
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "cache_salt": "tenant-b"},
        )
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        salted = hash_blocks(ids, 16, salt=b"tenant-b")
        assert wait_until(lambda: store.prefix_match("tiny", salted).get(hb.replica_id) == len(salted))

        # heartbeats carry measured rates once work was done
        assert wait_until(lambda: store.get_heartbeat(hb.replica_id).prefill_tokens_per_s > 0)

        # sleep empties the index and says so; wake brings the state back
        httpx.post(f"{server.url}/sleep?level=1", headers=server.admin_headers, timeout=30)
        assert wait_until(lambda: store.get_heartbeat(hb.replica_id).state == "sleeping")
        assert wait_until(lambda: store.prefix_match("tiny", hashes).get(hb.replica_id, 0) == 0)
        httpx.post(f"{server.url}/wake_up", headers=server.admin_headers, timeout=30)
        assert wait_until(lambda: store.get_heartbeat(hb.replica_id).state == "awake")

        # Redis restarts (data lost) while the engine serves: it keeps serving and re-registers
        redis_server.stop()
        r = httpx.post(
            f"{server.url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2}
        )
        assert r.status_code == 200
        redis_server.start()
        assert wait_until(lambda: [h for h in store.live_replicas("tiny") if h.replica_id == hb.replica_id])
        assert wait_until(lambda: store.prefix_match("tiny", hashes).get(hb.replica_id) == len(hashes))

        # SIGTERM: draining, then gone from Redis
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        assert store.live_replicas("tiny") == []
        assert store.prefix_match("tiny", hashes).get(hb.replica_id, 0) == 0
    store.close()
