"""What the gateway knows about the fleet: models, their live replicas, configs and tenants.

Everything is read from Redis by background refreshes and kept as a snapshot, so the request path
never waits for registry reads: the only Redis round trip on a request's path is the admission call
(``Registry.admit``). When Redis is unreachable the last snapshot keeps serving for
``max_staleness`` seconds; after that the gateway answers 503 instead of routing on a stale map.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.exceptions

from kvfleet_common.http import ApiError
from kvfleet_common.registry import AsyncRegistry
from kvfleet_common.schemas import Heartbeat, ModelConfig, TenantRecord
from kvfleet_gateway.metrics import GatewayMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")
REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class RedisUnavailable(Exception):
    """Redis cannot be reached and the gateway's last snapshot is too old to serve from."""


def registry_unavailable(reason: object) -> ApiError:
    """The 503 a client gets while the registry (Redis) cannot answer for its request."""
    return ApiError(
        503, f"{reason}; retry shortly", code="registry_unavailable", headers={"Retry-After": "2"}
    )


class RedisCalls:
    """Runs registry operations, counting round trips and errors per operation (metrics).

    Each registry method used here is one round trip (the registry's own tests count them)."""

    def __init__(self, registry: AsyncRegistry, metrics: GatewayMetrics) -> None:
        self.registry = registry
        self.metrics = metrics
        self._down_since: float | None = None
        self.last_failure: float | None = None  # monotonic time of the last failed call

    async def __call__(self, op: str, path: str, call: Callable[[], Awaitable[T]]) -> T:
        self.metrics.redis_round_trips.labels(op, path).inc()
        try:
            result = await call()
        except REDIS_ERRORS as e:
            self.last_failure = time.monotonic()
            self.metrics.redis_errors.labels(op).inc()
            if self._down_since is None:
                self._down_since = time.monotonic()
                logger.warning("Redis unreachable (%s: %s); serving from the last known registry", op, e)
            raise
        if self._down_since is not None:
            logger.info("Redis reachable again after %.1f s", time.monotonic() - self._down_since)
            self._down_since = None
        return result


@dataclass(slots=True)
class ModelView:
    name: str
    replicas: list[Heartbeat] = field(default_factory=list)
    config: ModelConfig | None = None

    def awake(self) -> list[Heartbeat]:
        return [hb for hb in self.replicas if hb.state == "awake"]

    def sleeping(self) -> list[Heartbeat]:
        return [hb for hb in self.replicas if hb.state == "sleeping"]


class FleetView:
    """Snapshot of models -> live replicas + config, refreshed every ``interval`` seconds.

    After a Redis outage (Redis restarted empty), a model missing from Redis is kept with no replicas
    for up to ``max_staleness`` seconds: its engines re-register within a heartbeat, and meanwhile a
    client should get a 503 (retry) for a model that existed a moment ago, not a 404 (gone for good).
    Without a recent outage a missing model was deleted: 404 at once."""

    def __init__(
        self, redis_calls: RedisCalls, metrics: GatewayMetrics, interval: float, max_staleness: float
    ):
        self._redis = redis_calls
        self._metrics = metrics
        self.interval = interval
        self.max_staleness = max_staleness
        self.models: dict[str, ModelView] = {}
        self.refreshed_at: float | None = None  # monotonic time of the last complete refresh
        self._down_until: dict[str, float] = {}  # replica id -> monotonic time: avoid after a failure
        self._missing_since: dict[str, float] = {}  # model -> monotonic time it left the registry
        self._changed = asyncio.Event()
        self._kick = asyncio.Event()

    # ---- reads (request path) ------------------------------------------------------------------------

    def check_fresh(self) -> None:
        if self.refreshed_at is None or time.monotonic() - self.refreshed_at > self.max_staleness:
            raise RedisUnavailable("the model registry (Redis) is unreachable")

    def model(self, name: str) -> ModelView | None:
        return self.models.get(name)

    def is_down(self, replica_id: str) -> bool:
        until = self._down_until.get(replica_id)
        if until is None:
            return False
        if time.monotonic() >= until:
            del self._down_until[replica_id]
            return False
        return True

    def mark_down(self, replica_id: str, seconds: float) -> None:
        """Avoid a replica that refused a connection until its heartbeat expires (or it recovers)."""
        self._down_until[replica_id] = time.monotonic() + seconds

    def mark_awake(self, model: str, replica_id: str) -> None:
        """A wake the gateway saw succeed, ahead of the replica's next heartbeat."""
        self._mark(model, replica_id, "awake")

    def mark_sleeping(self, model: str, replica_id: str) -> None:
        """A replica answered that it sleeps (slept since its last heartbeat)."""
        self._mark(model, replica_id, "sleeping")

    def _mark(self, model: str, replica_id: str, state: str) -> None:
        view = self.models.get(model)
        if view is None:
            return
        view.replicas = [
            _with_state(hb, state) if hb.replica_id == replica_id else hb for hb in view.replicas
        ]
        self._changed.set()

    def request_refresh(self) -> None:
        self._kick.set()

    async def wait_changed(self, timeout: float) -> None:
        """Wait for the next refresh (or local change), asking for one right away."""
        self._changed.clear()
        self._kick.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    # ---- refresh (background) ------------------------------------------------------------------------

    async def refresh(self) -> None:
        reg = self._redis.registry
        names = await self._redis("list_models", "background", reg.list_models)
        fresh: dict[str, ModelView] = {}
        for name in names:
            replicas = await self._redis("live_replicas", "background", lambda n=name: reg.live_replicas(n))
            config = await self._redis(
                "get_model_config", "background", lambda n=name: reg.get_model_config(n)
            )
            fresh[name] = ModelView(name, replicas, config)
        now, listed = time.monotonic(), set(fresh)
        failed = self._redis.last_failure
        if failed is not None and now - failed < self.max_staleness:
            for name, old in self.models.items():
                if name not in fresh and now - self._missing_since.setdefault(name, now) < self.max_staleness:
                    fresh[name] = ModelView(name, [], old.config)
        self._missing_since = {n: t for n, t in self._missing_since.items() if n in fresh and n not in listed}
        self.models = fresh
        self.refreshed_at = time.monotonic()
        self._publish_gauges()
        self._changed.set()

    def _publish_gauges(self) -> None:
        self._metrics.replicas.clear()
        for view in self.models.values():
            for state in ("starting", "awake", "sleeping", "draining"):
                n = sum(1 for hb in view.replicas if hb.state == state)
                self._metrics.replicas.labels(view.name, state).set(n)

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except REDIS_ERRORS:
                pass  # logged once by RedisCalls; the snapshot keeps serving until max_staleness
            except Exception:
                logger.exception("refreshing the model registry failed")
            self._kick.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.interval)


