"""The relay ends the client's response with the replica body's last part: one send (``more_body`` false)
carries the stream's last events and the end of the chunked body, where a second write used to; a client
that leaves after that (as uvicorn's receive reports once a response is over) does not make it a 499."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet_gateway.relay import SseRelay
from kvfleet_gateway.upstream import Upstream
from tests.gateway.test_relay import EVENTS
from tests.sse_server import SseServer


class Server:
    """The HTTP server's side, as uvicorn's: once a send ends the response (``more_body`` false), receive
    reports a disconnect, and nothing more may be sent."""

    def __init__(self, block_first: bool = False) -> None:
        self.messages: list[dict] = []
        self.over = asyncio.Event()
        self.unblock = asyncio.Event()
        self.block_first = block_first

    async def send(self, message: dict) -> None:
        assert not self.over.is_set(), "a send after the response was over"
        if self.block_first and not self.messages:
            await self.unblock.wait()  # the client's socket is full
        self.messages.append(message)
        if not message["more_body"]:
            self.over.set()

    async def receive(self) -> dict:
        await self.over.wait()
        return {"type": "http.disconnect"}


@pytest.mark.parametrize("one_write", [True, False])
@pytest.mark.parametrize("keep_usage", [True, False])
def test_the_body_s_last_part_ends_the_response_in_the_same_send(one_write, keep_usage):
    async def scenario() -> None:
        async with SseServer(EVENTS, one_write=one_write) as url:
            up = Upstream(connect_timeout_s=2, read_timeout_s=5, max_connections=4)
            server = Server()
            resp = await up.post(url, b"{}", {})
            relay = SseRelay(resp, server.send, keep_usage, lambda: None)
            assert await relay.run(server.receive) == "complete"
            assert relay.ended_response and relay.ended_stream
            resp.close()
            assert up.connections() == (0, 1)  # read to the end: the connection is reused
            await up.aclose()
        expected = b"".join(e for e in EVENTS if keep_usage or b'"usage":{' not in e)
        assert b"".join(m["body"] for m in server.messages) == expected
        assert [m["more_body"] for m in server.messages][-1] is False
        assert all(m["more_body"] for m in server.messages[:-1])
        if one_write:  # events and the body's end in one read: one send in all
            assert len(server.messages) == 1

    asyncio.run(scenario())


def test_a_slow_client_gets_the_end_after_the_backlog_in_one_send():
    async def scenario() -> None:
        async with SseServer(EVENTS, gap_s=0.01) as url:
            up = Upstream(connect_timeout_s=2, read_timeout_s=5, max_connections=4)
            server = Server(block_first=True)
            resp = await up.post(url, b"{}", {})
            relay = SseRelay(resp, server.send, True, lambda: None)
            run = asyncio.ensure_future(relay.run(server.receive))
            await asyncio.sleep(0.2)  # everything arrived while the first send waited
            assert not server.messages and not relay.ended_response
            server.unblock.set()
            assert await run == "complete" and relay.ended_response
            resp.close()
            await up.aclose()
        assert [m["more_body"] for m in server.messages] == [True, False]
        assert b"".join(m["body"] for m in server.messages) == b"".join(EVENTS)

    asyncio.run(scenario())
