"""The ugly cases: clients vanishing mid-stream, sleep/wake under traffic, a dead core, SIGTERM (with
requests that outlive ``--shutdown-timeout``)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvfleet_common.fleet_store.store import FleetStore
from tests.server.server_harness import alive, cmdline, descendants_of, run_server
from tests.server.slow_requests import SLOW_DECODE, LeavingClient, SseStream, running, sigterm_exits_within

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a long story about bread."}]}


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def all_blocks_free(server) -> bool:
    m = server.metrics()
    label = '{model_name="tiny"}'
    return (
        m[f"kvfleet_engine_num_requests_running{label}"] == 0
        and m[f"kvfleet_engine_num_requests_waiting{label}"] == 0
        and m[f"kvfleet_engine_kv_cache_free_blocks{label}"]
        == m[f"kvfleet_engine_kv_cache_blocks{label}"] - 1
    )


class BackgroundStream:
    """A streamed completion read on a thread: ``lines`` fill in as they arrive, ``started`` is set at
    the first one, ``join()`` waits for the end of the stream."""

    def __init__(self, server, max_tokens: int) -> None:
        self.lines: list[str] = []
        self.started = threading.Event()
        body = {"model": "tiny", "prompt": "x", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self._thread = threading.Thread(target=self._read, args=(f"{server.url}/v1/completions", body))
        self._thread.start()
        assert self.started.wait(30), "the stream never started"

    def _read(self, url: str, body: dict) -> None:
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    self.lines.append(line)
                    self.started.set()

    def join(self, timeout: float = 30) -> list[str]:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream hung"
        return self.lines


def test_fifty_streams_cut_at_random_points_free_every_block(server):
    rng = random.Random(0)

    async def one(i: int, client: httpx.AsyncClient) -> None:
        cut_after = rng.randint(0, 12)  # 0: gone before the first token
        body = {**CHAT, "max_tokens": 64, "stream": True, "ignore_eos": True, "n": 1 + i % 3}
        body["messages"] = [{"role": "user", "content": f"story {i} " + "about bread " * (i % 7 * 5)}]
        async with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen > cut_after:
                        break  # leaving the block closes the connection mid-stream

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*(one(i, client) for i in range(50)))

    asyncio.run(main())
    assert wait_until(lambda: all_blocks_free(server)), server.metrics()
    # and the server still works
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_non_streaming_client_disconnect_aborts(server):
    body = {**CHAT, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=0.3)
    assert wait_until(lambda: all_blocks_free(server)), server.metrics()


def completion(server, **kw) -> httpx.Response:
    body = {"model": "tiny", "prompt": "The history of computing", "max_tokens": 12, "temperature": 0, **kw}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_memory_and_wake_restores_outputs(server, level):
    before = completion(server).json()["choices"][0]["text"]
    weights = server.metric("kvfleet_engine_device_memory_bytes", kind="weights")
    kv = server.metric("kvfleet_engine_device_memory_bytes", kind="kv_cache")
    assert weights > 0 and kv > 0

    # a request in flight when sleep arrives is ended cleanly (error event), not hung
    stream = BackgroundStream(server, max_tokens=500)
    r = httpx.post(f"{server.url}/sleep?level={level}", headers=server.admin_headers, timeout=60)
    assert r.status_code == 200, r.text
    lines = stream.join()
    assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]"

    assert httpx.get(f"{server.url}/is_sleeping", headers=server.admin_headers).json() == {
        "is_sleeping": True
    }
    assert httpx.get(f"{server.url}/health").json()["state"] == "sleeping"
    assert server.metric("kvfleet_engine_device_memory_bytes", kind="kv_cache") == 0
    if level == 2:
        assert server.metric("kvfleet_engine_device_memory_bytes", kind="weights") == 0
    else:
        # on CPU the host *is* the device: level 1 keeps the weights where they are, frees the KV cache
        assert server.metric("kvfleet_engine_device_memory_bytes", kind="weights") == weights
    assert server.metric("kvfleet_engine_sleep_level") == level

    asleep = completion(server)
    assert asleep.status_code == 503 and asleep.headers["retry-after"]
    assert asleep.json()["error"]["code"] == "model_sleeping"
    # sleeping twice is harmless
    assert httpx.post(f"{server.url}/sleep?level={level}", headers=server.admin_headers).status_code == 200

    # wake in two steps, as an RLHF loop would
    r = httpx.post(f"{server.url}/wake_up?tags=weights", headers=server.admin_headers, timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "sleeping"
    assert completion(server).status_code == 503
    r = httpx.post(f"{server.url}/wake_up?tags=kv_cache", headers=server.admin_headers, timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "awake"
    assert server.metric("kvfleet_engine_device_memory_bytes", kind="weights") == weights
    assert server.metric("kvfleet_engine_device_memory_bytes", kind="kv_cache") == kv
    after = completion(server)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == before
    assert all_blocks_free(server)


def test_dead_core_turns_health_red_and_requests_fail_fast(demo_model, tmp_path):
    with run_server(demo_model("llama", "tiny"), tmp_path, "--max-model-len", "2048") as server:
        core = server.core_pid()
        stream = BackgroundStream(server, max_tokens=2000)
        os.kill(core, signal.SIGKILL)
        lines = stream.join(20)
        assert '"error"' in lines[-2] and "engine" in lines[-2] and lines[-1] == "data: [DONE]"
        assert not any('"finish_reason":"length"' in line for line in lines)

        assert wait_until(lambda: httpx.get(f"{server.url}/health").status_code == 503, timeout=10)
        t0 = time.monotonic()
        r = completion(server)
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 5
        assert server.metric("kvfleet_engine_healthy") == 0
        assert not alive(core)


def test_sigterm_finishes_in_flight_requests_then_exits(demo_model, tmp_path):
    with run_server(demo_model("llama", "tiny"), tmp_path, "--max-model-len", "256") as server:
        stream = BackgroundStream(server, max_tokens=200)
        server.proc.send_signal(signal.SIGTERM)
        lines = stream.join()
        assert lines[-1] == "data: [DONE]"
        assert any('"finish_reason":"length"' in line for line in lines), lines[-3:]  # completed, not aborted
        assert server.proc.wait(30) == 0
        assert "draining" in server.log()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health", timeout=2)
        for pid in server.descendants:
            assert wait_until(lambda pid=pid: not alive(pid), timeout=10), f"{pid} outlived the server"


def test_parent_sigkill_takes_the_core_down_and_leaves_no_socket_files(demo_model, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()

    def server_files() -> list[str]:
        return [p.name for p in tmp.glob("kvfleet-core-*")]

    with run_server(
        demo_model("llama", "tiny"), tmp_path, "--max-model-len", "256", env={"TMPDIR": str(tmp)}
    ) as server:
        core = server.core_pid()
        # No named semaphore that only the resource tracker would remove (tqdm's default lock made one).
        assert "/dev/shm/sem." not in Path(f"/proc/{core}/maps").read_text()
        # Once the core has connected, its sockets' directory goes; the connections serve on.
        assert wait_until(lambda: not server_files(), timeout=10), server_files()
        assert completion(server).status_code == 200
        server.proc.kill()
        server.proc.wait(10)
        assert wait_until(lambda: not alive(core), timeout=10), "the engine core outlived its API server"
    assert not server_files()


def test_tensor_parallel_server_matches_and_a_dead_worker_fails_the_replica(demo_model, tmp_path, server):
    """The server runs TP=2 (one worker process per rank) with the same greedy outputs; SIGKILL of one
    worker turns the replica unhealthy within seconds and leaves no process behind."""
    expected = completion(server).json()["choices"][0]["text"]
    with run_server(
        demo_model("llama", "tiny"), tmp_path, "--max-model-len", "512", "--tensor-parallel-size", "2"
    ) as tp_server:
        assert completion(tp_server).json()["choices"][0]["text"] == expected
        core = tp_server.core_pid()
        workers = [p for p in descendants_of(core) if "spawn_main" in cmdline(p)]
        assert len(workers) == 2, workers
        assert not any("/dev/shm/sem." in Path(f"/proc/{pid}/maps").read_text() for pid in workers)
        os.kill(workers[1], signal.SIGKILL)
        assert wait_until(lambda: httpx.get(f"{tp_server.url}/health").status_code == 503, timeout=10)
        r = completion(tp_server)
        assert r.status_code == 503 and "worker" in r.json()["error"]["message"]
        for pid in [core, *workers]:
            assert wait_until(lambda pid=pid: not alive(pid), timeout=10), f"{pid} outlived its engine"


def test_sigterm_past_the_shutdown_timeout_ends_every_request_readably(demo_model, tmp_path, redis_server):
    """A simulated replica decoding a token every 100 ms: 400-token requests outlive a 2 s timeout."""
    timeout_s = 2.0
    store = FleetStore.from_url(redis_server.url)
    args = (*SLOW_DECODE, "--max-model-len", "512", "--shutdown-timeout", str(timeout_s),
            "--redis-url", redis_server.url, "--replica-name", "drained")  # fmt: skip
    with run_server(demo_model("llama", "tiny"), tmp_path, *args, name="sim") as server:
        assert wait_until(lambda: store.live_replicas("sim"), 30)
        url = f"{server.url}/v1/completions"
        body = {"model": "sim", "prompt": [100, 101, 102], "max_tokens": 400, "ignore_eos": True}
        streams = [SseStream(url, body) for _ in range(8)]
        answer: list[httpx.Response] = []
        whole = threading.Thread(target=lambda: answer.append(httpx.post(url, json=body, timeout=60)))
        whole.start()
        for s in streams:
            s.wait_started()
        short = SseStream(url, {**body, "max_tokens": 5})  # ends within the timeout: finished, not cut
        short.wait_started()
        assert wait_until(lambda: running(server) == 10, 10, 0.05), running(server)

        sigterm_exits_within(server.proc, timeout_s + 2)

        short.assert_finished()
        for s in streams:
            assert s.cut_error()["code"] == "replica_shutting_down"
        whole.join(10)
        assert answer[0].status_code == 503 and answer[0].json()["error"]["code"] == "replica_shutting_down"
        assert answer[0].headers["retry-after"] == "1"
        assert store.live_replicas("sim") == []  # deregistered
        for pid in server.descendants:
            assert wait_until(lambda pid=pid: not alive(pid), timeout=10), f"{pid} outlived the server"
    store.close()


def test_a_client_leaving_a_non_streaming_request_has_it_aborted_within_2_s(demo_model, tmp_path):
    with run_server(demo_model("llama", "tiny"), tmp_path, *SLOW_DECODE, "--max-model-len", "512") as server:
        body = {"model": "tiny", "prompt": [100, 101, 102], "max_tokens": 300, "ignore_eos": True}
        client = LeavingClient(f"{server.url}/v1/completions", body, {"x-request-id": "left-behind"})
        assert wait_until(lambda: running(server) == 1, 30, 0.05)
        client.leave()
        t0 = time.monotonic()
        assert wait_until(lambda: running(server) == 0, 2.0, 0.05), "the engine still runs the request"
        assert time.monotonic() - t0 < 2.0
        assert wait_until(lambda: "left-behind model=tiny status=499" in server.log(), 5), server.log()[-999:]
