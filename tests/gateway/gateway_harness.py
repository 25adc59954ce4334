"""Real processes for gateway tests: a redis-server, ``kvfleet engine serve`` replicas, ``kvfleet gateway``.

Like the chart, the harness gives every gateway the platform's replica key root and every engine its model's
replica key and derived admin token, so the verified path (``kvfleet_gateway.replica_trust``) is the tested one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec

from kvfleet_common import replica_credentials
from kvfleet_common.fleet_store.store import FleetStore
from kvfleet_common.schemas import Heartbeat
from kvfleet_devkit.redis_server import RedisServer
from tests.server.server_harness import (
    ADMIN_TOKEN,
    ServerHandle,
    alive,
    descendants_of,
    free_port,
    run_server,
)

MODEL = "tiny"
REPLICA_KEY_ROOT = "5eed" * 16  # the platform's replica key root of every test gateway


def model_key(model: str = MODEL) -> bytes:
    return replica_credentials.model_key(bytes.fromhex(REPLICA_KEY_ROOT), model)


def engine_admin_token(model: str = MODEL) -> str:
    return replica_credentials.engine_admin_token(model_key(model))


def signed(hb: Heartbeat, key: bytes | None = None) -> Heartbeat:
    """``hb`` signed as an engine of its model would (or with ``key``: a forger's)."""
    key = model_key(hb.model) if key is None else key
    return msgspec.structs.replace(hb, signature=replica_credentials.sign_heartbeat(key, hb))


def wait_until(predicate, timeout: float = 60.0, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@dataclass
class GatewayHandle:
    proc: subprocess.Popen
    url: str
    log_path: Path
    admin_token: str = ADMIN_TOKEN

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def admin(self, method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(method, f"{self.url}{path}", headers=self.admin_headers, timeout=60, **kw)

    def create_tenant(self, name: str, **limits) -> str:
        r = self.admin("POST", "/admin/tenants", json={"name": name, **limits})
        assert r.status_code == 201, r.text
        return r.json()["api_key"]

    # the engine handle's Prometheus helpers work on any URL
    metrics = ServerHandle.metrics
    metric = ServerHandle.metric

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


@contextlib.contextmanager
def run_gateway(redis_url: str, log_dir: Path, *extra: str, env: dict | None = None, timeout: float = 60):
    port = free_port()
    log_path = log_dir / f"gateway-{port}.log"
    cmd = [sys.executable, "-m", "kvfleet_cli.main", "gateway", "--redis-url", redis_url,
           "--host", "127.0.0.1", "--port", str(port), "--admin-token", ADMIN_TOKEN, *extra]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1",
                                     "KVFLEET_REPLICA_KEY_ROOT": REPLICA_KEY_ROOT, **(env or {})})  # fmt: skip
    handle = GatewayHandle(proc, f"http://127.0.0.1:{port}", log_path)
    try:

        def healthy():
            if proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {proc.returncode}:\n{handle.log()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{handle.url}/health", timeout=2).status_code == 200
            return False

        wait_until(healthy, timeout, 0.2, "the gateway to start")
        yield handle
    finally:
        assert handle.stop() in (0, -signal.SIGTERM, -signal.SIGKILL), handle.log()[-3000:]


@dataclass
class Fleet:
    """Owns every process of a test fleet; ``close()`` leaves nothing running."""

    model_dir: Path
    log_dir: Path
    redis: RedisServer = field(default_factory=RedisServer)
    engines: list[ServerHandle] = field(default_factory=list)
    gateways: list[GatewayHandle] = field(default_factory=list)
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def __enter__(self) -> Fleet:
        self.redis.start()
        self._stack.callback(self.redis.close)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @property
    def gateway(self) -> GatewayHandle:
        return self.gateways[0]

    def store(self) -> FleetStore:
        store = FleetStore.from_url(self.redis.url)
        self._stack.callback(store.close)
        return store

    def start_engines(self, n: int, *extra: str, env: dict | None = None) -> list[ServerHandle]:
        """Replicas of ``MODEL`` holding its replica key and derived admin token (the operator's Secret)."""
        started = []
        credentials = {"KVFLEET_REPLICA_KEY": model_key().hex()}
        for _ in range(n):
            port = free_port()
            name = f"{MODEL}-{len(self.engines)}"
            handle = self._stack.enter_context(run_server(
                self.model_dir, self.log_dir, "--max-model-len", "512", "--redis-url", self.redis.url,
                "--replica-name", name, "--base-url", f"http://127.0.0.1:{port}",
                f"--admin-token={engine_admin_token()}", *extra, name=MODEL, port=port, env=credentials | (env or {}),
            ))  # fmt: skip
            handle.admin_token = engine_admin_token()
            self.engines.append(handle)
            started.append(handle)
        store = self.store()
        wait_until(lambda: len([hb for hb in store.live_replicas(MODEL) if hb.state == "awake"]) >= len(self.engines),
                   60, 0.2, "the replicas to register")  # fmt: skip
        return started

    def start_gateway(self, *extra: str, env: dict | None = None) -> GatewayHandle:
        g = self._stack.enter_context(run_gateway(self.redis.url, self.log_dir, *extra, env=env))
        self.gateways.append(g)
        return g

    def engine_for(self, replica_id: str) -> ServerHandle:
        name = replica_id.split("#")[0]
        return self.engines[int(name.rsplit("-", 1)[1])]


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything it started (an engine replica dying hard)."""
    pids = [pid, *descendants_of(pid)]
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    for p in pids:
        wait_until(lambda p=p: not alive(p), 10, 0.05, f"process {p} to die")
