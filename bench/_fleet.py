"""A local kvfleet fleet for the gateway benchmarks (``bench/routing.py``, ``bench/gateway_overhead.py``,
``bench/adversarial.py``).

Processes: one ``redis-server`` (devkit's, with a password; free port, no persistence), N simulated engine
replicas (``kvfleet engine serve --simulate``, see docs/SERVER.md) and one ``kvfleet gateway``; the Redis
URL and the admin token reach them in their environment, never on a command line (which every local user can
read). Each runs in its own process group through ``_servers.ServerProcess``, so stopping one leaves none of its
children behind.
``Fleet.boot(policy)`` gives a cold fleet: everything stopped, Redis flushed, replicas started (empty KV
caches, no measured rates), then the gateway with ``--default-policy``, and a fresh tenant with no limits.

The client that streams requests through it is ``_fleet_client``; what is read off it (Prometheus samples,
Redis command counts, CPU seconds) is ``_fleet_metrics``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import _servers as servers
from kvfleet_common.fleet_store.store import FleetStore
from kvfleet_devkit.redis_server import RedisServer

ADMIN_TOKEN = "bench-admin-token"
TENANT = "bench"


# ---- Redis -----------------------------------------------------------------------------------------


class BenchRedis(RedisServer):
    """devkit's throwaway ``redis-server`` (free port, no persistence, a password like the chart's Redis),
    its log and config in ``log_dir/redis``, plus the command counts the overhead benchmark reads."""

    def __init__(self, log_dir: Path) -> None:
        (log_dir / "redis").mkdir(parents=True, exist_ok=True)
        super().__init__(workdir=log_dir / "redis")

    def command_stats(self) -> dict[str, Any]:
        """``total_commands_processed`` and per-command call counts (``INFO commandstats``)."""
        with self.client(socket_timeout=10) as c:
            stats = c.info("stats")
            calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in c.info("commandstats").items()}
        return {"total_commands_processed": int(stats["total_commands_processed"]), "calls": calls}


def parse_env(p: argparse.ArgumentParser, items: Sequence[str], flag: str) -> dict[str, str]:
    """``KEY=VALUE`` arguments as a dict (a parser error otherwise)."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"{flag} expects KEY=VALUE, not {item!r}")
        env[key] = value
    return env


# ---- simulated replicas and the gateway --------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class SimCost:
    """The engine's ``--sim-*`` timing model (milliseconds; see ``kvfleet_engine.executor.simulated``)."""

    prefill_ms_per_1k_tokens: float
    decode_ms_per_step: float
    decode_ms_per_seq: float
    step_overhead_ms: float

    @property
    def prefill_tokens_per_s(self) -> float:
        return float("inf") if self.prefill_ms_per_1k_tokens == 0 else 1e6 / self.prefill_ms_per_1k_tokens

    def args(self) -> list[str]:
        return [
            "--sim-prefill-ms-per-1k-tokens", f"{self.prefill_ms_per_1k_tokens:g}",
            "--sim-decode-ms-per-step", f"{self.decode_ms_per_step:g}",
            "--sim-decode-ms-per-seq", f"{self.decode_ms_per_seq:g}",
            "--sim-step-overhead-ms", f"{self.step_overhead_ms:g}",
        ]  # fmt: skip


def replica_command(
    model_dir: Path,
    model_name: str,
    redis_url: str,
    name: str,
    cost: SimCost,
    num_kv_blocks: int,
    max_model_len: int,
    extra_args: Sequence[str] = (),
) -> servers.ServerCommand:
    port = servers.free_port()
    extra = [
        "--simulate", *cost.args(), "--num-kv-blocks", str(num_kv_blocks),
        "--replica-name", name, "--base-url", f"http://127.0.0.1:{port}", "--log-level", "warning",
        *extra_args,
    ]  # fmt: skip
    cmd = servers.kvfleet_command(
        model_dir, port, model_name, max_model_len=max_model_len, admin_token=ADMIN_TOKEN, extra_args=extra
    )
    cmd.env["KVFLEET_REDIS_URL"] = redis_url  # with its password: kept off the command line
    return cmd


def gateway_command(redis_url: str, policy: str, extra_args: Sequence[str] = ()) -> servers.ServerCommand:
    port = servers.free_port()
    argv = [
        *servers.kvfleet_argv(), "gateway", "--host", "127.0.0.1",
        "--port", str(port), "--default-policy", policy, "--log-level", "warning", *extra_args,
    ]  # fmt: skip
    env = {"KVFLEET_REDIS_URL": redis_url, "KVFLEET_ADMIN_TOKEN": ADMIN_TOKEN}  # kept off the command line
    return servers.ServerCommand(
        kind="gateway", argv=argv, env=env, base_url=f"http://127.0.0.1:{port}",
        request_model=None,
        extra_body_for="kvfleet",
    )  # fmt: skip


