"""Holding a request until its model has an awake replica: wake-on-request and cold start from zero.

Wake: a request for a model whose replicas all sleep wakes them, once for the whole fleet. Within a
gateway, concurrent requests share one wake task per model; across gateways the Redis wake lock
(``SET NX PX``) lets one gateway send the engines' ``/wake_up`` while the others wait for the heartbeats
to say ``awake``.

Cold start: a model whose policy has ``scale_from_zero`` (it is autoscaled) may have no replica at all,
or only ones still starting. Its requests wait for an awake replica to appear in the fleet snapshot; the
gateway only waits (the operator starts the replica): every held request is counted in this gateway's
load hash (``mh:<model>``, published by ``LoadTracker``'s reporter within ~50 ms, no Redis call on the
request's path), which is the demand the operator's autoscaler sees through ``FleetStore.model_load``,
whichever gateway holds it. A model without ``scale_from_zero`` and no replica gets a 503 ``no_replica``
at once, as before.

Every held request (both kinds; counted in ``mh:`` too while a wake runs) gives up after ``timeout``
seconds with a 503 (``model_waking`` / ``model_cold_start``, with Retry-After), and at once (503
``gateway_shutdown``) when the gateway's shutdown grace period ends (``stop``).

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
from kvfleet_gateway.fleet import FleetView, ModelView
from kvfleet_gateway.load import LoadTracker
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


def _no_replica(model: str) -> ApiError:
    return ApiError(
        503, f"no replica of {model!r} is available", code="no_replica", headers={"Retry-After": "5"}
    )


def scales_from_zero(view: ModelView) -> bool:
    return view.policy is not None and view.policy.scale_from_zero


# a hold's outcome (``kvfleet_gateway_holds_total``) by the code of the 503 that ended it; a hold ended by
# another error (nothing left to wake for a model that does not scale from zero) is not counted
_HOLD_OUTCOMES = {"model_waking": "timeout", "model_cold_start": "timeout", "gateway_shutdown": "shutdown"}


class Waker:
    def __init__(
        self, fleet: FleetView, redis_calls: StoreCalls, client: Upstream, metrics: GatewayMetrics,
        trust: ReplicaTrust, holder: str, timeout: float, load: LoadTracker | None = None,
    ) -> None:  # fmt: skip
        self.fleet = fleet
        self.load = load  # counts the held requests per model (None: not counted)
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

    def can_hold(self, view: ModelView) -> bool:
        """Whether a request for the model that found no awake replica is held (``ensure_awake``) instead
        of answered 503 at once: a replica sleeps (wake), or the model scales from zero (cold start)."""
        return bool(view.sleeping()) or scales_from_zero(view)

    async def ensure_awake(self, model: str) -> None:
        """Hold the request until the model has an awake replica (see the module docstring), counted as
        held in this gateway's load and in ``kvfleet_gateway_holds_total`` / ``_hold_seconds``."""
        if self._stopped.is_set():
            raise _shutting_down()
        view = self.fleet.model(model)
        kind = "wake" if view is not None and view.sleeping() else "cold_start"
        started = time.monotonic()
        outcome: str | None = None
        if self.load is not None:
            self.load.hold(model)
        try:
            await self._until_awake(model, started + self.timeout)
            outcome = "served"
        except ApiError as e:
            outcome = _HOLD_OUTCOMES.get(e.code or "")
            raise
        finally:
            if self.load is not None:
                self.load.unhold(model)
            if outcome is not None:
                self.metrics.holds.labels(model, kind, outcome).inc()
                self.metrics.hold_seconds.labels(model, kind).observe(time.monotonic() - started)

    async def _until_awake(self, model: str, deadline: float) -> None:
        while True:
            view = self.fleet.model(model)
            if view is not None and view.awake():
                return
            if view is not None and view.sleeping():
                if time.monotonic() >= deadline:  # woken once, asleep again since: no second full wait
                    raise self._wake_timed_out(model)
                await self._join_wake(model)  # its own 503 when it times out
                continue  # woken; or its replicas vanished (scaled to zero meanwhile): a cold start now
            if view is None or not scales_from_zero(view):
                raise _no_replica(model)
            if time.monotonic() >= deadline:
                self.metrics.rejected.labels("cold_start_timeout").inc()
                raise ApiError(503, f"the model {model!r} is scaled to zero and no replica of it became ready "
                               f"within {self.timeout:.0f} s; one is being started, retry later",
                               code="model_cold_start", headers={"Retry-After": "30"})  # fmt: skip
            # the snapshot is refreshed every ``fleet.interval`` (from Redis, in the background): looking
            # again at that pace costs no Redis call, however many requests wait, however long. (Not
            # asyncio.wait_for: on Python 3.11 it can drop a cancellation that comes as the event is set.)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(self.fleet.interval, deadline - time.monotonic())):
                    await self._stopped.wait()
            if self._stopped.is_set():
                raise _shutting_down()

    def _wake_timed_out(self, model: str) -> ApiError:
        self.metrics.rejected.labels("wake_timeout").inc()
        return ApiError(503, f"the model {model!r} is waking up and did not become ready within "
                        f"{self.timeout:.0f} s; retry later", code="model_waking",
                        headers={"Retry-After": "10"})  # fmt: skip

    async def _join_wake(self, model: str) -> None:
        """Wait for the model's wake task (one per model; started if none runs), or for ``stop``."""
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
                if view is not None and scales_from_zero(view):
                    return  # scaled to zero while asleep: the waiters hold for a cold start instead
                raise _no_replica(model)
            if time.monotonic() >= deadline:
                self.metrics.wakes.labels(model, "failed").inc()
                raise self._wake_timed_out(model)
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
