"""A real socket server that answers every request with a chunked SSE body cut into given pieces: the
replica side for the gateway's relay tests and the bench client's tests."""

from __future__ import annotations

import asyncio


def chunked(piece: bytes) -> bytes:
    """``piece`` as one chunk of a chunked HTTP/1.1 body."""
    return b"%x\r\n%s\r\n" % (len(piece), piece)


class SseServer:
    """Answers each request with ``status`` and a chunked SSE body cut into ``pieces`` (one chunk and one
    write each, ``gap_s`` apart; ``one_write``: every chunk and the body's end in a single write);
    ``stall_after``: stop sending (connection open) after that many pieces, before the chunked body's end.
    Records how connections end. ``async with`` gives its URL: ``http://127.0.0.1:<port>`` + ``path``."""

    def __init__(
        self,
        pieces: list[bytes],
        gap_s: float = 0.0,
        stall_after: int | None = None,
        one_write: bool = False,
        status: int = 200,
        path: str = "/v1/completions",
    ) -> None:
        self.pieces, self.gap_s, self.stall_after, self.one_write = pieces, gap_s, stall_after, one_write
        self.status, self.path = status, path
        self.eof_seen = asyncio.Event()  # a connection was closed by the client
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}{self.path}"

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))  # fmt: skip
            await reader.readexactly(length)
            writer.write(
                b"HTTP/1.1 %d X\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                % self.status
            )
            if self.one_write:
                writer.write(b"".join(map(chunked, self.pieces)) + b"0\r\n\r\n")
                await writer.drain()
            else:
                await self._send_pieces(reader, writer)
            if await reader.read() == b"":
                self.eof_seen.set()
        except (ConnectionError, asyncio.IncompleteReadError):
            self.eof_seen.set()
        finally:
            writer.close()

    async def _send_pieces(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for i, piece in enumerate(self.pieces):
            if self.stall_after is not None and i == self.stall_after:
                await reader.read()  # until the client gives up
                break
            writer.write(chunked(piece))
            await writer.drain()
            if self.gap_s:
                await asyncio.sleep(self.gap_s)
        else:
            if self.stall_after == len(self.pieces):  # every event, but not the body's end
                await reader.read()
            else:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
