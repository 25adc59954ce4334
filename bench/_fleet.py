"""A local kvfleet fleet for the gateway benchmarks (``bench/routing.py``, ``bench/gateway_overhead.py``).

Processes: one ``redis-server`` (free port, temp dir, no persistence), N simulated engine replicas
(``kvfleet engine serve --simulate``, see docs/SERVER.md) and one ``kvfleet gateway``. Each runs in its own
process group through ``_servers.ServerProcess``, so stopping one leaves none of its children behind.
``Fleet.boot(policy)`` gives a cold fleet: everything stopped, Redis flushed, replicas started (empty KV
caches, no measured rates), then the gateway with ``--default-policy``, and a fresh tenant with no limits.

Client: ``stream_request`` sends one streamed OpenAI request and records what the routing benchmarks need
beyond ``_serve_common.stream_request``: the replica that served it (the gateway's ``x-kvfleet-replica``
header), the cached prompt tokens the engine reported, and the streamed text (a chat's next turn quotes it).
It takes an httpx client (``make_client``) or the leaner ``SseClient``, which costs the load generator a
fraction of the CPU per streamed event (``bench/gateway_overhead.py`` uses it).

Metrics: Prometheus text scraped from ``/metrics`` (gateway and engines) and Redis's own ``INFO`` counters.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _serve_common as sc
import _servers as servers
import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from kvfleet_common.registry import Registry
from kvfleet_gateway.upstream import Upstream, UpstreamConnectError, UpstreamReadError

ADMIN_TOKEN = "bench-admin-token"
TENANT = "bench"


# ---- Redis -----------------------------------------------------------------------------------------


class RedisProcess:
    """A throwaway ``redis-server`` (no persistence) on a free port."""

    def __init__(self, log_dir: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (Debian/Ubuntu: apt-get install redis-server)")
        self.exe = exe
        self.port = servers.free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix="kvf-bench-redis-"))
        self.log_path = log_dir / f"redis-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self._client: redis.Redis | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(self.workdir), "--protected-mode", "no"],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; log {self.log_path}")
            with contextlib.suppress(redis.exceptions.ConnectionError):
                if self.client().ping():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer within {timeout_s}s; log {self.log_path}")
            time.sleep(0.05)

    def client(self) -> redis.Redis:
        if self._client is None:
            self._client = redis.Redis.from_url(self.url, socket_timeout=10)
        return self._client

    def flush(self) -> None:
        self.client().flushall()

    def command_stats(self) -> dict[str, Any]:
        """``total_commands_processed`` and per-command call counts (``INFO commandstats``)."""
        c = self.client()
        stats = c.info("stats")
        calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in c.info("commandstats").items()}
        return {"total_commands_processed": int(stats["total_commands_processed"]), "calls": calls}

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        shutil.rmtree(self.workdir, ignore_errors=True)


def parse_env(p: argparse.ArgumentParser, items: Sequence[str], flag: str) -> dict[str, str]:
    """``KEY=VALUE`` arguments as a dict (a parser error otherwise)."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"{flag} expects KEY=VALUE, not {item!r}")
        env[key] = value
    return env