@dataclass
class Fleet:
    """Redis + ``replicas`` simulated engines of ``model_name`` + one gateway. Use as a context manager:
    every process is stopped on exit.

    ``boot(policy, fresh)`` prepares a cold run under ``policy``:

    * ``fresh="restart"``: stop everything, flush Redis, start new replica processes (empty KV caches, no
      measured rates), then a new gateway and tenant. What a run should start from; ~25 s on 2 cores, most
      of it the replicas importing torch.
    * ``fresh="reset"``: keep the replicas (they must be idle), empty their prefix caches
      (``POST /reset_prefix_cache``, which also clears their block index in Redis), restart only the
      gateway. Seconds; the replicas keep their measured prefill/decode rates. For smoke tests.
    """

    model_dir: Path
    model_name: str
    log_dir: Path
    replicas: int
    cost: SimCost
    num_kv_blocks: int
    max_model_len: int
    replica_args: Sequence[str] = ()
    gateway_args: Sequence[str] = ()
    gateway_env: dict[str, str] = field(default_factory=dict)
    gateway_wrapper: Sequence[str] = ()  # argv prefix for the gateway (a profiler)
    startup_timeout_s: float = 180.0
    redis: BenchRedis | None = None
    engines: list[servers.ServerProcess] = field(default_factory=list)
    gateway: servers.ServerProcess | None = None
    api_key: str | None = None
    boots: int = 0

    def __enter__(self) -> Fleet:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis = BenchRedis(self.log_dir)
        self.redis.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_gateway()
        self.stop_replicas()
        if self.redis is not None:
            self.redis.close()

    @property
    def gateway_url(self) -> str:
        assert self.gateway is not None, "boot() first"
        return self.gateway.command.base_url

    @property
    def engine_urls(self) -> list[str]:
        return [e.command.base_url for e in self.engines]

    # ---- lifecycle ---------------------------------------------------------------------------------

    def boot(self, policy: str, fresh: str = "restart") -> dict[str, float]:
        """A cold fleet under ``policy`` (see the class docstring). Returns seconds spent per phase."""
        assert self.redis is not None, "use Fleet as a context manager"
        if fresh not in ("restart", "reset"):
            raise ValueError(f"fresh must be 'restart' or 'reset', not {fresh!r}")
        self.boots += 1
        t0 = time.perf_counter()
        self.stop_gateway()
        if fresh == "restart" or not self.engines:
            self.stop_replicas()
            self.redis.flush()
            self.api_key = None
            self.start_replicas()
        else:
            self.reset_replicas()
        t1 = time.perf_counter()
        self.start_gateway(policy)
        if self.api_key is None:
            self.api_key = self.create_tenant(TENANT)
        return {"replicas_s": t1 - t0, "gateway_s": time.perf_counter() - t1}

    def start_replicas(self) -> None:
        assert self.redis is not None
        for i in range(self.replicas):
            cmd = replica_command(
                self.model_dir, self.model_name, self.redis.url, f"sim-{i}", self.cost, self.num_kv_blocks,
                self.max_model_len, self.replica_args,
            )  # fmt: skip
            log = self.log_dir / f"replica-{i}-boot{self.boots:02d}.log"
            self.engines.append(servers.ServerProcess(cmd, log).start())
        for e in self.engines:
            e.wait_ready(self.startup_timeout_s)
        self._wait_registered()

    def reset_replicas(self, timeout_s: float = 60.0) -> None:
        """Empty every replica's prefix cache; a replica still holding blocks (a request finishing) is retried."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.engine_urls)
        while pending:
            left = []
            for url in pending:
                r = httpx.post(f"{url}/reset_prefix_cache", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                               timeout=30)  # fmt: skip
                r.raise_for_status()
                if not r.json().get("reset"):
                    left.append(url)
            pending = left
            if pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replicas still hold KV blocks after {timeout_s}s: {pending}")
                time.sleep(0.2)

    def start_gateway(self, policy: str) -> None:
        assert self.redis is not None
        cmd = gateway_command(self.redis.url, policy, self.gateway_args)
        cmd.argv[:0] = list(self.gateway_wrapper)
        cmd.env.update(self.gateway_env)
        log = self.log_dir / f"gateway-boot{self.boots:02d}-{policy}.log"
        self.gateway = servers.ServerProcess(cmd, log).start()
        self.gateway.wait_ready(self.startup_timeout_s)

    def stop_gateway(self) -> bool | None:
        """Stop the gateway (SIGTERM, then SIGKILL after a grace period). Returns whether it needed SIGKILL."""
        if self.gateway is None:
            return None
        self.gateway.stop()
        killed, self.gateway = self.gateway.needed_sigkill, None
        return killed

    def stop_replicas(self) -> list[bool | None]:
        if not self.engines:
            return []
        with ThreadPoolExecutor(len(self.engines)) as pool:
            list(pool.map(lambda e: e.stop(), self.engines))
        killed = [e.needed_sigkill for e in self.engines]
        self.engines = []
        return killed

    def create_tenant(self, name: str) -> str:
        """A tenant with no limits (and its own cache salt, as every tenant has); returns its API key."""
        r = httpx.post(f"{self.gateway_url}/admin/tenants", json={"name": name},
                       headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)  # fmt: skip
        if r.status_code != 201:
            raise RuntimeError(f"creating tenant {name!r} failed: HTTP {r.status_code} {r.text}")
        return r.json()["api_key"]

    def _wait_registered(self) -> None:
        assert self.redis is not None
        store = FleetStore.from_url(self.redis.url)
        try:
            deadline = time.monotonic() + self.startup_timeout_s
            while True:
                awake = [hb for hb in store.live_replicas(self.model_name) if hb.state == "awake"]
                if len(awake) >= self.replicas:
                    return
                for e in self.engines:
                    e.check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"only {len(awake)} of {self.replicas} replicas registered awake in Redis"
                    )
                time.sleep(0.1)
        finally:
            store.close()

    def check_alive(self) -> None:
        for p in [*self.engines, *([self.gateway] if self.gateway else [])]:
            p.check_alive()

    def pids(self) -> list[int]:
        return [p.pid for p in [*self.engines, *([self.gateway] if self.gateway else [])]]
