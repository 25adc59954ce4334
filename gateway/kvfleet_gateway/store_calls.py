"""The gateway's calls to the fleet store (Redis): counted per operation, what counts as Redis being
unreachable, and the 503 a request gets then."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.exceptions

from kvfleet_common.fleet_store.store import AsyncFleetStore
from kvfleet_common.server_kit.http import ApiError
from kvfleet_gateway.metrics import GatewayMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")
REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class RedisUnavailable(Exception):
    """Redis cannot be reached and the gateway's last snapshot is too old to serve from."""


def store_unavailable_error(reason: object) -> ApiError:
    """The 503 a client gets while the fleet store (Redis) cannot answer for its request. The error code
    ``registry_unavailable`` is part of the gateway's API (clients and dashboards match it), kept as is."""
    return ApiError(
        503, f"{reason}; retry shortly", code="registry_unavailable", headers={"Retry-After": "2"}
    )


class StoreCalls:
    """Runs fleet-store operations, counting round trips and errors per operation (metrics), and logs
    once when Redis becomes unreachable and once when it is back.

    Each store method used through it is one round trip (the fleet store's own tests count them)."""

    def __init__(self, store: AsyncFleetStore, metrics: GatewayMetrics) -> None:
        self.store = store
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
                logger.warning("Redis unreachable (%s: %s); serving from the last snapshot", op, e)
            raise
        if self._down_since is not None:
            logger.info("Redis reachable again after %.1f s", time.monotonic() - self._down_since)
            self._down_since = None
        return result
