"""A request that reached a replica is never sent to another one (nor again to the same): the replica may
be running it still. Only a request that could not be written anywhere (no connection) moves on.

End to end: a gateway with a 2 s upstream read timeout in front of two simulated replicas decoding a token
every 100 ms: a non-streaming answer of 100 tokens takes ~10 s. And the upstream pool itself, against a
plain socket server: an idle keep-alive connection the replica closed is not written to."""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time

import httpx
import pytest

from kvfleet_gateway.upstream import Upstream
from tests.gateway.gateway_harness import MODEL, Fleet, wait_until
from tests.server.slow_requests import SLOW_DECODE, running

READ_TIMEOUT_S = 2.0


@pytest.fixture
def slow_fleet(demo_model, tmp_path):
    with Fleet(demo_model("llama", "tiny"), tmp_path) as f:
        f.start_engines(2, *SLOW_DECODE)
        yield f


def test_a_replica_silent_past_the_read_timeout_gets_no_second_copy_of_the_request(slow_fleet):
    g = slow_fleet.start_gateway("--upstream-read-timeout", str(READ_TIMEOUT_S))
    key = g.create_tenant("patient")
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "prompt": [100, 101, 102], "ignore_eos": True}
    url = f"{g.url}/v1/completions"
    assert httpx.post(url, headers=headers, json={**body, "max_tokens": 1}, timeout=60).status_code == 200

    t0 = time.monotonic()
    r = httpx.post(url, headers={**headers, "x-request-id": "once-only"}, json={**body, "max_tokens": 100},
                   timeout=60)  # fmt: skip
    took = time.monotonic() - t0
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "upstream_timeout" and "not sent to another replica" in r.text
    assert READ_TIMEOUT_S <= took < READ_TIMEOUT_S + 3  # the watchdog looks once a second
    # the replica that had it aborted it (its connection was dropped); the other never saw it
    wait_until(lambda: sum(running(e) for e in slow_fleet.engines) == 0, 5, 0.05, "the abort")
    wait_until(lambda: any("once-only model=" in e.log() for e in slow_fleet.engines), 5, 0.1, "the log line")
    seen = [e for e in slow_fleet.engines if "once-only" in e.log()]
    assert len(seen) == 1 and "once-only model=tiny status=499" in seen[0].log()
    assert "once-only tenant=patient model=tiny completions status=504" in g.log()
    assert "attempts=1 " in g.log().split("once-only tenant=patient")[1].splitlines()[0]


class _Replica(threading.Thread):
    """A plain socket server on a thread: answers each request with keep-alive; after its first answer it
    closes that connection when ``close_idle`` is set (then sets ``closed``). ``requests``: per accepted
    connection, how many requests arrived on it."""

    ANSWER = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.requests: list[int] = []
        self.close_idle, self.closed = threading.Event(), threading.Event()
        self.start()

    def run(self) -> None:
        first, _ = self.listener.accept()
        self._answer(first)
        self.close_idle.wait(30)
        first.close()
        self.closed.set()
        second, _ = self.listener.accept()
        self._answer(second)
        second.close()

    def _answer(self, conn: socket.socket) -> None:
        self.requests.append(0)
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        self.requests[-1] += 1
        conn.sendall(self.ANSWER)


def test_an_idle_connection_the_replica_closed_is_not_written_to():
    replica = _Replica()
    url = f"http://127.0.0.1:{replica.port}/"

    async def scenario() -> None:
        up = Upstream(connect_timeout_s=2, read_timeout_s=5, max_connections=4)
        try:
            resp = await up.post(url, b"", {})
            assert await resp.read() == b"ok"
            resp.close()
            assert up.connections() == (0, 1)  # pooled
            # The replica closes the idle connection. The loop is held here (no await) until the FIN has
            # reached the socket: the pool has not seen it when the next request checks a connection out.
            replica.close_idle.set()
            assert replica.closed.wait(10)
            [[conn]] = up._idle.values()
            poller = select.poll()
            poller.register(conn.fd, select.POLLIN)
            deadline = time.monotonic() + 5
            while not poller.poll(0):
                assert time.monotonic() < deadline, "the FIN never arrived"
            assert not conn.closed
            resp = await up.post(url, b"", {})  # on a new connection; nothing was written to the old one
            assert await resp.read() == b"ok"
            resp.close()
        finally:
            await up.aclose()

    asyncio.run(scenario())
    replica.join(10)
    assert replica.requests == [1, 1]
