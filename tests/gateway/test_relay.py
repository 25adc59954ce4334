"""SseRelay and the upstream client's streaming side, against a real socket server that sends an SSE body
in awkward pieces, and an ASGI ``send``/``receive`` pair standing in for the HTTP server."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvfleet_gateway.relay import SseRelay
from kvfleet_gateway.upstream import Upstream, UpstreamTimeout
from tests.sse_server import SseServer

USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}
EVENTS = [
    b'data: {"choices":[{"text":"a"}],"usage":null}\n\n',
    b'data: {"choices":[{"text":"b"}],"usage":null}\n\n',
    b'data: {"choices":[{"text":"c"}],"usage":null}\n\n',
    b'data: {"choices":[],"usage":' + json.dumps(USAGE, separators=(",", ":")).encode() + b"}\n\n",
    b"data: [DONE]\n\n",
]


class Client:
    """The HTTP server's side of the ASGI response: what was sent, and a receive that reports a disconnect
    when ``leave`` is set."""

    def __init__(self, block_on: int | None = None) -> None:
        self.bodies: list[bytes] = []
        self.leave = asyncio.Event()
        self.unblock = asyncio.Event()
        self.block_on = block_on  # the send of this body (0-based) waits until ``unblock``

    async def send(self, message: dict) -> None:
        if len(self.bodies) == self.block_on:
            await self.unblock.wait()  # as uvicorn's send does while the client's socket is full
        self.bodies.append(message["body"])

    async def receive(self) -> dict:
        await self.leave.wait()
        return {"type": "http.disconnect"}


def _split_everywhere(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("piece_size", [1, 7, 1000])
@pytest.mark.parametrize("keep_usage", [True, False])
def test_events_cut_anywhere_arrive_whole_in_order_and_the_usage_event_is_read(piece_size, keep_usage):
    async def scenario() -> None:
        body = b"".join(EVENTS)
        async with SseServer(_split_everywhere(body, piece_size)) as url:
            up = Upstream(connect_timeout_s=2, read_timeout_s=5, max_connections=4)
            client, firsts = Client(), []
            resp = await up.post(url, b"{}", {"content-type": "application/json"})
            relay = SseRelay(resp, client.send, keep_usage, lambda: firsts.append(len(client.bodies)))
            assert await relay.run(client.receive) == "complete"
            resp.close()
            assert up.connections() == (0, 1)  # read to the end: kept for the next request
            await up.aclose()
        expected = [e for e in EVENTS if keep_usage or b'"usage":{' not in e]
        assert b"".join(client.bodies) == b"".join(expected)
        assert all(b.endswith(b"\n\n") for b in client.bodies)  # never half an event
        assert relay.usage == USAGE and relay.tail == b""
        assert firsts == [0]  # once, before the first event went out

    asyncio.run(scenario())


def test_events_that_arrive_together_go_to_the_client_in_one_write():
    """The engine writes one chunk per event; a read holding several (the role event and the first token,
    the last token with the usage and [DONE]) becomes one body for the client: one syscall, one segment."""

    async def scenario() -> None:
        async with SseServer(EVENTS, one_write=True) as url:
            up = Upstream(connect_timeout_s=2, read_timeout_s=5, max_connections=4)
            client = Client()
            resp = await up.post(url, b"{}", {})
            relay = SseRelay(resp, client.send, False, lambda: None)
            assert await relay.run(client.receive) == "complete"
            resp.close()
            assert up.connections() == (0, 1)
            await up.aclose()
        assert client.bodies == [b"".join(e for e in EVENTS if b'"usage":{' not in e)]
        assert relay.usage == USAGE

    asyncio.run(scenario())


def test_a_client_that_cannot_keep_up_pauses_the_replica_and_loses_nothing():
    async def scenario() -> None:
        async with SseServer(EVENTS, gap_s=0.01) as url:
            up = Upstream(connect_timeout_s=2, read_timeout_s=5, max_connections=4)
            client = Client(block_on=1)
            resp = await up.post(url, b"{}", {})
            relay = SseRelay(resp, client.send, True, lambda: None)
            run = asyncio.ensure_future(relay.run(client.receive))
            await asyncio.sleep(0.2)  # the replica has sent everything; the client took one event
            assert len(client.bodies) == 1 and resp._conn.reading_paused
            client.unblock.set()
            assert await run == "complete"
            resp.close()
            await up.aclose()
        assert b"".join(client.bodies) == b"".join(EVENTS)

    asyncio.run(scenario())


def test_a_client_that_leaves_drops_the_replica_connection():
    async def scenario() -> None:
        server = SseServer(EVENTS, stall_after=2)
        async with server as url:
            up = Upstream(connect_timeout_s=2, read_timeout_s=30, max_connections=1)
            client = Client()
            resp = await up.post(url, b"{}", {})
            relay = SseRelay(resp, client.send, True, lambda: None)
            run = asyncio.ensure_future(relay.run(client.receive))
            await asyncio.sleep(0.1)
            client.leave.set()
            assert await run == "client_gone"
            resp.close()  # what the proxy does when the response is over
            await asyncio.wait_for(server.eof_seen.wait(), 5)  # the engine sees the client go: it aborts
            assert up.connections() == (0, 0)  # dropped
            again = await asyncio.wait_for(up.post(url, b"{}", {}), 5)  # and its one slot free again
            again.close(abort=True)
            await up.aclose()
        assert b"".join(client.bodies) == b"".join(EVENTS[:2])

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("leave_after", "stuck"), [(len(EVENTS) - 1, False), (len(EVENTS), False), (len(EVENTS), True)]
)
def test_a_client_that_leaves_after_done_got_the_whole_stream(leave_after, stuck):
    """Clients often hang up as soon as they read ``[DONE]`` (before the chunked body's end): that stream
    ended (``ended_stream``: the proxy logs it 200); one that leaves before ``[DONE]`` did not."""

    async def scenario() -> bool:
        server = SseServer(EVENTS, gap_s=0.02, stall_after=leave_after)  # one event per body
        async with server as url:
            up = Upstream(connect_timeout_s=2, read_timeout_s=30, max_connections=4)
            client = Client(block_on=len(EVENTS) - 1 if stuck else None)
            resp = await up.post(url, b"{}", {})
            relay = SseRelay(resp, client.send, True, lambda: None)
            run = asyncio.ensure_future(relay.run(client.receive))
            await asyncio.sleep(0.1 + 0.02 * len(EVENTS))
            client.leave.set()
            assert await run == "client_gone"
            resp.close()
            await up.aclose()
        assert b"".join(client.bodies) == b"".join(EVENTS[: len(EVENTS) - 1 if stuck else leave_after])
        return relay.ended_stream

    # stuck: the client stopped reading before [DONE] (its send never returns), then left: not complete
    assert asyncio.run(scenario()) is (leave_after == len(EVENTS) and not stuck)


def test_a_replica_that_stalls_mid_stream_is_given_up_after_the_read_timeout():
    async def scenario() -> None:
        async with SseServer(EVENTS, stall_after=1) as url:
            up = Upstream(connect_timeout_s=2, read_timeout_s=0.5, max_connections=4)
            client = Client()
            resp = await up.post(url, b"{}", {})
            relay = SseRelay(resp, client.send, True, lambda: None)
            assert await asyncio.wait_for(relay.run(client.receive), 10) == "upstream_failed"
            assert "no data from the replica" in str(relay.error)
            resp.close()
            assert up.connections() == (0, 0)
            await up.aclose()
        assert client.bodies == [EVENTS[0]]

    asyncio.run(scenario())


def test_a_replica_that_never_answers_is_a_timeout_after_the_read_timeout():
    async def scenario() -> None:
        server = await asyncio.start_server(lambda r, w: r.read(), "127.0.0.1", 0)  # reads, never answers
        up = Upstream(connect_timeout_s=2, read_timeout_s=0.5, max_connections=4)
        try:
            port = server.sockets[0].getsockname()[1]
            with pytest.raises(UpstreamTimeout) as e:  # sent: not to be sent again (not a connect error)
                await asyncio.wait_for(up.post(f"http://127.0.0.1:{port}/", b"", {}), 10)
            assert "no data from the replica" in str(e.value)
        finally:
            server.close()
            await up.aclose()

    asyncio.run(scenario())
