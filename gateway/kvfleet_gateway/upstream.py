"""HTTP/1.1 to the engine replicas: the proxied requests and the admin calls (sleep / wake).

A small client of our own on asyncio protocols and httptools' C parser, because a relayed stream costs
the gateway CPU per *event*, and at 100 streams a decode step hands it ~100 events at once: the time to
relay that burst is latency added to every stream's tokens (``bench/gateway_overhead.py``). With a
client library each event woke the request's task, ran a read call, the proxy's generator and the
ASGI send chain (~120 µs per event with aiohttp, more with httpx); here the body reaches a callback in
the connection's own ``data_received`` (``UpstreamResponse.stream``), which passes it on at once.

- Connections are kept alive per replica (host, port) and reused most recently used first; idle ones
  are dropped after ``KEEPALIVE_S``, before the engine's keep-alive (75 s) would close them.
- One exchange per connection at a time; a connection comes back to the pool only after its response
  was read to the end (``close``); closing it earlier drops it, which the engine sees as the client
  going away (it aborts the request).
- Timeouts: connecting (``connect_timeout_s``), and no byte from the replica for ``read_timeout_s``
  while a request is out (the head and each part of the body), checked by one watchdog a second.
- A pooled connection carries a request only if it is still open: a replica that closed an idle
  connection has its FIN (or RST) waiting on the socket, maybe not yet seen by the loop, so the socket is
  polled (zero timeout) before it is written to; a readable idle socket is dropped, another one used.

Errors, and the retry rule they carry (docs/GATEWAY.md, "Retries"): a request is written at most once.
- ``UpstreamConnectError``: no connection could be made (refused, unreachable, none within the connect
  timeout). Nothing was sent: another replica may take the request.
- ``UpstreamReadError``: the request was written, and no complete answer came back (the connection broke,
  the answer was malformed, nothing arrived for ``read_timeout_s``). The replica may have run the request,
  or be running it still: it is never sent again. ``UpstreamTimeout`` is the read timeout, ``UpstreamCut``
  the gateway ending the exchange itself (``Upstream.cut``, at shutdown).
"""

from __future__ import annotations

import asyncio
import functools
import select
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlencode, urlsplit

import httptools


