"""Requests that outlive something (a shutdown, their client, a read timeout): a simulated replica that
decodes slowly, SSE streams read on threads, and a request whose client can leave at any moment."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
from urllib.parse import urlsplit

import httpx

# ``engine serve`` flags: a token every 100 ms, nothing else costs time (a 400-token request runs ~40 s)
SLOW_DECODE = ("--simulate", "--sim-prefill-ms-per-1k-tokens", "0", "--sim-decode-ms-per-step", "100",
               "--sim-decode-ms-per-seq", "0", "--sim-step-overhead-ms", "0")  # fmt: skip


def sigterm_exits_within(proc: subprocess.Popen, bound_s: float) -> None:
    """SIGTERM the server; it must exit with status 0 within ``bound_s`` seconds."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(bound_s + 20) == 0
    took = time.monotonic() - t0
    assert took < bound_s, f"exited {took:.1f} s after SIGTERM"


def running(server) -> float:
    """Requests the engine replica is running now (its /metrics)."""
    return server.metric("kvfleet_engine_num_requests_running")


class SseStream(threading.Thread):
    """A streamed POST read on a thread: ``events`` (each event's data) fill in as they arrive, ``started``
    is set at the first (or when the stream failed before it), ``error`` is how reading failed (None: the
    response ended cleanly)."""

    def __init__(self, url: str, body: dict, headers: dict[str, str] | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.headers = url, {**body, "stream": True}, headers or {}
        self.status = 0
        self.events: list[str] = []
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, headers=self.headers, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: ") :])
                        self.started.set()
        except Exception as e:
            self.error = e
        finally:
            self.started.set()

    def wait_started(self, timeout: float = 60) -> None:
        assert self.started.wait(timeout), "the stream never started"
        assert self.status == 200 and self.events and self.error is None, (self.status, self.error)

    def finish(self, timeout: float = 30) -> list[str]:
        self.join(timeout)
        assert not self.is_alive(), "the stream hung"
        return self.events

    def assert_finished(self) -> None:
        """The stream ran to its end: its last token (finish reason "length"), then ``[DONE]``."""
        events = self.finish()
        assert self.error is None and events[-1] == "[DONE]", (self.error, events[-2:])
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"

    def cut_error(self) -> dict:
        """The ``error`` of the event that ended a stream cut short (after tokens), before ``[DONE]``."""
        events = self.finish()
        assert self.error is None, self.error  # the response ended cleanly: no "incomplete chunked read"
        assert events[-1] == "[DONE]" and len(events) > 2, events[-3:]
        return json.loads(events[-2])["error"]


class LeavingClient:
    """A JSON POST sent on a plain socket; ``leave()`` closes the socket (the client goes away)."""

    def __init__(self, url: str, body: dict, headers: dict[str, str] | None = None) -> None:
        parts = urlsplit(url)
        data = json.dumps(body).encode()
        head = [f"POST {parts.path} HTTP/1.1", f"host: {parts.netloc}", "content-type: application/json",
                f"content-length: {len(data)}", *(f"{k}: {v}" for k, v in (headers or {}).items())]  # fmt: skip
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + data)

    def leave(self) -> None:
        self.sock.close()
