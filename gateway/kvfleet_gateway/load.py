"""This gateway's in-flight load and finished usage, and the background task that shares them via Redis.

The request path only changes local counters (no await, no Redis). A reporter task publishes the
absolute counts with ``Registry.report_gateway`` -- every ``interval`` (~50 ms) while something
changed, and at least every second so the hash never expires while the gateway lives. Other gateways
read them inside their admission round trip, so in-flight counts and queued prompt tokens are shared
fleet-wide at most one interval late, without a Redis write on any request's path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from dataclasses import dataclass

from kvfleet_common.registry import UsageRecord
from kvfleet_gateway.fleet import REDIS_ERRORS, RedisCalls

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
MAX_PENDING_USAGE = 100_000  # while Redis is down, usage queues up to this many records, then drops


@dataclass(slots=True)
class Ticket:
    """One proxied request's share of the load (released exactly once)."""

    replica_id: str
    tenant: str
    queued_tokens: int
    prefilled: bool = False
    released: bool = False


class LoadTracker:
    def __init__(self, gateway_id: str, redis_calls: RedisCalls, interval: float = 0.05) -> None:
        self.gateway_id = gateway_id
        self._redis = redis_calls
        self.interval = interval
        self.replica_inflight: Counter[str] = Counter()
        self.replica_queued: Counter[str] = Counter()
        self.tenant_inflight: Counter[str] = Counter()
        self._usage: list[UsageRecord] = []
        self._dirty = asyncio.Event()

    # ---- request path (synchronous, local) -------------------------------------------------------------

    def start(self, replica_id: str, tenant: str, queued_tokens: int) -> Ticket:
        self.replica_inflight[replica_id] += 1
        self.replica_queued[replica_id] += queued_tokens
        self.tenant_inflight[tenant] += 1
        self._dirty.set()
        return Ticket(replica_id, tenant, queued_tokens)

    def prefilled(self, t: Ticket) -> None:
        """The replica produced the first token: the request's prompt is no longer queued work."""
        if not t.prefilled and not t.released:
            t.prefilled = True
            self.replica_queued[t.replica_id] -= t.queued_tokens
            self._dirty.set()

    def release(self, t: Ticket, usage: UsageRecord | None) -> None:
        if t.released:
            return
        self.prefilled(t)
        t.released = True
        self.replica_inflight[t.replica_id] -= 1
        self.tenant_inflight[t.tenant] -= 1
        for c in (self.replica_inflight, self.replica_queued, self.tenant_inflight):
            c += Counter()  # drops zero entries
        if usage is not None and len(self._usage) < MAX_PENDING_USAGE:
            self._usage.append(usage)
        self._dirty.set()

    def local_replica_load(self, replica_id: str) -> tuple[int, int]:
        return self.replica_inflight[replica_id], self.replica_queued[replica_id]

    # ---- reporter (background) -----------------------------------------------------------------------

    async def report(self) -> None:
        usage, self._usage = self._usage, []
        load = {r: (n, self.replica_queued[r]) for r, n in self.replica_inflight.items()}
        reg = self._redis.registry
        try:
            await self._redis(
                "report_gateway", "background",
                lambda: reg.report_gateway(self.gateway_id, load, dict(self.tenant_inflight), usage),
            )  # fmt: skip
        except BaseException:
            self._usage[:0] = usage  # keep the usage for the next report
            raise

    async def run(self) -> None:
        while True:
            self._dirty.clear()
            try:
                await self.report()
            except REDIS_ERRORS:
                await asyncio.sleep(HEARTBEAT_S)  # logged once by RedisCalls
                continue
            except Exception:
                logger.exception("reporting gateway load failed")
            await asyncio.sleep(self.interval)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), HEARTBEAT_S)

    async def close(self) -> None:
        """Flush pending usage and remove this gateway's load (its requests are finished)."""
        reg = self._redis.registry
        try:
            await self.report()
            await self._redis("remove_gateway", "background", lambda: reg.remove_gateway(self.gateway_id))
        except REDIS_ERRORS:
            logger.warning("could not flush usage to Redis at shutdown (%d records lost)", len(self._usage))
