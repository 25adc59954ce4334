"""Gateway settings (flags and environment; see ``kvfleet gateway --help``)."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field

from kvfleet_gateway.routing import POLICIES


def default_gateway_id() -> str:
    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname())[:64] or "gateway"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(slots=True)
class GatewayConfig:
    redis_url: str
    admin_token: str | None = None
    # the platform's replica key root (kvfleet_gateway.replica_trust); None: every heartbeat is trusted
    replica_key_root: bytes | None = None
    default_policy: str = "prefix-aware"  # for models without a policy in Redis
    gateway_id: str = field(default_factory=default_gateway_id)
    max_body_bytes: int = 32 << 20
    fleet_refresh_s: float = 0.5  # --registry-refresh (the flag keeps its published name)
    fleet_max_staleness_s: float = 30.0  # serve from the last fleet snapshot this long while Redis is down
    tenant_cache_ttl_s: float = 2.0
    recent_routes_ttl_s: float = 30.0  # trust "prefix routed there" this long before the KV index shows it
    load_report_interval_s: float = 0.05
    wake_timeout_s: float = 120.0
    upstream_connect_timeout_s: float = 5.0
    upstream_read_timeout_s: float = 600.0
    max_upstream_connections: int = 2000
    # Redis operations in flight: more wait, first come first served (one Redis server runs one command at
    # a time, so more connections add no throughput, only file descriptors and server-side clients).
    max_concurrent_redis_ops: int = 32
    # the proxied endpoints ahead of FastAPI's stack (kvfleet_gateway.fast_path); off: through FastAPI
    fast_path: bool = True

    def __post_init__(self) -> None:
        if self.default_policy not in POLICIES:
            raise ValueError(
                f"unknown routing policy {self.default_policy!r}; expected one of {', '.join(POLICIES)}"
            )
        if self.admin_token is not None and len(self.admin_token) < 8:
            raise ValueError("the admin token must be at least 8 characters")
