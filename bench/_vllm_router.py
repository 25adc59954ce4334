"""vLLM's Rust router (PyPI ``vllm-router``) as the gateway benchmarks' peer: started in front of the same
simulated replicas the kvfleet gateway routes to (``bench/gateway_overhead.py``, ``bench/routing.py``).

What the router asks of a worker: ``GET /health`` (it waits for every worker to answer 200 before it
listens, then re-checks every 60 s) and the OpenAI endpoints it forwards (``/v1/chat/completions``); it
forwards the client's ``X-Request-Id``, so the replica's per-request log line names the bench's request as
it does through our gateway. It has no tenants, keys or quotas: requests go through it without credentials.

``cache_aware`` (0.1.17) routes on token ids that it asks the worker for before every request: first
``POST /v1/chat/completions/render`` (vLLM's endpoint that applies the chat template and tokenizes), which
kvfleet's engine does not have (404), then, as its fallback, ``POST /tokenize`` with the chat ``messages``,
which the engine serves (the same ids it will compute for the request). So each request through it costs
the replica two extra HTTP requests here, one of them a 404 that a vLLM worker would answer with the ids
instead (``counters()["routing_inputs"]``: ``tokenize`` = the fallback was used). ``round_robin`` (and the
other policies without a prefix tree) forward the request alone.

Ports: its HTTP port and its Prometheus port (default 29000: fixed, so two runs at once would collide) are
both picked free. ``--worker-startup-check-interval 1`` (default 30 s between checks) so that a router
started before its workers answer is ready a second after them, not half a minute. Everything else is the
router's default, as a user gets it: for ``cache_aware`` a cache threshold of 0.3, load balancing when
``max - min > 64`` in-flight requests and ``max > 1.5 x min``, an approximate text tree per worker evicted
every 120 s down to 32 Mi characters (so within a benchmark run it forgets nothing the replicas evicted).
"""

from __future__ import annotations

import importlib.metadata
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import _fleet_metrics as fleet_metrics
from bench import _servers as servers

DIST = "vllm-router"
POLICIES = ("cache_aware", "round_robin", "power_of_two", "consistent_hash", "random")


def version() -> str | None:
    """The installed ``vllm-router`` version, or None when it is not installed (with its launcher)."""
    try:
        v = importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    return v if executable() is not None else None


def executable() -> str | None:
    """The ``vllm-router`` launcher next to this interpreter (the bench venv), else on ``PATH``."""
    local = servers.BIN_DIR / "vllm-router"
    return str(local) if local.is_file() else shutil.which("vllm-router")


def router_command(
    worker_urls: Sequence[str], policy: str, extra_args: Sequence[str] = ()
) -> tuple[servers.ServerCommand, int]:
    """The router's command line in front of ``worker_urls`` and its Prometheus port."""
    exe = executable()
    if exe is None:
        raise RuntimeError(f"{DIST} is not installed (pip install {DIST}; see docs/BENCHMARKS.md)")
    if policy not in POLICIES:
        raise ValueError(f"unknown {DIST} policy {policy!r} (one of {', '.join(POLICIES)})")
    port, metrics_port = servers.free_port(), servers.free_port()
    argv = [
        exe, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls, "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--worker-startup-check-interval", "1", "--log-level", "warning", *extra_args,
    ]  # fmt: skip
    cmd = servers.ServerCommand(
        kind=DIST, argv=argv, env={}, base_url=f"http://127.0.0.1:{port}", request_model=None,
        extra_body_for="kvfleet",
    )  # fmt: skip
    return cmd, metrics_port


@dataclass
class VllmRouter:
    """One ``vllm-router`` process in front of ``worker_urls`` (its own process group; stopped on exit).
    ``start()`` returns once it answers ``/health``, which it only does after every worker answered."""

    worker_urls: Sequence[str]
    policy: str
    log_path: Path
    extra_args: Sequence[str] = ()
    startup_timeout_s: float = 120.0
    process: servers.ServerProcess | None = None
    metrics_port: int = 0
    ready_s: float | None = None

    def start(self) -> VllmRouter:
        cmd, self.metrics_port = router_command(self.worker_urls, self.policy, self.extra_args)
        self.process = servers.ServerProcess(cmd, self.log_path).start()
        try:
            self.ready_s = self.process.wait_ready(self.startup_timeout_s, path="/health")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None

    def __enter__(self) -> VllmRouter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self.process is not None, "start() first"
        return self.process.command.base_url

    @property
    def pid(self) -> int:
        assert self.process is not None, "start() first"
        return self.process.pid

    def check_alive(self) -> None:
        if self.process is not None:
            self.process.check_alive()

    def counters(self) -> dict[str, Any]:
        """The router's own counters: chat completions it received, requests it forwarded per worker URL,
        its cache_aware decisions (``prefix_hit`` / ``prefix_miss``, ...) and how it got their token ids
        (``routing_inputs``: ``render``, or ``tokenize`` after a failed render)."""
        s = fleet_metrics.scrape(f"http://127.0.0.1:{self.metrics_port}")
        return {
            "requests": fleet_metrics.metric_sum(s, "vllm_router_requests_total", route="/v1/chat/completions"),
            "per_worker": fleet_metrics.metric_by(s, "vllm_router_processed_requests_total", "worker"),
            "prefix_decisions": fleet_metrics.metric_by(s, "vllm_router_prefix_routing_decisions_total", "outcome"),
            "routing_inputs": fleet_metrics.metric_by(s, "vllm_router_kv_routing_inputs_total", "result"),
        }  # fmt: skip


def counters_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``after - before`` of two ``VllmRouter.counters()`` snapshots."""

    def sub(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
        return {k: v - a.get(k, 0.0) for k, v in b.items() if v - a.get(k, 0.0)}

    return {
        "requests": after["requests"] - before["requests"],
        "per_worker": sub(before["per_worker"], after["per_worker"]),
        "prefix_decisions": sub(before["prefix_decisions"], after["prefix_decisions"]),
        "routing_inputs": sub(before.get("routing_inputs", {}), after.get("routing_inputs", {})),
    }
