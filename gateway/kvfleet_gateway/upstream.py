"""HTTP to the engine replicas (aiohttp): the proxied requests and the admin calls (sleep / wake).

aiohttp rather than httpx on this path: at 100 concurrent streams the gateway was CPU-bound, and a
third of its CPU went to httpx/httpcore's connection pool (which scans every pooled connection on
each request) and anyio's stream wrappers (``bench/gateway_overhead.py --profile``). aiohttp's
connector keeps idle connections per host in a list and reads straight from the transport.

Errors are mapped to two exceptions so callers never see aiohttp's hierarchy:
``UpstreamConnectError`` (nothing reached the replica, or it closed the connection before answering:
safe to retry elsewhere) and ``UpstreamReadError`` (the replica failed after it started answering).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp


class UpstreamConnectError(Exception):
    """The request did not get a response head from the replica (retry-safe before any byte).

    ``refused``: no connection could be made (the replica is down or not listening); otherwise a
    connection broke before the head arrived (the replica may be fine)."""

    def __init__(self, message: str, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


class UpstreamReadError(Exception):
    """The replica's response broke off (or timed out) after its head."""


_CONNECT_ERRORS = (
    aiohttp.ClientConnectionError,  # refused, reset, DNS, server disconnected before the head
    asyncio.TimeoutError,  # connect timeout (and read timeout before the head)
)
# A pooled keep-alive connection the server closed while idle fails on reuse (reset, or "server
# disconnected"): that says nothing about the replica, so the request is sent again on another
# connection. Idle connections are kept 60 s and dropped before the engine's keep-alive (75 s) closes
# them. Kept long on purpose: a replica busy with streams took up to 3 s to start serving each of a burst
# of ~100 new connections (bench/gateway_overhead.py: the first requests after 4 s without traffic), while
# requests on open connections were served at once.
STALE_RETRIES = 2
KEEPALIVE_S = 60.0
_READ_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


class UpstreamResponse:
    """A response whose head has arrived; the body is read with ``read`` or ``iter_chunks``.

    ``close(abort=True)`` drops the connection (the engine sees the client go away and aborts the
    request); ``close()`` after the body was read returns the connection to the pool."""

    __slots__ = ("_resp", "headers", "status_code")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status_code = resp.status
        self.headers: Mapping[str, str] = resp.headers

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except _READ_ERRORS as e:
            raise UpstreamReadError(f"{type(e).__name__}: {e}") from e

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (any chunking)."""
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except _READ_ERRORS as e:
            raise UpstreamReadError(f"{type(e).__name__}: {e}") from e

    def close(self, abort: bool = False) -> None:
        if abort or not self._resp.content.at_eof():
            self._resp.close()
        else:
            self._resp.release()


class Upstream:
    """One connection pool for every replica. Create inside the running event loop; ``aclose`` at exit."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float, max_connections: int) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=max_connections, limit_per_host=0, ttl_dns_cache=300, keepalive_timeout=KEEPALIVE_S
            ),
            timeout=aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=read_timeout_s),
            auto_decompress=False,  # relayed as the engine sent it
            trust_env=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),  # the body is relayed, never decoded
        )

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        """Send; return once the response head arrived. Raises ``UpstreamConnectError``."""
        attempt = 0
        while True:
            try:
                return UpstreamResponse(await self._session.post(url, data=body, headers=headers))
            except aiohttp.ClientConnectorError as e:  # could not connect at all
                raise UpstreamConnectError(f"{type(e).__name__}: {e}", refused=True) from e
            except _CONNECT_ERRORS as e:
                attempt += 1
                if attempt > STALE_RETRIES or isinstance(e, asyncio.TimeoutError):
                    raise UpstreamConnectError(f"{type(e).__name__}: {e}", refused=False) from e

    async def call(
        self, url: str, params: Mapping[str, Any] | None, headers: Mapping[str, str], timeout_s: float
    ) -> tuple[int, str]:
        """A small admin POST: (status, body text). Raises ``UpstreamConnectError``/``UpstreamReadError``."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self._session.post(url, params=params, headers=headers, timeout=timeout) as resp:
                try:
                    return resp.status, await resp.text(errors="replace")
                except _READ_ERRORS as e:
                    raise UpstreamReadError(f"{type(e).__name__}: {e}") from e
        except _CONNECT_ERRORS as e:
            refused = isinstance(e, aiohttp.ClientConnectorError)
            raise UpstreamConnectError(f"{type(e).__name__}: {e}", refused=refused) from e

    async def aclose(self) -> None:
        await self._session.close()
