"""``kvfleet engine serve --simulate``: the real server, scheduler, KV cache and Redis presence around a
timing model. A zero-cost replica (what the gateway-overhead benchmark uses) on the tiny demo model."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from kvfleet_common.fleet_store.store import FleetStore
from kvfleet_common.hashing import hash_blocks
from kvfleet_engine.tokenizer import load_tokenizer
from tests.server.server_harness import run_server

ZERO_COST = (
    "--simulate", "--sim-prefill-ms-per-1k-tokens", "0", "--sim-decode-ms-per-step", "0",
    "--sim-decode-ms-per-seq", "0", "--sim-step-overhead-ms", "0",
)  # fmt: skip


def wait_until(predicate, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    return predicate()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def chat(server, content: str, max_tokens: int = 12) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "sim", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens},
        timeout=30,
    )


def test_simulated_replica_serves_caches_and_sleeps(demo_model, tmp_path, redis_server):
    model_dir = demo_model("llama", "tiny")
    store = FleetStore.from_url(redis_server.url)
    # 8192 is above the tiny model's 4096 positions: allowed, since a simulated replica computes none.
    args = (*ZERO_COST, "--max-model-len", "8192", "--redis-url", redis_server.url, "--replica-name", "sim-a")
    with run_server(model_dir, tmp_path, *args, name="sim") as server:
        [hb] = wait_until(lambda: [h for h in store.live_replicas("sim") if h.state == "awake"])
        assert hb.max_model_len == 8192 and hb.num_kv_blocks == 4096
        assert "simulated replica" in server.log()

        # idle, the zero-cost core blocks instead of spinning
        core = server.core_pid()
        before = cpu_seconds(core)
        time.sleep(3)
        assert cpu_seconds(core) - before < 0.3

        question = "Tell me about the lighthouse keeper who counted the boats at dawn. " * 4
        first = chat(server, question)
        assert first.status_code == 200, first.text
        body = first.json()
        choice, usage = body["choices"][0], body["usage"]
        assert choice["message"]["content"].strip() and choice["finish_reason"] == "length"
        assert usage["completion_tokens"] == 12
        assert usage["total_tokens"] == usage["prompt_tokens"] + 12 and usage["prompt_tokens"] > 64
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0

        second = chat(server, question).json()
        assert second["choices"][0]["message"]["content"] == choice["message"]["content"]  # deterministic
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0 and cached % 16 == 0

        # the replica's KV blocks are in Redis under the contract's hashes
        prompt = "The history of computing " * 10
        r = httpx.post(
            f"{server.url}/v1/completions", json={"model": "sim", "prompt": prompt, "max_tokens": 3}
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        hashes = hash_blocks(load_tokenizer(model_dir).encode(prompt), 16)
        assert len(hashes) >= 3
        assert wait_until(lambda: store.prefix_match("sim", hashes).get(hb.replica_id) == len(hashes))
        assert wait_until(lambda: store.get_heartbeat(hb.replica_id).prefill_tokens_per_s > 0)
        weights = server.metric("kvfleet_engine_device_memory_bytes", kind="weights")
        assert weights > 0 and server.metric("kvfleet_engine_device_memory_bytes", kind="kv_cache") > 0

        # sleep: state and index follow, requests get 503, memory metrics drop; wake brings it all back
        r = httpx.post(f"{server.url}/sleep?level=1", headers=server.admin_headers, timeout=30)
        assert r.status_code == 200
        assert wait_until(lambda: store.get_heartbeat(hb.replica_id).state == "sleeping")
        assert wait_until(lambda: store.prefix_match("sim", hashes).get(hb.replica_id, 0) == 0)
        assert chat(server, question).status_code == 503
        assert server.metric("kvfleet_engine_device_memory_bytes", kind="weights") == 0
        r = httpx.post(f"{server.url}/wake_up", headers=server.admin_headers, timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "awake"
        assert wait_until(lambda: store.get_heartbeat(hb.replica_id).state == "awake")
        assert server.metric("kvfleet_engine_device_memory_bytes", kind="weights") == weights
        again = chat(server, question).json()
        assert again["choices"][0]["message"]["content"] == choice["message"]["content"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # sleep emptied the cache

        # SIGTERM drains and deregisters, as for a real replica
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        assert store.live_replicas("sim") == []
    store.close()
