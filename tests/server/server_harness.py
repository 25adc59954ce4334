"""Start a real ``kvfleet engine serve`` process for tests and find its engine-core child."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvfleet_devkit.processes import free_port

ADMIN_TOKEN = "test-admin-token"


def children_of(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            kids += [int(x) for x in (task / "children").read_text().split()]
    return kids


def descendants_of(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass
class ServerHandle:
    proc: subprocess.Popen
    url: str
    model: str
    log_path: Path
    admin_token: str = ADMIN_TOKEN
    descendants: list[int] = field(default_factory=list)

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def core_pid(self) -> int:
        # multiprocessing's spawn children run "python -c from multiprocessing.spawn import ..."
        kids = children_of(self.proc.pid)
        spawned = [k for k in kids if "spawn_main" in cmdline(k)]  # not the resource tracker
        assert spawned, f"no engine core child of {self.proc.pid}: {kids}"
        return spawned[0]

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
            if m:
                values[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return values

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples whose labels include ``labels``."""
        total = 0.0
        for key, v in self.metrics().items():
            base, _, rest = key.partition("{")
            if base != name:
                continue
            if all(f'{k}="{val}"' in rest for k, val in labels.items()):
                total += v
        return total

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@contextlib.contextmanager
def run_server(model_dir: Path, log_dir: Path, *extra: str, name: str = "tiny", env: dict | None = None,
               startup_timeout: float = 120, port: int | None = None):  # fmt: skip
    port = port or free_port()
    log_path = log_dir / f"server-{port}.log"
    cmd = [
        sys.executable, "-m", "kvfleet_cli.main", "engine", "serve", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name,
        "--admin-token", ADMIN_TOKEN, *extra,
    ]  # fmt: skip
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    handle = ServerHandle(proc, f"http://127.0.0.1:{port}", name, log_path)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{handle.log()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{handle.url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {startup_timeout}s:\n{handle.log()[-3000:]}")
            time.sleep(0.2)
        handle.descendants = descendants_of(proc.pid)
        yield handle
    finally:
        handle.stop()
        for pid in handle.descendants:  # nothing the server started may outlive it
            deadline = time.monotonic() + 10
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"process {pid} outlived the server")


def openai_client(server: ServerHandle):
    """The openai SDK's client for ``server`` (no retries: a test sees the first answer)."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
