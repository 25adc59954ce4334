"""Wake-on-request: a request for a model whose replicas all sleep wakes them, once for the whole fleet.

Within a gateway, concurrent requests share one wake task per model; across gateways the Redis wake
lock (``SET NX PX``) lets one gateway send the engines' ``/wake_up`` while the others wait for the
heartbeats to say ``awake``. Every waiter gives up after ``timeout`` seconds with a 503, and at once
(503 ``gateway_shutdown``) when the gateway's shutdown grace period ends (``stop``).

Only verified replicas are ever called (the fleet snapshot and the admin API hold no others), with the model's
own admin token (``ReplicaTrust.admin_token``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from kvfleet_common.schemas import Heartbeat
from kvfleet_common.server_kit.http import ApiError
from kvfleet_gateway.fleet import FleetView
from kvfleet_gateway.metrics import GatewayMetrics
from kvfleet_gateway.replica_trust import ReplicaTrust
from kvfleet_gateway.store_calls import REDIS_ERRORS, StoreCalls
from kvfleet_gateway.upstream import Upstream, UpstreamConnectError, UpstreamReadError

logger = logging.getLogger(__name__)


async def call_replica(
    client: Upstream, hb: Heartbeat, action: str, admin_token: str | None, level: int = 1
) -> tuple[bool, str]:
    """POST the engine admin endpoint ``/sleep`` or ``/wake_up``; (ok, detail)."""
    path = "/sleep" if action == "sleep" else "/wake_up"
    params = {"level": level} if action == "sleep" else None
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    try:
        status, text = await client.call(f"{hb.base_url.rstrip('/')}{path}", params, headers, timeout_s=300)
    except (UpstreamConnectError, UpstreamReadError) as e:
        return False, str(e)
    if status != 200:
        return False, f"HTTP {status}: {text[:200]}"
    return True, "ok"


def _shutting_down() -> ApiError:
    return ApiError(503, "the gateway is shutting down; retry on another gateway", code="gateway_shutdown",
                    headers={"Retry-After": "1"})  # fmt: skip


class Waker:
    def __init__(
        self, fleet: FleetView, redis_calls: StoreCalls, client: Upstream, metrics: GatewayMetrics,
        trust: ReplicaTrust, holder: str, timeout: float,
    ) -> None:  # fmt: skip
        self.fleet = fleet
        self.redis = redis_calls
        self.client = client
        self.metrics = metrics
        self.trust = trust
        self.holder = holder
        self.timeout = timeout
        self._tasks: dict[str, asyncio.Task] = {}
        self._stopped = asyncio.Event()

    def stop(self) -> None:
        """Past the shutdown grace period: every waiter ends with a 503 now, not a cancellation later."""
        self._stopped.set()
        for task in self._tasks.values():
            task.cancel()

    async def ensure_awake(self, model: str) -> None:
        if self._stopped.is_set():
            raise _shutting_down()
        task = self._tasks.get(model)
        if task is None or task.done():
            task = asyncio.create_task(self._wake(model))
            self._tasks[model] = task
        stopped = asyncio.ensure_future(self._stopped.wait())
        try:
            await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if self._stopped.is_set():
            raise _shutting_down()
        task.result()  # the wake's own outcome (its 503 on timeout)

    async def wake_replicas(self, model: str, replicas: list[Heartbeat]) -> dict[str, str]:
        """Wake ``replicas`` (verified ones: see the module docstring) now (admin path and wake-on-request):
        replica id -> "ok" or the error."""
        token = self.trust.admin_token(model)
        results = await asyncio.gather(*(call_replica(self.client, hb, "wake", token) for hb in replicas))
        out = {}
        for hb, (ok, detail) in zip(replicas, results):
            out[hb.replica_id] = detail
            if ok:
                self.fleet.mark_awake(model, hb.replica_id)
        return out

    async def _wake(self, model: str) -> None:
        deadline = time.monotonic() + self.timeout
        token = f"{self.holder}:{uuid.uuid4().hex[:8]}"
        store = self.redis.store
        logger.info("model %s is asleep: waking it for a waiting request", model)
        while True:
            view = self.fleet.model(model)
            if view is not None and view.awake():
                self.metrics.wakes.labels(model, "woke").inc()
                return
            if view is None or not view.replicas:
                self.metrics.wakes.labels(model, "failed").inc()
                raise ApiError(503, f"no replica of {model!r} is available", code="no_replica",
                               headers={"Retry-After": "5"})  # fmt: skip
            if time.monotonic() >= deadline:
                self.metrics.wakes.labels(model, "failed").inc()
                self.metrics.rejected.labels("wake_timeout").inc()
                raise ApiError(503, f"the model {model!r} is waking up and did not become ready within "
                               f"{self.timeout:.0f} s; retry later", code="model_waking",
                               headers={"Retry-After": "10"})  # fmt: skip
            try:
                got = await self.redis(
                    "acquire_wake_lock", "request", lambda: store.acquire_wake_lock(model, token)
                )
            except REDIS_ERRORS:
                got = True  # without Redis, de-duplication across gateways is lost; waking still works
            if got:
                if not self.trust.admin_token(model):
                    raise ApiError(503, f"the model {model!r} is asleep and this gateway has no admin token "
                                   "to wake it", code="model_sleeping", headers={"Retry-After": "30"})  # fmt: skip
                try:
                    results = await self.wake_replicas(model, view.sleeping())
                    logger.info("woke %s: %s", model, results)
                finally:
                    with contextlib.suppress(REDIS_ERRORS):
                        await self.redis(
                            "release_wake_lock", "request", lambda: store.release_wake_lock(model, token)
                        )
            await self.fleet.wait_changed(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
