"""Relaying one SSE stream from a replica to the client, from the replica connection's callback.

Why not an async generator under a ``StreamingResponse``: at 100 streams a decode step hands the gateway
~100 events at once, one per stream, and each woke its request's task to run a read call, the proxy's
generator and the ASGI ``send`` chain; relaying a burst took ~12 ms, which is latency added to every
token (``bench/gateway_overhead.py``). Here the replica's bytes go to the client's ``send`` inside the
upstream connection's ``data_received`` (``UpstreamResponse.stream``). ``send`` is a coroutine function,
but it suspends only when the client's connection cannot take more (the server's flow control); it is
stepped here as a task would step it, and while it waits the replica's connection is not read, so the
backpressure reaches the engine. The request's task only waits for the end of the stream, or for the
client to leave. (So ``send`` runs outside the request's task and context: the servers' and Starlette's
send wrappers do not care; an ASGI middleware that keeps per-request state in context variables around
``send`` would, which is one more reason the tracing middleware skips the proxied endpoints.)

The relay cuts the byte stream at event boundaries (a partial event waits for its end) so that the
usage event, which the gateway may have asked for on the client's behalf, can be read and dropped.

The read that ends the replica's body (its last events, ``[DONE]``, and the chunked body's end, usually in one
read) ends the client's response too, in the same ``send`` (``more_body`` false): the stream's last events
and the end of the client's chunked body go out in one write, where they took two (a syscall, a TCP
segment and a wake-up of the client each; docs/BENCHMARKS.md, "Gateway CPU per request").
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Literal, TypeVar

from kvfleet_gateway.upstream import UpstreamResponse

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Outcome = Literal["complete", "upstream_failed", "client_gone"]

_USAGE_MARK = b'"usage":{'  # a usage object (chunks without one carry "usage":null, or nothing)
_DONE_MARK = b"data: [DONE]"  # the OpenAI stream's last event


class SseRelay:
    """Relays ``upstream``'s SSE body to ``send`` (see the module docstring). ``run`` drives it;
    afterwards ``usage`` is the stream's usage object (if the replica sent one), ``ended_response`` whether
    the relay ended the client's response itself (the body ended cleanly; nothing more may be sent), and
    otherwise ``tail`` any bytes after the last complete event."""

    __slots__ = ("_backlog", "_buf", "_client_left", "_done_queued", "_drained", "_final_queued", "_final_sending",
                 "_keep_usage", "_on_first_event", "_pending", "_send", "_stopped", "_upstream", "ended_response",
                 "ended_stream", "error", "tail", "usage")  # fmt: skip

    def __init__(
        self, upstream: UpstreamResponse, send: Send, keep_usage: bool, on_first_event: Callable[[], None]
    ) -> None:
        self._upstream = upstream
        self._send = send
        self._keep_usage = keep_usage
        self._on_first_event: Callable[[], None] | None = on_first_event
        self._buf = b""
        self._pending: Coroutine[Any, Any, None] | None = None  # a send waiting for the client
        self._backlog: list[bytes] = []  # events that came meanwhile
        self._drained: asyncio.Future[None] | None = None  # run() waits on it for the pending send to finish
        self._stopped = False
        self._client_left: asyncio.Future[None] | None = None
        # The stream's closing ``data: [DONE]`` was sent (``send`` returned; not merely queued behind a slow
        # client) before the client was seen to leave: it has everything. A client that hangs up right after
        # reading it, before the chunked body's end, is done.
        self._done_queued = False
        self._final_queued = False  # the body's last part is in the backlog: its send ends the response
        self._final_sending = False  # the send in progress ends the response
        self.ended_response = False  # that send returned: the client's response is complete
        self.ended_stream = False
        self.usage: dict[str, Any] | None = None
        self.error: BaseException | None = None  # the replica's read error, or the client's send error
        self.tail = b""

    async def run(self, receive: Receive) -> Outcome:
        """Relay until the replica's body ended (every event handed to ``send``) or the client left."""
        upstream_done = self._upstream.stream(self._feed, self._feed_last)
        client_left = self._client_left = asyncio.ensure_future(disconnected(receive))
        try:
            await asyncio.wait((upstream_done, client_left), return_when=asyncio.FIRST_COMPLETED)
            if not client_left.done() and self._pending is not None:
                self._drained = asyncio.get_running_loop().create_future()
                await asyncio.wait((self._drained, client_left), return_when=asyncio.FIRST_COMPLETED)
            if self.ended_response:  # (the server's receive reports a disconnect once a response is over)
                return "complete"
            if client_left.done() or self._stopped:
                return "client_gone"
            self.error = upstream_done.exception()
            if self.error is not None:
                return "upstream_failed"
            self.tail = self._buf if self._buf.strip() else b""
            return "complete"
        finally:
            if client_left.done() and not client_left.cancelled():
                client_left.exception()  # a receive that failed also means the client is gone; not an error
            client_left.cancel()
            self.stop()

    def stop(self) -> None:
        """Relay nothing more (the response is over, however it ended)."""
        self._stopped = True
        self._backlog.clear()
        if self._pending is not None:
            self._pending.close()
            self._pending = None

    # -- in the replica connection's data_received --
    def _feed(self, data: bytes) -> None:
        if self._stopped:
            return
        buf = self._buf + data if self._buf else data
        end = buf.rfind(b"\n\n") + 2
        if end == 1:  # no complete event yet
            self._buf = buf
            return
        events, self._buf = buf[:end], buf[end:]
        events = self._events_out(events)
        if not events:
            return
        if self._pending is not None:
            self._backlog.append(events)
        else:
            self._send_body(events, final=False)

    def _feed_last(self, data: bytes) -> None:
        """The body's last part: its events, and any bytes after the last one (sent as they are, as the
        proxy sends a tail), end the client's response."""
        if self._stopped:
            return
        buf = self._buf + data if self._buf else data
        end = buf.rfind(b"\n\n") + 2
        events, self._buf = (self._events_out(buf[:end]), buf[end:]) if end > 1 else (b"", buf)
        if self._buf.strip():
            events += self._buf
        self._buf = b""
        if self._pending is not None:
            self._backlog.append(events)
            self._final_queued = True
        else:
            self._send_body(events, final=True)

    def _events_out(self, events: bytes) -> bytes:
        """Complete events on their way to the client: metered, the first one noted."""
        if _USAGE_MARK in events:
            events = self._meter(events)
            if not events:
                return b""
        if self._on_first_event is not None:
            self._on_first_event()
            self._on_first_event = None
        if _DONE_MARK in events:
            self._done_queued = True
        return events

    def _send_body(self, body: bytes, final: bool) -> None:
        self._final_sending = final
        self._step(self._send({"type": "http.response.body", "body": body, "more_body": not final}))

    def _meter(self, events: bytes) -> bytes:
        """Take the usage from the events that carry one; drop those events unless the client asked."""
        kept = []
        for event in events.split(b"\n\n")[:-1]:
            usage = _usage_of(event) if _USAGE_MARK in event else None
            if usage is not None:
                self.usage = usage
                if not self._keep_usage:
                    continue
            kept.append(event + b"\n\n")
        return b"".join(kept)

    def _step(self, send: Coroutine[Any, Any, None]) -> None:
        """Run ``send`` until it finishes or waits; if it waits, stop reading the replica until it is done."""
        try:
            waiting_on = send.send(None)
        except StopIteration:
            self._sent()
            return
        except BaseException as e:  # the server could not write: the client is gone
            self._pending = None
            self.error = e
            self.stop()
            self._upstream.close(abort=True)  # the engine aborts the request; run() sees its body end
            if self._drained is not None and not self._drained.done():
                self._drained.set_result(None)
            return
        self._pending = send
        self._upstream.pause_reading()
        if waiting_on is None:  # a bare yield: go on in the next loop iteration
            asyncio.get_running_loop().call_soon(self._resume, send)
        else:
            waiting_on._asyncio_future_blocking = False  # what a task does with the future it waits on
            waiting_on.add_done_callback(lambda _: self._resume(send))

    def _resume(self, send: Coroutine[Any, Any, None]) -> None:
        if self._pending is send:  # not stopped meanwhile
            self._step(send)

    def _sent(self) -> None:
        self._pending = None
        if self._backlog:
            body = b"".join(self._backlog)
            self._backlog.clear()
            self._send_body(body, final=self._final_queued)
            return
        if self._final_sending:
            self.ended_response = True
        if self._done_queued and not (self._client_left is not None and self._client_left.done()):
            self.ended_stream = True  # [DONE] is the last event: with the backlog empty, it went out
        self._upstream.resume_reading()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)


async def disconnected(receive: Receive) -> None:
    """Returns when the client has gone (to be called once the request's body was read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _usage_of(event: bytes) -> dict[str, Any] | None:
    if not event.startswith(b"data: {"):
        return None
    try:
        data = json.loads(event[len(b"data: ") :])
    except ValueError:
        return None
    usage = data.get("usage") if isinstance(data, dict) else None
    return usage if isinstance(usage, dict) else None


T = TypeVar("T")


async def unless_client_leaves(receive, work: Coroutine[Any, Any, T]) -> T | None:
    """``work``'s result, or None if the client disconnected first: ``work`` is then cancelled (a request out
    to a replica has its connection dropped, which its engine takes for an abort). ``receive``: the
    request's, its body read."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if gone.done() and not gone.cancelled():
        gone.exception()  # a receive that failed also means the client is gone; not an error
    if task.done() and not task.cancelled():  # answered (or failed): that counts, even if the client left too
        return task.result()
    await asyncio.gather(task, return_exceptions=True)
    return None