def _with_state(hb: Heartbeat, state: str) -> Heartbeat:
    import msgspec

    return msgspec.structs.replace(hb, state=state)


class TenantCache:
    """API-key hash -> tenant record, cached for ``ttl`` seconds (so a revoked key stops working within
    ``ttl`` plus one lookup on every gateway; the gateway that revoked it forgets it at once). During a
    Redis outage entries keep answering for ``max_staleness`` seconds.

    Off the request path where possible: an entry between ``ttl`` and ``2 * ttl`` old answers at once
    while one background lookup per key refreshes it, and concurrent requests for a key nobody has looked
    up share one lookup (without both, every request arriving during a refill paid a round trip:
    ~0.23 extra per request at 100 streams)."""

    def __init__(self, redis_calls: RedisCalls, ttl: float, max_staleness: float) -> None:
        self._redis = redis_calls
        self.ttl = ttl
        self.max_staleness = max_staleness
        self._entries: dict[str, tuple[TenantRecord | None, float]] = {}
        self._lookups: dict[str, asyncio.Task] = {}  # key hash -> the lookup in flight
        self._generation = 0  # bumped by forget(): a lookup that started before must not write back

    async def lookup(self, key_hash: str) -> TenantRecord | None:
        now = time.monotonic()
        entry = self._entries.get(key_hash)
        if entry is not None:
            age = now - entry[1]
            if age < self.ttl:
                return entry[0]
            if age < 2 * self.ttl:
                self._lookup(key_hash, "background")
                return entry[0]
        try:
            return await asyncio.shield(self._lookup(key_hash, "request"))
        except REDIS_ERRORS:
            if entry is not None and now - entry[1] < self.max_staleness:
                return entry[0]
            raise RedisUnavailable("the tenant registry (Redis) is unreachable") from None

    def _lookup(self, key_hash: str, path: str) -> asyncio.Task:
        task = self._lookups.get(key_hash)
        if task is None:
            task = asyncio.create_task(self._fetch(key_hash, path, self._generation))
            self._lookups[key_hash] = task
            task.add_done_callback(lambda t: self._done(key_hash, t))
        return task

    def _done(self, key_hash: str, task: asyncio.Task) -> None:
        if self._lookups.get(key_hash) is task:
            del self._lookups[key_hash]
        if not task.cancelled():
            task.exception()  # retrieved here: a background refresh's error is only counted (RedisCalls)

    async def _fetch(self, key_hash: str, path: str, generation: int) -> TenantRecord | None:
        reg = self._redis.registry
        record = await self._redis("tenant_for_key_hash", path, lambda: reg.tenant_for_key_hash(key_hash))
        if generation == self._generation:
            if len(self._entries) > 100_000:  # bound memory against floods of random keys
                self._entries.clear()
            self._entries[key_hash] = (record, time.monotonic())
        return record

    def forget(self, tenant_name: str | None = None) -> None:
        """Drop cached entries (of one tenant, or all): admin changes on this gateway apply at once."""
        self._generation += 1
        self._lookups.clear()
        if tenant_name is None:
            self._entries.clear()
            return
        for k, (rec, _) in list(self._entries.items()):
            if rec is not None and rec.name == tenant_name:
                del self._entries[k]

    def snapshot(self) -> dict[str, Any]:
        return {"entries": len(self._entries)}