def command_stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Commands Redis processed between two ``command_stats`` snapshots (the ``INFO`` calls themselves
    excluded: each snapshot is one ``INFO stats`` + one ``INFO commandstats``)."""
    calls = {
        k: n - before["calls"].get(k, 0)
        for k, n in after["calls"].items()
        if n - before["calls"].get(k, 0) > 0
    }
    calls["info"] = calls.get("info", 0) - 2
    if calls["info"] <= 0:
        del calls["info"]
    total = after["total_commands_processed"] - before["total_commands_processed"] - 2
    return {"total": total, "calls": dict(sorted(calls.items(), key=lambda kv: -kv[1]))}


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
        "--simulate", *cost.args(), "--num-kv-blocks", str(num_kv_blocks), "--redis-url", redis_url,
        "--replica-name", name, "--base-url", f"http://127.0.0.1:{port}", "--log-level", "warning",
        *extra_args,
    ]  # fmt: skip
    return servers.kvfleet_command(
        model_dir, port, model_name, max_model_len=max_model_len, admin_token=ADMIN_TOKEN, extra_args=extra
    )


def gateway_command(redis_url: str, policy: str, extra_args: Sequence[str] = ()) -> servers.ServerCommand:
    port = servers.free_port()
    argv = [
        str(servers.BIN_DIR / "kvfleet"), "gateway", "--redis-url", redis_url, "--host", "127.0.0.1",
        "--port", str(port), "--admin-token", ADMIN_TOKEN, "--default-policy", policy, "--log-level", "warning",
        *extra_args,
    ]  # fmt: skip
    return servers.ServerCommand(
        kind="gateway", argv=argv, env={}, base_url=f"http://127.0.0.1:{port}", request_model=None,
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
    redis: RedisProcess | None = None
    engines: list[servers.ServerProcess] = field(default_factory=list)
    gateway: servers.ServerProcess | None = None
    api_key: str | None = None
    boots: int = 0

    def __enter__(self) -> Fleet:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis = RedisProcess(self.log_dir)
        self.redis.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_gateway()
        self.stop_replicas()
        if self.redis is not None:
            self.redis.stop()

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
        reg = Registry.from_url(self.redis.url)
        try:
            deadline = time.monotonic() + self.startup_timeout_s
            while True:
                awake = [hb for hb in reg.live_replicas(self.model_name) if hb.state == "awake"]
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
            reg.close()

    def check_alive(self) -> None:
        for p in [*self.engines, *([self.gateway] if self.gateway else [])]:
            p.check_alive()

    def pids(self) -> list[int]:
        return [p.pid for p in [*self.engines, *([self.gateway] if self.gateway else [])]]


# ---- metrics ---------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def scrape(url: str) -> list[Sample]:
    text = httpx.get(f"{url.rstrip('/')}/metrics", timeout=30).text
    return [
        Sample(s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def metric_sum(samples: Iterable[Sample], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(
        s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def metric_by(samples: Iterable[Sample], name: str, label: str, **labels: str) -> dict[str, float]:
    """``name``'s samples summed per value of ``label``."""
    out: dict[str, float] = {}
    for s in samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            key = s.labels.get(label, "")
            out[key] = out.get(key, 0.0) + s.value
    return out


# ---- client ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class StreamResult:
    """One streamed request. ``sent`` is ``time.perf_counter()`` at send; other times are seconds after it.
    ``ttft``: first chunk with text; ``e2e``: end of the stream."""

    sent: float
    ok: bool = False
    status: int | None = None
    ttft: float | None = None
    e2e: float | None = None
    replica: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    predicted_cached: int | None = None  # the gateway's prediction for the replica it chose (debug header)
    text: str = ""
    error: str | None = None


def _delta_text(obj: dict[str, Any]) -> str:
    out = []
    for choice in obj.get("choices") or ():
        delta = choice.get("delta")
        if isinstance(delta, dict):
            out.append(delta.get("content") or "")
        elif "text" in choice:
            out.append(choice.get("text") or "")
    return "".join(out)


def _predicted_cached(route: str | None, replica: str | None) -> int | None:
    """The chosen candidate's ``matched_tokens`` from the gateway's ``x-kvfleet-route`` debug header."""
    if not route or not replica:
        return None
    try:
        candidates = json.loads(route).get("candidates") or ()
    except (ValueError, AttributeError):
        return None
    for c in candidates:
        if c.get("replica") == replica:
            return int(c.get("matched_tokens") or 0)
    return None


class _StreamReader:
    """Folds one stream's SSE ``data:`` payloads into its ``StreamResult`` as they arrive."""

    __slots__ = ("over", "parts", "res")

    def __init__(self, res: StreamResult) -> None:
        self.res = res
        self.parts: list[str] = []
        self.over = False  # [DONE] or an error event came

    def event(self, data: str, now: float) -> None:
        res = self.res
        if data == "[DONE]":
            self.over = True
            res.e2e = now - res.sent
            return
        obj = json.loads(data)
        if obj.get("error"):
            self.over = True
            res.error = f"stream error: {str(obj['error'])[:300]}"
            return
        text = _delta_text(obj)
        if text:
            if res.ttft is None:
                res.ttft = now - res.sent
            self.parts.append(text)
        usage = obj.get("usage")
        if usage:
            res.prompt_tokens = usage.get("prompt_tokens")
            res.output_tokens = usage.get("completion_tokens")
            res.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    def finish(self, now: float) -> StreamResult:
        res = self.res
        if res.error is not None:
            return res
        if res.e2e is None:
            res.e2e = now - res.sent
        res.text = "".join(self.parts)
        res.error = sc.stream_shortfall(res.output_tokens, res.ttft)
        res.ok = res.error is None
        return res


