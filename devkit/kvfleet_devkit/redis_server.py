"""A real ``redis-server`` for tests, benchmarks and the local platform: free port, temp dir, no persistence;
restartable on the same port.

Tests use it through the ``redis_server`` fixture in ``tests/conftest.py``::

    def test_x(redis_server):
        r = redis.Redis.from_url(redis_server.url)
        redis_server.restart()   # same port, empty data (like a Redis that lost its memory)
        redis_server.stop()      # clients now get ConnectionError until start()
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from kvfleet_devkit.processes import free_port


class RedisServer:
    def __init__(self, port: int | None = None, workdir: Path | None = None) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (Debian/Ubuntu: apt-get install redis-server)")
        self.exe = exe
        self.port = port or free_port()
        self._own_dir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="kvf-redis-"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 10.0) -> None:
        if self.running:
            return
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - owned by the child process
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--protected-mode", "no"],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self._log_tail()}")
            if self._ping():
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(
            f"redis-server did not answer on port {self.port} within {timeout}s: {self._log_tail()}"
        )

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """Stop and start on the same port; data is lost (persistence is off)."""
        self.stop()
        self.start()

    def flush(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(b"*1\r\n$8\r\nFLUSHALL\r\n")
            if not s.recv(64).startswith(b"+OK"):
                raise RuntimeError("FLUSHALL failed")

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"*1\r\n$4\r\nPING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def _log_tail(self) -> str:
        try:
            return (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