class UpstreamConnectError(Exception):
    """No connection to the replica could be made: the request was not sent (another replica may take it).

    ``refused``: the replica is down or not listening (refused, unreachable); otherwise no connection came
    within the connect timeout (the replica may be fine)."""

    def __init__(self, message: str, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


class UpstreamReadError(Exception):
    """The request was written to the replica and its answer did not come whole (no head, or the body
    broke off): the replica may have run it, or still be running it. Never a reason to send it again."""


class UpstreamTimeout(UpstreamReadError):
    """Nothing came from the replica for the read timeout while the request was out."""


class UpstreamCut(UpstreamReadError):
    """The gateway ended the exchange itself (``Upstream.cut``: it is shutting down)."""


# Idle connections are kept 60 s, less than the engine's keep-alive (75 s), so the replica rarely closes
# one a request is about to be written to (and one it did close is seen at checkout: ``_peer_spoke``).
# Kept long on purpose: a replica busy with streams took up to 3 s to start serving each of a burst of
# ~100 new connections (bench/gateway_overhead.py: the first requests after 4 s without traffic), while
# requests on open connections were served at once.
KEEPALIVE_S = 60.0
WATCHDOG_PERIOD_S = 1.0


@functools.lru_cache(maxsize=1024)
def _target(url: str) -> tuple[str, int, str, bytes]:
    """(host, port, request target, Host header value) of an ``http://`` URL."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"replica URLs are plain http://host:port URLs, not {url!r}")
    port = parts.port or 80
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.hostname, port, target, parts.netloc.encode("ascii")


class UpstreamResponse:
    """One exchange on a connection: its head once arrived (``status_code``, ``headers`` with lower-case
    names), then its body, read whole (``read``) or handed on as it arrives (``stream``).

    ``close(abort=True)`` drops the connection (the engine sees the client go away and aborts the
    request); ``close()`` after the body was read to the end returns the connection to the pool."""

    __slots__ = ("_chunks", "_closed", "_conn", "_done", "_head", "_on_data", "_on_last", "headers",
                 "status_code")  # fmt: skip

    def __init__(self, conn: _Connection) -> None:
        loop = asyncio.get_running_loop()
        self._conn = conn
        self._head: asyncio.Future[None] = loop.create_future()
        self._done: asyncio.Future[None] = loop.create_future()
        for fut in (self._head, self._done):  # an outcome nobody waits for any more is not an error to log
            fut.add_done_callback(_retrieve)
        self._chunks: list[bytes] = []
        self._on_data: Callable[[bytes], None] | None = None
        self._on_last: Callable[[bytes], None] | None = None
        self._closed = False
        self.status_code = 0
        self.headers: dict[str, str] = {}

    # -- called by the connection (in its data_received) --
    def _got_head(self, status: int) -> None:
        self.status_code = status
        if not self._head.done():
            self._head.set_result(None)

    def _got_body(self, data: bytes) -> None:
        if self._on_data is not None:
            self._on_data(data)
        else:
            self._chunks.append(data)

    def _got_last(self, data: bytes) -> None:
        """The body's last part (maybe empty), when the body ended cleanly (just before ``_got_end(None)``)."""
        if self._on_last is not None:
            self._on_last(data)
        elif data:
            self._got_body(data)

    def _got_end(self, error: UpstreamReadError | None) -> None:
        if not self._head.done():
            self._head.set_exception(error or UpstreamReadError("the response ended before its head"))
        if not self._done.done():
            if error is None:
                self._done.set_result(None)
            else:
                self._done.set_exception(error)

    # -- the caller's side --
    async def read(self) -> bytes:
        """The whole body. Raises ``UpstreamReadError``."""
        await self._done
        return b"".join(self._chunks)

    def stream(
        self, on_data: Callable[[bytes], None], on_last: Callable[[bytes], None] | None = None
    ) -> asyncio.Future[None]:
        """Hand each part of the body to ``on_data`` as it arrives (what came before is handed first), in
        the connection's ``data_received``: ``on_data`` must not raise, and must not block. The returned
        future is done at the end of the body, or fails with ``UpstreamReadError``.

        ``on_last``: the part that ends the body (the bytes of the read that held its end, maybe none) goes
        to it instead, once, and only if the body ends cleanly; then the future is done. So a relay can end
        its own response with the same write (a stream's last events and the end of its chunked body)."""
        self._on_data, self._on_last = on_data, on_last
        chunks, self._chunks = self._chunks, []
        ended = self._done.done() and not self._done.cancelled() and self._done.exception() is None
        if ended and on_last is not None:  # the whole body came before anyone asked for it
            on_last(b"".join(chunks))
            return self._done
        for chunk in chunks:
            on_data(chunk)
        return self._done

    def pause_reading(self) -> None:
        """Stop taking bytes from the replica (the client is slow): TCP flow control reaches the engine."""
        self._conn.pause_reading()

    def resume_reading(self) -> None:
        self._conn.resume_reading()

    def close(self, abort: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        complete = self._done.done() and not self._done.cancelled() and self._done.exception() is None
        self._head.cancel()  # no-ops when done
        self._done.cancel()
        self._conn.release(keep=complete and not abort)
        self._conn.pool.slots.release()


def _retrieve(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to a replica, carrying one exchange at a time. It is its own
    httptools parser's callback object: the parser calls ``on_*`` from ``data_received``."""

    def __init__(self, pool: Upstream, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: UpstreamResponse | None = None
        self.closed = False
        self.keep_alive = False
        self.fd = -1  # the socket's, for the check at reuse (``_peer_spoke``)
        self.last_io = 0.0  # loop time of the last byte in (or the request out): the read watchdog's clock
        self.idle_since = 0.0
        self.reading_paused = False
        # The body parts the parser found in the bytes being fed: handed on as one, after the parse. A
        # read often holds several chunked-encoding chunks (one SSE event each: the first token behind
        # the role event, the last ones with the usage and [DONE]), and each part handed on separately
        # became its own write to the client, its own syscall and TCP segment.
        self.body_parts: list[bytes] = []

    # -- asyncio.Protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        self.fd = sock.fileno() if sock is not None else -1

    def data_received(self, data: bytes) -> None:
        if self.exchange is None:  # bytes nobody asked for (on an idle connection): its state is unknown
            self.abort()
            self.pool.forget(self)
            return
        self.last_io = self.pool.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.body_parts.clear()
            self.fail(UpstreamReadError(f"malformed response from the replica: {e}"))
            return
        self._hand_on_body()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self.exchange is not None:
            why = f"{type(exc).__name__}: {exc}" if exc else "the replica closed the connection"
            self.exchange._got_end(UpstreamReadError(why))

    def pause_writing(self) -> None:  # the request body is written at once; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks --
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.exchange is not None:
            self.exchange.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self.exchange is not None:
            self.exchange._got_head(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        self.body_parts.append(body)

    def on_message_complete(self) -> None:
        parts, self.body_parts = self.body_parts, []
        self.keep_alive = self.parser.should_keep_alive()
        exchange = self.exchange  # the relay may close it from ``_got_last`` (its client left): then a no-op
        if exchange is not None:
            exchange._got_last(parts[0] if len(parts) == 1 else b"".join(parts))
            exchange._got_end(None)

    def _hand_on_body(self) -> None:
        if self.body_parts:
            parts, self.body_parts = self.body_parts, []
            if self.exchange is not None:
                self.exchange._got_body(parts[0] if len(parts) == 1 else b"".join(parts))

    # -- the pool's side --
    def send(self, request: bytes) -> UpstreamResponse:
        assert self.transport is not None and self.exchange is None
        self.exchange = UpstreamResponse(self)
        self.keep_alive = False
        self.last_io = self.pool.loop.time()
        self.transport.write(request)
        return self.exchange

    def usable(self) -> bool:
        """An idle connection may carry a request: open, and the replica has not closed it meanwhile."""
        if self.closed or self.transport is None or self.transport.is_closing():
            return False
        return self.fd < 0 or not _peer_spoke(self.fd)

    def fail(self, error: UpstreamReadError) -> None:
        """End the exchange with ``error`` and drop the connection."""
        if self.exchange is not None:
            self.exchange._got_end(error)
        self.abort()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def release(self, keep: bool) -> None:
        """The exchange is over: back to the pool if it ended cleanly and may be reused, else dropped."""
        self.exchange = None
        if keep and self.keep_alive and not self.closed:
            self.resume_reading()
            self.pool.checkin(self)
        else:
            self.abort()
            self.pool.forget(self)

    def pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = False
            self.transport.resume_reading()
            self.last_io = self.pool.loop.time()  # paused time was the client's, not the replica's


class Upstream:
    """One connection pool for every replica. Create inside the running event loop; ``aclose`` at exit."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float, max_connections: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.slots = asyncio.Semaphore(max_connections)  # exchanges in progress (connections carrying one)
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._watchdog: asyncio.Task[None] | None = None
        self._cut: str | None = None  # why exchanges are refused (``cut``)

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        """Send; return once the response head arrived. Raises ``UpstreamConnectError`` (not sent: another
        replica may take the request) or ``UpstreamReadError`` (sent, no answer: never to be sent again)."""
        if self._cut is not None:
            raise UpstreamCut(self._cut)
        host, port, target, host_header = _target(url)
        head = [b"POST ", target.encode(), b" HTTP/1.1\r\nhost: ", host_header,
                b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]  # fmt: skip
        for name, value in headers.items():
            head += (name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n")
        request = b"".join(head) + b"\r\n" + body
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch(), name="upstream-watchdog")
        await self.slots.acquire()  # released by the response's close
        try:
            conn = await self._checkout((host, port))
        except BaseException:
            self.slots.release()
            raise
        resp = conn.send(request)
        try:
            await resp._head
        except BaseException:  # no answer (UpstreamReadError), or cancelled (the client left): the
            resp.close(abort=True)  # connection is dropped, which the engine takes for an abort
            raise
        return resp

    async def call(
        self, url: str, params: Mapping[str, Any] | None, headers: Mapping[str, str], timeout_s: float
    ) -> tuple[int, str]:
        """A small admin POST: (status, body text). Raises ``UpstreamConnectError``/``UpstreamReadError``."""
        if params:
            url += "?" + urlencode(params)

        async def exchange() -> tuple[int, str]:
            resp = await self.post(url, b"", headers)
            try:
                return resp.status_code, (await resp.read()).decode("utf-8", "replace")
            finally:
                resp.close()

        try:
            return await asyncio.wait_for(exchange(), timeout_s)
        except TimeoutError:
            raise UpstreamReadError(f"no complete answer within {timeout_s:g} s") from None

    def cut(self, reason: str) -> int:
        """End every exchange in progress with ``UpstreamCut(reason)``, and refuse new ones: the gateway is
        shutting down. Their connections are dropped (each engine aborts its request). Returns how many."""
        self._cut = reason
        busy = [conn for conn in self._busy if conn.exchange is not None]
        for conn in busy:
            conn.fail(UpstreamCut(reason))
        return len(busy)

    def connections(self) -> tuple[int, int]:
        """(carrying an exchange, idle in the pool)."""
        return len(self._busy), sum(len(conns) for conns in self._idle.values())

    async def aclose(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        for conn in [*self._busy, *(c for conns in self._idle.values() for c in conns)]:
            conn.abort()
        self._idle.clear()
        self._busy.clear()

    # -- the pool --
    async def _checkout(self, key: tuple[str, int]) -> _Connection:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to have been closed meanwhile
            if conn.usable():
                self._busy.add(conn)
                return conn
            conn.abort()
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: _Connection(self, key), *key), self.connect_timeout_s
            )
        except TimeoutError:
            raise UpstreamConnectError(
                f"no connection to {key[0]}:{key[1]} within {self.connect_timeout_s:g} s", refused=False
            ) from None
        except OSError as e:  # refused, unreachable, unknown host
            raise UpstreamConnectError(f"{type(e).__name__}: {e}", refused=True) from None
        self._busy.add(conn)
        return conn

    def checkin(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        conn.idle_since = self.loop.time()
        self._idle.setdefault(conn.key, []).append(conn)

    def forget(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    async def _watch(self) -> None:
        """Once a second: fail exchanges the replica has sent nothing for ``read_timeout_s`` (not counting
        time spent paused for a slow client), drop connections idle for ``KEEPALIVE_S``."""
        while True:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            now = self.loop.time()
            for conn in list(self._busy):
                stalled = now - conn.last_io > self.read_timeout_s
                if stalled and conn.exchange is not None and not conn.reading_paused:
                    conn.fail(UpstreamTimeout(f"no data from the replica for {self.read_timeout_s:g} s"))
            for conns in self._idle.values():
                for conn in [c for c in conns if now - c.idle_since > KEEPALIVE_S]:
                    conns.remove(conn)
                    conn.abort()


def _peer_spoke(fd: int) -> bool:
    """Whether an idle connection's socket has something to read: the replica's FIN or RST, or bytes nobody
    asked for. Either way it cannot carry a request."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))
