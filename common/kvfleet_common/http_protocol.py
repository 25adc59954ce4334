"""uvicorn's httptools protocol with bounds on a request's head (request line and headers): its size and the
time it takes to arrive.

uvicorn bounds neither with httptools. A 20 MB header was read whole, held in memory and handed to the app
(an ``X-Request-Id`` of any size went on into the log lines and to the replicas); a client that sent half a
head and stopped held its connection forever (uvicorn's keep-alive timer stops at the first byte), so a few
thousand such clients use up a server's file descriptors. A public endpoint is expected to refuse both, as
proxies do (nginx: 32 KB and 60 s; Envoy: 60 KiB):

- past ``max_head_bytes`` the client gets ``431 Request Header Fields Too Large``;
- a head not complete ``head_timeout_s`` after its first byte (for a connection's first request: after the
  connection opened) gets ``408 Request Timeout``;

both in OpenAI's error shape, and the connection is closed.

The size is checked twice, so that the bound holds exactly and memory stays bounded:
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
from kvfleet_common.server_flags import HEAD_TIMEOUT_S, MAX_HEAD_BYTES


class _HeadRefused(Exception):
    pass


class BoundedHeadProtocol(HttpToolsProtocol):
    max_head_bytes = MAX_HEAD_BYTES
    head_timeout_s = HEAD_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading_head = True  # from a connection's start, or a request's end, to the next head's end
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._refused = False

    def data_received(self, data: bytes) -> None:
        if self._refused:  # nothing more is parsed
            return
        if self._reading_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._reading_head and self._head_bytes > self.max_head_bytes and not self._refused:
            self._refuse_head_size()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_head_timer()  # the first head: uvicorn times out no connection before its first answer

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    # -- parser callbacks --
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._start_head_timer()

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._stop_head_timer()
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)  # ": ", CRLF
        if size > self.max_head_bytes:
            self._refuse_head_size()
            raise _HeadRefused  # stops the parser before the request reaches the app
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_head, self._head_bytes = True, 0

    def send_400_response(self, msg: str) -> None:
        if not self._refused:
            super().send_400_response(msg)

    # -- refusals --
    def _start_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._reading_head and not self._refused and not self.transport.is_closing():
            message = f"the request line and headers did not arrive within {self.head_timeout_s:g} s"
            self._refuse(b"408 Request Timeout", error_body(408, message, code="request_timeout"))

    def _refuse_head_size(self) -> None:
        message = f"the request line and headers exceed {self.max_head_bytes} bytes"
        self._refuse(b"431 Request Header Fields Too Large",
                     error_body(431, message, code="request_header_fields_too_large"))  # fmt: skip

    def _refuse(self, status_line: bytes, error: dict[str, Any]) -> None:
        self._refused = True
        self._stop_head_timer()
        self.logger.warning("refused a request from %s: %s", self.client, error["error"]["message"])
        body = json.dumps(error).encode()
        self.transport.write(
            b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status_line, len(body), body)
        )
        self.transport.close()


def bounded_head_protocol(max_head_bytes: int, head_timeout_s: float) -> type[BoundedHeadProtocol]:
    """The protocol class to give uvicorn (``http=``) for these bounds."""
    return type(
        "BoundedHeadProtocol", (BoundedHeadProtocol,),
        {"max_head_bytes": max_head_bytes, "head_timeout_s": head_timeout_s},
    )  # fmt: skip
