"""uvicorn's httptools protocol with a bound on a request's head (request line and headers).

uvicorn bounds nothing there with httptools: a 20 MB header was read whole, held in memory and handed to the
app (an ``X-Request-Id`` of any size went on into the log lines and to the replicas). A public endpoint is
expected to refuse that before reading it, as proxies do (nginx 32 KB, Envoy 60 KiB): past ``max_head_bytes``
the client gets ``431 Request Header Fields Too Large`` (OpenAI-shaped JSON) and the connection is closed.

Two checks, so that the bound holds exactly and memory stays bounded:
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

import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvfleet_common.openai_protocol import error_body
from kvfleet_common.server_flags import MAX_HEAD_BYTES


class _HeadRefused(Exception):
    pass


class BoundedHeadProtocol(HttpToolsProtocol):
    max_head_bytes = MAX_HEAD_BYTES

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading_head = True  # from a connection's start, or a request's end, to the next head's end
        self._head_bytes = 0
        self._refused = False

    def data_received(self, data: bytes) -> None:
        if self._refused:  # nothing more is parsed
            return
        if self._reading_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._reading_head and self._head_bytes > self.max_head_bytes and not self._refused:
            self._refuse_head()

    def on_headers_complete(self) -> None:
        self._reading_head = False
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)  # ": ", CRLF
        if size > self.max_head_bytes:
            self._refuse_head()
            raise _HeadRefused  # stops the parser before the request reaches the app
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        if not self._refused:
            super().send_400_response(msg)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_head, self._head_bytes = True, 0

    def _refuse_head(self) -> None:
        self._refused = True
        message = f"the request line and headers exceed {self.max_head_bytes} bytes"
        self.logger.warning("refused a request: %s (client %s)", message, self.client)
        body = json.dumps(error_body(431, message, code="request_header_fields_too_large")).encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()


def bounded_head_protocol(max_head_bytes: int) -> type[BoundedHeadProtocol]:
    """The protocol class to give uvicorn (``http=``) for this bound."""
    return type("BoundedHeadProtocol", (BoundedHeadProtocol,), {"max_head_bytes": max_head_bytes})
