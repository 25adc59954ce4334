"""The gateway's upstream client against a real socket server that misbehaves the way replicas do."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet_gateway.upstream import Upstream, UpstreamConnectError, UpstreamReadError

RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: text/plain\r\n\r\nok"


async def _serve_once_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer a connection's first request with keep-alive; read its second, and close without an answer
    (a replica that died, or was stopped, while it had the request)."""
    await reader.readuntil(b"\r\n\r\n")
    writer.write(RESPONSE)
    await writer.drain()
    await reader.readuntil(b"\r\n\r\n")
    writer.close()


def test_a_request_the_server_closed_on_is_not_sent_again_and_a_refused_one_is_reported():
    connections = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        await _serve_once_then_close(reader, writer)

    async def scenario() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        up = Upstream(connect_timeout_s=2, read_timeout_s=5, max_connections=10)
        try:
            resp = await up.post(f"http://127.0.0.1:{port}/", b"", {})
            assert resp.status_code == 200 and await resp.read() == b"ok"
            resp.close()
            # the pooled connection takes the second request, and closes without an answer: the server may
            # have run it, so it is an error, and the request goes on no other connection
            with pytest.raises(UpstreamReadError):
                await up.post(f"http://127.0.0.1:{port}/", b"", {})
            assert len(connections) == 1 and up.connections() == (0, 0)
            server.close()
            await server.wait_closed()
            with pytest.raises(UpstreamConnectError) as e:
                await up.post(f"http://127.0.0.1:{port}/", b"", {})
            assert e.value.refused  # nothing listens: the proxy marks such a replica down
        finally:
            await up.aclose()

    asyncio.run(scenario())
