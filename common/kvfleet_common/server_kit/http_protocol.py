"""uvicorn's httptools protocol with bounds on reading a request: the size of its head (request line and
headers), and how long its head and body may take to arrive.

uvicorn bounds none of these with httptools:
- a 20 MB header was read whole, held in memory and handed to the app (an ``X-Request-Id`` of any size went on
  into the log lines and to the replicas);
- a client that sent half a head, or nothing, held its connection forever (uvicorn's keep-alive timer runs
  only after a first response, and stops at the first byte), and one that stopped halfway through its body
  held the connection and the request's task forever; a few thousand such clients use up a server's file
  descriptors (slowloris).
A public endpoint is expected to refuse them, as proxies do (nginx: 32 KB, 60 s for the head, 60 s between
body reads; Envoy: 60 KiB):
- past ``max_head_bytes`` the client gets ``431 Request Header Fields Too Large``;
- a head not complete ``read_timeout_s`` after its first byte (a connection's first request: after the
  connection opened), or a body that stops arriving for ``read_timeout_s`` (not counting time the app itself
  is not reading), gets ``408 Request Timeout`` (unless the app already answered);
both in OpenAI's error shape, and the connection is closed (the app sees the client leave).

The head's size is checked twice, so that the bound holds exactly and memory stays bounded:
- while a head is incomplete, the bytes of the reads (``data_received``) that leave it incomplete are counted,
  and past the bound it is refused at once: a huge header is never read whole (at most one read, 256 KiB,
  past the bound);
- when a head is complete, its size is taken from what the parser found (request target, names and values),
  so a head that arrived in one read is held to the same bound, and a body sharing a read with its head
  never counts.
A head refused when complete stops the parser with an exception; uvicorn answers parser errors with a 400
(``send_400_response``, skipped here: the 431 went out already) and logs "Invalid HTTP request received."
after this module's own warning.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvfleet_common.openai_protocol import error_body
from kvfleet_common.server_kit.connection_limits import MAX_HEAD_BYTES, READ_TIMEOUT_S


class _HeadRefused(Exception):
    pass


class BoundedReadProtocol(HttpToolsProtocol):
    max_head_bytes = MAX_HEAD_BYTES
    read_timeout_s = READ_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading_head = True  # from a connection's start, or a request's end, to the next head's end
        self._reading_body = False  # from a head's end to its request's end
        self._head_bytes = 0
        self._timer: asyncio.TimerHandle | None = None  # the read timeout of the head or body being read
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_timer()  # the first head: uvicorn times out no connection before its first answer

    def data_received(self, data: bytes) -> None:
        if self._refused:  # nothing more is parsed
            return
        if self._reading_head:
            self._head_bytes += len(data)
        elif self._reading_body:  # progress: the body's timeout starts again
            self._stop_timer()
            self._start_timer()
        super().data_received(data)
        if self._reading_head and self._head_bytes > self.max_head_bytes and not self._refused:
            self._refuse_head_size()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    # -- parser callbacks --
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._start_timer()

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._stop_timer()
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)  # ": ", CRLF
        if size > self.max_head_bytes:
            self._refuse_head_size()
            raise _HeadRefused  # stops the parser before the request reaches the app
        super().on_headers_complete()
        self._reading_body = True
        self._start_timer()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._stop_timer()
        self._reading_head, self._reading_body, self._head_bytes = True, False, 0

    def send_400_response(self, msg: str) -> None:
        if not self._refused:
            super().send_400_response(msg)

    # -- timeouts and refusals --
    def _start_timer(self) -> None:
        if self._timer is None:
            self._timer = self.loop.call_later(self.read_timeout_s, self._timed_out)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self._refused or self.transport.is_closing():
            return
        if self._reading_body and self.flow.read_paused:  # the app is not reading the body: not the client
            self._start_timer()
            return
        what = "line and headers" if self._reading_head else "body"
        message = f"the request's {what} did not arrive within {self.read_timeout_s:g} s"
        answered = self._reading_body and self.cycle is not None and self.cycle.response_started
        self._refuse(b"408 Request Timeout", None if answered else error_body(408, message, code="request_timeout"),
                     message)  # fmt: skip

    def _refuse_head_size(self) -> None:
        message = f"the request line and headers exceed {self.max_head_bytes} bytes"
        self._refuse(b"431 Request Header Fields Too Large",
                     error_body(431, message, code="request_header_fields_too_large"), message)  # fmt: skip

    def _refuse(self, status_line: bytes, error: dict[str, Any] | None, message: str) -> None:
        """Answer ``error`` (None: the app already answered; just close) and close the connection."""
        self._refused = True
        self._stop_timer()
        self.logger.warning("refused a request from %s: %s", self.client, message)
        if error is not None:
            body = json.dumps(error).encode()
            self.transport.write(
                b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
                % (status_line, len(body), body)
            )
        self.transport.close()


def bounded_read_protocol(max_head_bytes: int, read_timeout_s: float) -> type[BoundedReadProtocol]:
    """The protocol class to give uvicorn (``http=``) for these bounds."""
    return type(
        "BoundedReadProtocol", (BoundedReadProtocol,),
        {"max_head_bytes": max_head_bytes, "read_timeout_s": read_timeout_s},
    )  # fmt: skip
