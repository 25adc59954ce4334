"""Flags both HTTP servers (an engine replica, the gateway) take for their connections, and the uvicorn
options they become."""

from __future__ import annotations

import argparse
from typing import Any

from kvfleet_common.server_kit.connection_limits import KEEP_ALIVE_S, MAX_HEAD_BYTES, READ_TIMEOUT_S


def add_connection_args(parser: argparse.ArgumentParser, closes_first: str) -> None:
    """``--keep-alive-timeout`` and ``--loop``; ``closes_first`` names who should close idle connections."""
    parser.add_argument(
        "--keep-alive-timeout", type=float, default=KEEP_ALIVE_S,
        help=f"seconds an idle client connection stays open (default {KEEP_ALIVE_S:g}); keep it above the idle "
             f"timeout of {closes_first}, so that side closes idle connections and no request races a close",
    )  # fmt: skip
    parser.add_argument(
        "--max-request-head-bytes", type=int, default=MAX_HEAD_BYTES,
        help=f"largest request line + headers (default {MAX_HEAD_BYTES}); past it the client gets a 431 and the "
             "connection is closed",
    )  # fmt: skip
    parser.add_argument(
        "--request-read-timeout", type=float, default=READ_TIMEOUT_S,
        help=f"seconds a request's line and headers may take to arrive (from their first byte; for a connection's "
             f"first request, from the connection) and the longest pause in its body (default {READ_TIMEOUT_S:g}); "
             "past it a 408 and the connection closed",
    )  # fmt: skip
    parser.add_argument(
        "--loop", choices=("asyncio", "uvloop"), default="asyncio",
        help="event loop: asyncio (default) accepts every pending connection when the socket wakes it; uvloop "
             "(libuv) accepts one per loop iteration, so under load a burst of ~100 new connections waited up "
             "to 3 s for a busy server (bench/gateway_overhead.py), for no CPU saved",
    )  # fmt: skip


def uvicorn_connection_options(args: argparse.Namespace) -> dict[str, Any]:
    from kvfleet_common.server_kit.http_protocol import bounded_read_protocol  # imports uvicorn: servers only

    if args.max_request_head_bytes < 1024:
        raise SystemExit("--max-request-head-bytes must be at least 1024")
    if not args.request_read_timeout > 0:
        raise SystemExit("--request-read-timeout must be positive")
    return {
        "timeout_keep_alive": max(1, round(args.keep_alive_timeout)), "loop": args.loop,
        "http": bounded_read_protocol(args.max_request_head_bytes, args.request_read_timeout),
    }  # fmt: skip
