"""API-key hash -> tenant record, cached on the gateway (see ``TenantCache``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvfleet_common.schemas import TenantRecord
from kvfleet_gateway.store_calls import REDIS_ERRORS, RedisUnavailable, StoreCalls


class TenantCache:
    """API-key hash -> tenant record, cached for ``ttl`` seconds (so a revoked key stops working within
    ``ttl`` plus one lookup on every gateway; the gateway that revoked it forgets it at once). During a
    Redis outage entries keep answering for ``max_staleness`` seconds.

    Off the request path where possible: an entry between ``ttl`` and ``2 * ttl`` old answers at once
    while one background lookup per key refreshes it, and concurrent requests for a key nobody has looked
    up share one lookup (without both, every request arriving during a refill paid a round trip:
    ~0.23 extra per request at 100 streams)."""

    def __init__(self, redis_calls: StoreCalls, ttl: float, max_staleness: float) -> None:
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
            raise RedisUnavailable("the tenant store (Redis) is unreachable") from None

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
            task.exception()  # retrieved here: a background refresh's error is only counted (StoreCalls)

    async def _fetch(self, key_hash: str, path: str, generation: int) -> TenantRecord | None:
        reg = self._redis.store
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
