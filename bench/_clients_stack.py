"""The kvfleet stack the benchmark-client smoke runs (``bench/clients.py``) point at: one ``redis-server``, one
``kvfleet engine serve`` replica of the tiny demo model, and one ``kvfleet gateway`` with a tenant key.

The replica runs the real engine on CPU by default: the clients then see what a new user sees, output of
random weights (which ends early at a sampled EOS unless ``ignore_eos`` is sent, and which a client's own
tokenizer does not split back into the same tokens). ``simulate=True`` runs it with ``--simulate`` instead
(zero-cost timing model, hash-chosen tokens, always ``max_tokens`` long).

Every process runs in its own process group through ``_servers.ServerProcess`` (stopped as a group, no child
left behind); the Redis URL (with its password) and the admin token reach them in their environment. The
server-side token counters the runs are checked against are read from the replica's ``/metrics`` (all
requests, direct or through the gateway, land on this one replica) and the gateway's ``/admin/usage``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import _fleet as fleet
from bench import _servers as servers
from kvfleet_common.fleet_store.store import FleetStore

SERVED_MODEL = "kvfleet-demo"
REPLICA_NAME = "clients-r0"


@dataclass(slots=True, frozen=True)
class ServerCounters:
    """Cumulative counters of the replica (``kvfleet_engine_*``, summed over their labels but status)."""

    requests_ok: float
    requests_failed: float
    prompt_tokens: float
    generation_tokens: float
    cached_prompt_tokens: float

    def minus(self, before: ServerCounters) -> dict[str, int]:
        """What happened between ``before`` and this scrape."""
        return {
            "requests_ok": round(self.requests_ok - before.requests_ok),
            "requests_failed": round(self.requests_failed - before.requests_failed),
            "prompt_tokens": round(self.prompt_tokens - before.prompt_tokens),
            "completion_tokens": round(self.generation_tokens - before.generation_tokens),
            "cached_prompt_tokens": round(self.cached_prompt_tokens - before.cached_prompt_tokens),
        }


def parse_engine_counters(metrics_text: str) -> ServerCounters:
    """The request and token counters out of a replica's Prometheus text."""
    sums: dict[str, float] = {"ok": 0.0, "failed": 0.0}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            if sample.name == "kvfleet_engine_requests_total":
                key = "ok" if sample.labels.get("status") == "200" else "failed"
            else:
                key = sample.name
            sums[key] = sums.get(key, 0.0) + sample.value
    return ServerCounters(
        requests_ok=sums["ok"],
        requests_failed=sums["failed"],
        prompt_tokens=sums.get("kvfleet_engine_prompt_tokens_total", 0.0),
        generation_tokens=sums.get("kvfleet_engine_generation_tokens_total", 0.0),
        cached_prompt_tokens=sums.get("kvfleet_engine_cached_prompt_tokens_total", 0.0),
    )


@dataclass
class ClientStack:
    """Redis + one replica + one gateway. Use as a context manager; ``start()`` returns once the replica is
    registered awake in Redis and the tenant key exists."""

    model_dir: Path
    log_dir: Path
    simulate: bool = False
    max_model_len: int = 1024
    startup_timeout_s: float = 180.0
    redis: fleet.BenchRedis | None = None
    replica: servers.ServerProcess | None = None
    gateway: servers.ServerProcess | None = None
    api_key: str | None = None
    startup_s: dict[str, float] = field(default_factory=dict)

    @property
    def replica_url(self) -> str:
        assert self.replica is not None, "start() first"
        return self.replica.command.base_url

    @property
    def gateway_url(self) -> str:
        assert self.gateway is not None, "start() first"
        return self.gateway.command.base_url

    def start(self) -> ClientStack:
        t0 = time.perf_counter()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis = fleet.BenchRedis(self.log_dir)
        self.redis.start()
        port = servers.free_port()
        extra = [
            "--replica-name",
            REPLICA_NAME,
            "--base-url",
            f"http://127.0.0.1:{port}",
            "--log-level",
            "warning",
        ]
        if self.simulate:
            extra += ["--simulate", *fleet.SimCost(0, 0, 0, 0).args()]
        cmd = servers.kvfleet_command(
            self.model_dir, port, SERVED_MODEL, max_model_len=self.max_model_len,
            admin_token=fleet.ADMIN_TOKEN, extra_args=extra,
        )  # fmt: skip
        cmd.env["KVFLEET_REDIS_URL"] = self.redis.url
        # The gateway starts while the replica loads (both import for seconds on 2 cores).
        self.replica = servers.ServerProcess(cmd, self.log_dir / "replica.log").start()
        self.gateway = servers.ServerProcess(
            fleet.gateway_command(self.redis.url, "prefix-aware"), self.log_dir / "gateway.log"
        ).start()
        self.replica.wait_ready(self.startup_timeout_s)
        self.gateway.wait_ready(self.startup_timeout_s)
        self._wait_registered()
        r = httpx.post(
            f"{self.gateway_url}/admin/tenants", json={"name": fleet.TENANT},
            headers={"Authorization": f"Bearer {fleet.ADMIN_TOKEN}"}, timeout=30,
        )  # fmt: skip
        if r.status_code != 201:
            raise RuntimeError(f"creating the tenant failed: HTTP {r.status_code} {r.text}")
        self.api_key = r.json()["api_key"]
        self.startup_s["stack_s"] = time.perf_counter() - t0
        return self

    def _wait_registered(self) -> None:
        assert self.redis is not None and self.replica is not None
        store = FleetStore.from_url(self.redis.url)
        try:
            deadline = time.monotonic() + self.startup_timeout_s
            while not any(hb.state == "awake" for hb in store.live_replicas(SERVED_MODEL)):
                self.replica.check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError("the replica did not register awake in Redis")
                time.sleep(0.1)
        finally:
            store.close()

    def counters(self) -> ServerCounters:
        r = httpx.get(f"{self.replica_url}/metrics", timeout=30)
        r.raise_for_status()
        return parse_engine_counters(r.text)

    def reset_prefix_cache(self) -> None:
        """Empty the replica's prefix cache (admin), retried while a request still holds blocks."""
        deadline = time.monotonic() + 60
        while True:
            r = httpx.post(
                f"{self.replica_url}/reset_prefix_cache",
                headers={"Authorization": f"Bearer {fleet.ADMIN_TOKEN}"}, timeout=30,
            )  # fmt: skip
            r.raise_for_status()
            if r.json().get("reset") or time.monotonic() > deadline:
                return
            time.sleep(0.2)

    def check_alive(self) -> None:
        for p in (self.replica, self.gateway):
            if p is not None:
                p.check_alive()

    def close(self) -> None:
        for p in (self.gateway, self.replica):
            if p is not None:
                p.stop()
        if self.redis is not None:
            self.redis.close()

    def __enter__(self) -> ClientStack:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
