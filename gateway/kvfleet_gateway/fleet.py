"""What the gateway knows about the fleet: models, their live replicas and policies.

Everything is read from Redis by background refreshes and kept as a snapshot, so the request path
never waits for store reads: the only Redis round trip on a request's path is the admission call
(``FleetStore.admit``). When Redis is unreachable the last snapshot keeps serving for
``max_staleness`` seconds; after that the gateway answers 503 instead of routing on a stale map.
Only replicas whose heartbeats verify (``kvfleet_gateway.replica_trust``) enter the snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from kvfleet_common.schemas import Heartbeat, ModelPolicy
from kvfleet_gateway.metrics import GatewayMetrics
from kvfleet_gateway.replica_trust import ReplicaTrust
from kvfleet_gateway.store_calls import REDIS_ERRORS, RedisUnavailable, StoreCalls

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelView:
    name: str
    replicas: list[Heartbeat] = field(default_factory=list)
    policy: ModelPolicy | None = None

    def awake(self) -> list[Heartbeat]:
        return [hb for hb in self.replicas if hb.state == "awake"]

    def sleeping(self) -> list[Heartbeat]:
        return [hb for hb in self.replicas if hb.state == "sleeping"]


class FleetView:
    """Snapshot of models -> live replicas + policy, refreshed every ``interval`` seconds.

    After a Redis outage (Redis restarted empty), a model missing from Redis is kept with no replicas
    for up to ``max_staleness`` seconds: its engines re-register within a heartbeat, and meanwhile a
    client should get a 503 (retry) for a model that existed a moment ago, not a 404 (gone for good).
    Without a recent outage a missing model was deleted: 404 at once."""

    def __init__(
        self, redis_calls: StoreCalls, metrics: GatewayMetrics, interval: float, max_staleness: float,
        trust: ReplicaTrust | None = None,
    ):  # fmt: skip
        self._redis = redis_calls
        self._metrics = metrics
        self.trust = trust or ReplicaTrust(None, None)  # default: every heartbeat trusted (tests, no root)
        self._unverified: dict[str, int] = {}  # model -> replicas left out of the last refresh
        self.interval = interval
        self.max_staleness = max_staleness
        self.models: dict[str, ModelView] = {}
        self.refreshed_at: float | None = None  # monotonic time of the last complete refresh
        self._down_until: dict[str, float] = {}  # replica id -> monotonic time: avoid after a failure
        self._missing_since: dict[str, float] = {}  # model -> monotonic time it left Redis' model list
        self._changed = asyncio.Event()
        self._kick = asyncio.Event()

    # ---- reads (request path) ------------------------------------------------------------------------

    def check_fresh(self) -> None:
        if self.refreshed_at is None or time.monotonic() - self.refreshed_at > self.max_staleness:
            raise RedisUnavailable("the fleet store (Redis) is unreachable")

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
        store = self._redis.store
        names = await self._redis("list_models", "background", store.list_models)
        fresh: dict[str, ModelView] = {}
        unverified: dict[str, int] = {}
        for name in names:
            live = await self._redis("live_replicas", "background", lambda n=name: store.live_replicas(n))
            replicas, rejected = self.trust.split(live)
            unverified[name] = len(rejected)
            policy = await self._redis(
                "get_model_policy", "background", lambda n=name: store.get_model_policy(n)
            )
            fresh[name] = ModelView(name, replicas, policy)
        now, listed = time.monotonic(), set(fresh)
        failed = self._redis.last_failure
        if failed is not None and now - failed < self.max_staleness:
            for name, old in self.models.items():
                if name not in fresh and now - self._missing_since.setdefault(name, now) < self.max_staleness:
                    fresh[name] = ModelView(name, [], old.policy)
        self._missing_since = {n: t for n, t in self._missing_since.items() if n in fresh and n not in listed}
        self.models = fresh
        self._unverified = unverified
        self.refreshed_at = time.monotonic()
        self._publish_gauges()
        self._changed.set()

    def _publish_gauges(self) -> None:
        self._metrics.replicas.clear()
        self._metrics.unverified_replicas.clear()
        for name, n in self._unverified.items():
            self._metrics.unverified_replicas.labels(name).set(n)
        for view in self.models.values():
            for state in ("starting", "awake", "sleeping", "draining"):
                n = sum(1 for hb in view.replicas if hb.state == state)
                self._metrics.replicas.labels(view.name, state).set(n)

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except REDIS_ERRORS:
                pass  # logged once by StoreCalls; the snapshot keeps serving until max_staleness
            except Exception:
                logger.exception("refreshing the fleet snapshot failed")
            self._kick.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.interval)


def _with_state(hb: Heartbeat, state: str) -> Heartbeat:
    import msgspec

    return msgspec.structs.replace(hb, state=state)