async def stream_request(
    client: httpx.AsyncClient | SseClient,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> StreamResult:
    """Send one streaming request (``body`` must ask for ``stream_options.include_usage``). Never raises for
    server or transport errors: they end up in ``error``."""
    if isinstance(client, SseClient):
        return await client.stream(path, body, headers)
    res = StreamResult(sent=time.perf_counter())
    reader = _StreamReader(res)
    try:
        async with client.stream("POST", path, json=body, headers=headers) as resp:
            _take_head(res, resp.status_code, resp.headers)
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    reader.event(line[5:].strip(), time.perf_counter())
                    if reader.over:
                        break
        return reader.finish(time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _take_head(res: StreamResult, status: int, headers: Mapping[str, str]) -> None:
    res.status = status
    res.replica = headers.get("x-kvfleet-replica")
    res.predicted_cached = _predicted_cached(headers.get("x-kvfleet-route"), res.replica)


class SseClient:
    """A lean streaming client for load generation: the gateway's own HTTP/1.1 client (asyncio protocols,
    httptools' C parser, a keep-alive pool), each event parsed as it arrives in the connection's
    ``data_received`` and timed there.

    Why: the load generator shares the machine's CPUs with what it measures. httpx spends ~8 ms of CPU on a
    64-token stream (a task wake-up, anyio and h11 per chunk), more than the gateway relaying the same
    stream, so at 100 streams the bench's own client was the largest consumer of the CPUs the gateway and
    the replica compete for. ``bench/gateway_overhead.py --client httpx`` keeps the old client. Events must
    end with a blank line (``\n\n``), as kvfleet's servers write them."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"content-type": "application/json"}
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"
        self.timeout_s = timeout_s
        self._http: Upstream | None = None

    async def __aenter__(self) -> SseClient:
        self._http = Upstream(connect_timeout_s=30.0, read_timeout_s=self.timeout_s, max_connections=1 << 20)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.aclose()

    async def stream(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> StreamResult:
        assert self._http is not None, "use SseClient in `async with`"
        res = StreamResult(sent=time.perf_counter())
        reader = _StreamReader(res)
        try:
            resp = await self._http.post(
                self.base_url + path, json.dumps(body).encode(), {**self.headers, **(headers or {})}
            )
        except (UpstreamConnectError, UpstreamReadError, OSError) as e:
            res.error = f"{type(e).__name__}: {e}"
            return res
        pending = bytearray()

        def on_data(data: bytes) -> None:
            now = time.perf_counter()
            pending.extend(data)
            while not reader.over and (end := pending.find(b"\n\n")) >= 0:
                event = bytes(pending[:end])
                del pending[: end + 2]
                try:
                    for line in event.split(b"\n"):
                        if line.startswith(b"data:"):
                            reader.event(line[5:].strip().decode(), now)
                # A malformed event (not JSON, not UTF-8, not an object) fails the stream; raised here, in
                # the connection's callback, it would break the connection instead.
                except Exception as e:
                    reader.over = True
                    res.error = f"{type(e).__name__}: {e}"

        try:
            _take_head(res, resp.status_code, resp.headers)
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.read()).decode(errors='replace')[:300]}"
                return res
            await resp.stream(on_data)
            return reader.finish(time.perf_counter())
        except UpstreamReadError as e:
            res.error = f"{type(e).__name__}: {e}"
            return res
        finally:
            resp.close()  # back to the pool after a complete body; otherwise dropped (the replica aborts)


def make_client(base_url: str, api_key: str | None, timeout_s: float = 600.0) -> httpx.AsyncClient:
    """No connection cap (open-loop arrivals must not queue in the client's pool); the tenant's key."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=httpx.Timeout(timeout_s, connect=30.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )  # fmt: skip


# ---- output ----------------------------------------------------------------------------------------


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, str | int | float | bool)


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    """``data`` as indented JSON, except that a list of scalars (a table row) stays on one line: per-request
    tables stay readable and an order of magnitude smaller than with one value per line."""
    rows: list[str] = []
    nonce = uuid.uuid4().hex  # placeholders no real string can collide with

    def pack(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: pack(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            if v and all(_scalar(x) for x in v):
                rows.append(json.dumps(list(v), default=str))
                return f"\x00{nonce}:{len(rows) - 1}\x00"
            return [pack(x) for x in v]
        return v

    pattern = re.compile(rf'"\\u0000{nonce}:(\d+)\\u0000"')
    text = pattern.sub(lambda m: rows[int(m.group(1))], json.dumps(pack(data), indent=2, default=str))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)
    print(f"wrote {path}")
    return path


# ---- CPU -------------------------------------------------------------------------------------------


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds of these processes and all their descendants so far (``/proc``)."""
    total = 0.0
    tick = 100.0
    with contextlib.suppress(ValueError, OSError, AttributeError):
        import os

        tick = float(os.sysconf("SC_CLK_TCK"))
    for root in pids:
        for p in servers.process_tree(root):
            f = servers._stat_fields(p)  # [state, ppid, pgrp, ...]: utime, stime are fields 14, 15 of stat
            if f is not None:
                total += (int(f[11]) + int(f[12])) / tick
    return total
