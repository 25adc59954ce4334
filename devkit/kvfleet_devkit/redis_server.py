"""A real ``redis-server`` for tests, benchmarks and the local platform: free port, temp dir, no persistence,
a password (random unless given); restartable on the same port with the same password.

The password is what the chart's Redis requires too, so every test, benchmark and ``kvfleet up`` run takes the
authenticated path: ``.url`` carries it (``redis://:PASSWORD@127.0.0.1:PORT/0``); ``.password`` is it.
``RedisServer(require_password=False)`` is the exception, for a test that needs a Redis without one. The
password goes to redis-server in a config file (mode 0600, in the work dir), never on its command line, where
any local user could read it in the process list.

Tests use it through the ``redis_server`` fixture in ``tests/conftest.py``::

    def test_x(redis_server):
        r = redis.Redis.from_url(redis_server.url)
        redis_server.restart()   # same port, empty data (like a Redis that lost its memory)
        redis_server.stop()      # clients now get ConnectionError until start()
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis
import redis.exceptions

from kvfleet_devkit.processes import free_port


class RedisServer:
    def __init__(
        self,
        port: int | None = None,
        workdir: Path | None = None,
        *,
        password: str | None = None,
        require_password: bool = True,
    ) -> None:
        """``password``: the one Redis requires (default: a random one); ``require_password=False``: none."""
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (Debian/Ubuntu: apt-get install redis-server)")
        self.exe = exe
        self.port = port or free_port()
        self._own_dir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="kvf-redis-"))
        self.proc: subprocess.Popen | None = None
        self.password = (password or secrets.token_hex(16)) if require_password else None

    @property
    def url(self) -> str:
        """The URL clients use, with the password."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        """A new sync client of this server (authenticated); the caller closes it."""
        return redis.Redis.from_url(self.url, **kwargs)  # type: ignore[arg-type]

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 10.0) -> None:
        if self.running:
            return
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - owned by the child process
        self.proc = subprocess.Popen(
            [self.exe, str(self._write_config()), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no"],
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
        with self.client(socket_timeout=2) as client:
            client.flushall()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _write_config(self) -> Path:
        """The config file holding the password (readable by this user only)."""
        path = self.workdir / "redis.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"requirepass {self.password}\n" if self.password else "")
        return path

    def _ping(self) -> bool:
        try:
            with self.client(socket_timeout=0.5, socket_connect_timeout=0.5) as client:
                return bool(client.ping())
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
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
