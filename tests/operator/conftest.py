"""Fixtures for the operator's integration tests: a Kubernetes API (KMock emulator over HTTP), a real
redis-server, the operator itself (kopf, for real, in a background thread), and a recorder standing in for the
engines' admin HTTP endpoints."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import redis

from kvfleet_common.fleet_store.store import FleetStore
from kvfleet_devkit.kube_emulator import KubeEmulator
from kvfleet_devkit.redis_server import RedisServer
from kvfleet_operator.runner import OperatorThread
from tests.operator.op_harness import add_peering, operator_args


@pytest.fixture(scope="module")
def kube() -> Iterator[KubeEmulator]:
    emulator = KubeEmulator().start()
    add_peering(emulator)
    try:
        yield emulator
    finally:
        emulator.stop()


@pytest.fixture(scope="module")
def module_redis() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def redis_url(module_redis: RedisServer) -> str:
    return module_redis.url


@pytest.fixture(scope="module")
def store(redis_url: str) -> Iterator[FleetStore]:
    store = FleetStore(redis.Redis.from_url(redis_url))
    try:
        yield store
    finally:
        store.close()


@pytest.fixture(scope="module")
def operator(kube: KubeEmulator, redis_url: str) -> Iterator[OperatorThread]:
    op = OperatorThread(operator_args(kube.url, redis_url)).start()
    try:
        yield op
    finally:
        op.stop()


class AdminRecorder:
    """A real HTTP server recording the admin calls the operator makes to engine replicas."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                recorder.calls.append({"path": self.path, "authorization": self.headers.get("Authorization")})
                body = json.dumps({"ok": True}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def admin_recorder() -> Iterator[AdminRecorder]:
    rec = AdminRecorder()
    try:
        yield rec
    finally:
        rec.close()
