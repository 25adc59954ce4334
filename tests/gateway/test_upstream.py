"""The gateway's upstream client against a real socket server that misbehaves the way replicas do."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet_gateway.upstream import Upstream, UpstreamConnectError

RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: text/plain\r\n\r\nok"


async def _serve_once_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer a connection's first request with keep-alive; close on its second without an answer (the
    request raced the server's idle timeout)."""
    await reader.readuntil(b"\r\n\r\n")
    writer.write(RESPONSE)
    await writer.drain()
    await reader.readuntil(b"\r\n\r\n")
    writer.close()


def test_a_pooled_connection_the_server_closed_is_retried_and_a_refused_one_is_reported():
    async def scenario() -> None:
        server = await asyncio.start_server(_serve_once_then_close, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        up = Upstream(connect_timeout_s=2, read_timeout_s=5, max_connections=10)
        try:
            for _ in range(3):  # from the second on, the pooled connection is dead: sent again on a new one
                resp = await up.post(f"http://127.0.0.1:{port}/", b"", {})
                assert resp.status_code == 200 and await resp.read() == b"ok"
                resp.close()
            server.close()
            await server.wait_closed()
            with pytest.raises(UpstreamConnectError) as e:
                await up.post(f"http://127.0.0.1:{port}/", b"", {})
            assert e.value.refused  # nothing listens: the proxy marks such a replica down
        finally:
            await up.aclose()

    asyncio.run(scenario())
