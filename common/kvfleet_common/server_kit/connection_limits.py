"""Default bounds of a server's client connections: the values behind the flags of ``connection_flags`` and
the class defaults of ``http_protocol.BoundedReadProtocol``.

A module of its own so that both can import them without importing each other (``connection_flags`` must
not import uvicorn when a server only parses its command line).
"""

from __future__ import annotations

KEEP_ALIVE_S = 75.0  # above the gateway's 60 s upstream pool and the 60 s of most load balancers
MAX_HEAD_BYTES = 64 * 1024  # a request line and headers; Envoy's default is 60 KiB, nginx's 32 KB
READ_TIMEOUT_S = 30.0  # for a head to arrive, and the longest pause in a body (nginx: 60 s each)
