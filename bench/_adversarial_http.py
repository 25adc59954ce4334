"""Raw HTTP/1.1 for the gateway-under-abuse run (``bench/adversarial.py``): requests written byte for byte as
given (duplicate headers, %-encoded paths, bodies no client library would send), pipelined requests on
keep-alive connections, and streamed completions read event by event by slow readers (a small receive
buffer) or clients that vanish mid-stream (closed or reset).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def connect(url: str, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection; ``rcvbuf``: a small kernel receive buffer and as small a read buffer here, so a slow
    reader pushes back on the server within a few KiB."""
    host, port = _host_port(url)
    if rcvbuf is None:
        return await asyncio.open_connection(host, port)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    return await asyncio.open_connection(sock=sock, limit=max(rcvbuf, 4096))


def raw_request(
    url: str, method: str, path: str, headers: Sequence[tuple[str, str]], body: bytes = b""
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"host: {url.removeprefix('http://')}"]
    lines += [f"{k}: {v}" for k, v in headers]
    lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("the server closed the connection before answering")
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers


async def body_pieces(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The body as it arrives: each chunk of a chunked body, or the whole of a sized one."""
    if headers.get("transfer-encoding", "").lower() != "chunked":
        yield await reader.readexactly(int(headers.get("content-length", "0")))
        return
    while size := int((await reader.readline()).split(b";")[0], 16):
        piece = await reader.readexactly(size + 2)
        yield piece[:-2]
    await reader.readline()


@dataclass(slots=True)
class StreamOutcome:
    status: int | str = "no answer"
    replica: str | None = None
    events: int = 0
    done: bool = False  # [DONE] came
    error: dict | None = None  # an SSE error event's ``error``
    failure: str | None = None  # the transport failed (not our leaving)
    left: bool = False  # the client left on purpose


async def sse_stream(
    url: str,
    key: str,
    body: dict[str, Any],
    *,
    read_rate: float | None = None,
    leave_after: int | None = None,
    reset: bool = False,
    started: asyncio.Event | None = None,
    start_after: int = 1,
    out: StreamOutcome | None = None,
) -> StreamOutcome:
    """One streamed completion read event by event: at ``read_rate`` bytes/s (a 4 KiB receive buffer) when
    given; left after ``leave_after`` events (the connection closed, or ``reset``: aborted); ``started`` set
    after ``start_after`` events (or when the stream failed before them). ``out`` fills in as it goes."""
    out = StreamOutcome() if out is None else out
    head = [("authorization", f"Bearer {key}"), ("content-type", "application/json")]
    writer = None
    try:
        reader, writer = await connect(url, rcvbuf=4096 if read_rate else None)
        writer.write(
            raw_request(url, "POST", "/v1/completions", head, json.dumps({**body, "stream": True}).encode())
        )
        out.status, headers = await read_head(reader)
        out.replica = headers.get("x-kvfleet-replica")
        pending = b""
        async for piece in body_pieces(reader, headers):
            if out.status != 200:
                break
            pending += piece
            while b"\n\n" in pending:
                event, pending = pending.split(b"\n\n", 1)
                data = event.removeprefix(b"data: ")
                out.events += 1
                if data == b"[DONE]":
                    out.done = True
                elif b'"error"' in data:
                    out.error = json.loads(data).get("error")
            if started is not None and out.events >= start_after:
                started.set()
            if leave_after is not None and out.events >= leave_after:
                out.left = True
                break
            if read_rate:
                await asyncio.sleep(len(piece) / read_rate)
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        out.failure = f"{type(e).__name__}: {e}"
    finally:
        if started is not None:
            started.set()
        if writer is not None:
            if reset:
                writer.transport.abort()
            else:
                writer.close()
    return out


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    status, headers = await read_head(reader)
    return status, b"".join([piece async for piece in body_pieces(reader, headers)])


async def pipelined(url: str, requests: Sequence[bytes], connections: int = 4) -> list[tuple[int, bytes]]:
    """``requests`` pipelined on a few keep-alive connections: all of a connection's requests are handed to
    its transport at once (it sends them as the socket drains) and their answers read in order meanwhile."""

    async def over_one_connection(batch: Sequence[bytes]) -> list[tuple[int, bytes]]:
        reader, writer = await connect(url)
        writer.writelines(batch)
        try:
            return [await read_answer(reader) for _ in batch]
        finally:
            writer.close()

    per = await asyncio.gather(*(over_one_connection(requests[i::connections]) for i in range(connections)))
    return [answer for batch in per for answer in batch]
