"""Bounded graceful shutdown of the two HTTP servers (the gateway, an engine replica). Servers only: imports
uvicorn.

uvicorn's own: on SIGTERM it stops accepting, closes idle connections and waits up to
``timeout_graceful_shutdown`` for the requests in progress; past it, it *cancels* their tasks, and a stream
ends without a word (its client reads "incomplete chunked read"). Here, ``BoundedShutdownServer``:

1. stops accepting and closes idle connections (uvicorn; a busy connection closes after its response);
2. gives the requests in progress ``grace_s`` seconds to finish;
3. then calls the server's ``cut``, which ends each one still running in a way its client can read: a
   stream gets an SSE error event and ``[DONE]``, a request waiting for its answer an error response;
4. ``BACKSTOP_S`` later lets uvicorn cancel whatever still runs (a response stuck behind a client that does
   not read, a handler the cut does not reach);
5. runs the app's lifespan shutdown, which bounds its own steps (``cancel_and_wait``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable, Iterable
from types import FrameType

import uvicorn

logger = logging.getLogger(__name__)

BACKSTOP_S = 1.0


class BoundedShutdownServer(uvicorn.Server):
    """``uvicorn.Server`` with the shutdown above; ``cut`` runs in the event loop, ``grace_s`` after the
    shutdown began, unless every request finished before."""

    def __init__(self, config: uvicorn.Config, grace_s: float, cut: Callable[[], object]) -> None:
        if grace_s < 0:
            raise ValueError(f"the shutdown grace period must be >= 0 s, not {grace_s:g}")
        config.timeout_graceful_shutdown = grace_s + BACKSTOP_S  # type: ignore[assignment]  # any number works
        super().__init__(config)
        self.grace_s = grace_s
        self._cut = cut

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals once shut down; a completed drain is a clean exit (status 0)
        self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.grace_s, self._cut_now)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _cut_now(self) -> None:
        logger.info("shutdown grace period (%g s) over: ending the requests still in progress", self.grace_s)
        try:
            self._cut()
        except Exception:
            logger.exception("ending the requests in progress failed")


async def cancel_and_wait(tasks: Iterable[asyncio.Task], timeout_s: float) -> list[asyncio.Task]:
    """Cancel ``tasks`` and wait for them to end, at most ``timeout_s``; a task still running is cancelled
    again (a cancellation can be lost: ``asyncio.wait_for`` on Python 3.11 returns the result instead when
    its awaitable finished at that moment). Returns the tasks still running at the deadline."""
    tasks = list(tasks)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        left = deadline - loop.time()
        if left <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(left, 0.1))
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()  # retrieved: an error of a task that was stopping is not worth a traceback
    return list(pending)
