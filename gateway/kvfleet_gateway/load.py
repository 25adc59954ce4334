"""This gateway's in-flight load and finished usage, and the background task that shares them via Redis.

The request path only changes local counters (no await, no Redis). A reporter task publishes the
absolute counts with ``FleetStore.report_gateway`` -- every ``interval`` (~50 ms) while something
changed, and at least every second so the hash never expires while the gateway lives. Other gateways
read them inside their admission round trip, so in-flight counts and queued prompt tokens are shared
fleet-wide at most one interval late, without a Redis write on any request's path. Per model it also
publishes the requests in flight and the requests held for the model (no awake replica yet:
``kvfleet_gateway.wake``), the demand the operator's autoscaler reads (``FleetStore.model_load``).

Admission state lives here too: each request's ``Lease`` (its concurrency slot, which the admission round
trip takes in Redis, and its tokens/min reservation). A released lease is removed from Redis by the next
admission of its tenant on this gateway (inside that round trip) or by the next report, whichever comes
first; reports renew the live ones and settle reservations against real usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from kvfleet_common.fleet_store.admission import Reservation, UsageRecord
from kvfleet_gateway.store_calls import REDIS_ERRORS, StoreCalls

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
MAX_PENDING_USAGE = 100_000  # while Redis is down, usage queues up to this many records, then drops
MAX_RELEASES_PER_ADMIT = 64  # released leases an admission removes in passing (the report takes the rest)


@dataclass(slots=True)
class Ticket:
    """One proxied request's share of the load (released exactly once)."""

    replica_id: str
    tenant: str
    queued_tokens: int
    model: str = ""
    prefilled: bool = False
    released: bool = False


@dataclass(slots=True, eq=False)
class Lease:
    """One request's admission, released exactly once (``LoadTracker.release_lease``).

    ``shared``: the tenant has a concurrency limit, so the admission round trip takes the slot ``id`` in
    ``kvf:inflight:<tenant>``; ``reservation``: the tokens it reserved against tokens/min, if any."""

    id: str
    tenant: str
    shared: bool
    reservation: Reservation | None = None
    admitted: bool = False
    released: bool = False


def _drop_spent(counts: Counter[str], key: str) -> None:
    """Remove ``key`` once its count is down to zero (or below), as ``counts += Counter()`` would."""
    if counts.get(key, 1) <= 0:
        del counts[key]


class LoadTracker:
    def __init__(self, gateway_id: str, redis_calls: StoreCalls, interval: float = 0.05) -> None:
        self.gateway_id = gateway_id
        self._redis = redis_calls
        self.interval = interval
        self.replica_inflight: Counter[str] = Counter()
        self.replica_queued: Counter[str] = Counter()
        self.tenant_inflight: Counter[str] = Counter()
        self.model_inflight: Counter[str] = Counter()
        self.model_queued: Counter[str] = Counter()
        self.model_held: Counter[str] = Counter()  # requests waiting for the model to have an awake replica
        self._usage: list[UsageRecord] = []
        self._dirty = asyncio.Event()
        self.leases: dict[str, dict[str, Lease]] = {}  # tenant -> id -> lease not released yet
        self._released: dict[str, set[str]] = {}  # tenant -> released shared leases still in Redis
        self._refunds: list[Reservation] = []
        self._lease_ids = itertools.count(1)
        self._renewed_at = 0.0  # monotonic time of the last report that renewed the live leases

    # ---- request path (synchronous, local) -------------------------------------------------------------

    def start(self, replica_id: str, tenant: str, queued_tokens: int, model: str = "") -> Ticket:
        self.replica_inflight[replica_id] += 1
        self.replica_queued[replica_id] += queued_tokens
        self.tenant_inflight[tenant] += 1
        if model:
            self.model_inflight[model] += 1
            self.model_queued[model] += queued_tokens
        self._dirty.set()
        return Ticket(replica_id, tenant, queued_tokens, model)

    def prefilled(self, t: Ticket) -> None:
        """The replica produced the first token: the request's prompt is no longer queued work."""
        if not t.prefilled and not t.released:
            t.prefilled = True
            self.replica_queued[t.replica_id] -= t.queued_tokens
            if t.model:
                self.model_queued[t.model] -= t.queued_tokens
            self._dirty.set()

    def release(self, t: Ticket, usage: UsageRecord | None) -> None:
        if t.released:
            return
        self.prefilled(t)
        t.released = True
        self.replica_inflight[t.replica_id] -= 1
        self.tenant_inflight[t.tenant] -= 1
        if t.model:
            self.model_inflight[t.model] -= 1
        # entries that reached zero go (the reports publish every entry): only the ones this ticket touched
        _drop_spent(self.replica_inflight, t.replica_id)
        _drop_spent(self.replica_queued, t.replica_id)
        _drop_spent(self.tenant_inflight, t.tenant)
        if t.model:
            _drop_spent(self.model_inflight, t.model)
            _drop_spent(self.model_queued, t.model)
        if usage is not None and len(self._usage) < MAX_PENDING_USAGE:
            self._usage.append(usage)
        self._dirty.set()

    def local_replica_load(self, replica_id: str) -> tuple[int, int]:
        return self.replica_inflight[replica_id], self.replica_queued[replica_id]

    def hold(self, model: str) -> None:
        """A request waits for the model to get an awake replica (published as ``mh:<model>``)."""
        self.model_held[model] += 1
        self._dirty.set()

    def unhold(self, model: str) -> None:
        """The request's wait is over, however it ended (exactly once per ``hold``)."""
        self.model_held[model] -= 1
        if self.model_held[model] <= 0:
            del self.model_held[model]
        self._dirty.set()

    def model_counts(self, models: Iterable[str]) -> dict[str, tuple[int, int, int]]:
        """model -> (requests in flight, requests held, queued prompt tokens) on this gateway, for ``models``
        (zeros included) and every model with a count."""
        names = set(models) | self.model_inflight.keys() | self.model_held.keys() | self.model_queued.keys()
        return {m: (self.model_inflight[m], self.model_held[m], self.model_queued[m]) for m in names}

    # ---- admission (synchronous, local) ------------------------------------------------------------------

    def new_lease(self, tenant: str, shared: bool) -> Lease:
        """A lease for a request about to be admitted (ids are unique fleet-wide: gateway id + counter)."""
        lease = Lease(f"{self.gateway_id}/{next(self._lease_ids)}", tenant, shared)
        self.leases.setdefault(tenant, {})[lease.id] = lease
        return lease

    def admit_locally(self, lease: Lease, max_concurrent: int | None) -> bool:
        """Admission while Redis is unreachable: the tenant's requests admitted on this gateway against its
        limit. Check and count happen without an await between them, so a burst cannot slip through."""
        live = self.leases.get(lease.tenant, {}).values()
        if max_concurrent is not None and sum(x.admitted for x in live) >= max_concurrent:
            return False
        lease.admitted = True
        return True

    def release_lease(self, lease: Lease, refund: bool, in_redis: bool = True) -> None:
        """The request is over (or refused): its slot is free here at once, and in Redis with the next
        admission of the tenant or the next report (``in_redis=False``: Redis refused it, nothing to
        remove). ``refund`` hands the reservation back. Idempotent: the first call counts."""
        if lease.released:
            return
        lease.released = True
        live = self.leases.get(lease.tenant)
        if live is not None:
            live.pop(lease.id, None)
            if not live:
                del self.leases[lease.tenant]
        if in_redis and lease.shared:
            self._released.setdefault(lease.tenant, set()).add(lease.id)
        if refund and lease.reservation is not None and len(self._refunds) < MAX_PENDING_USAGE:
            self._refunds.append(lease.reservation)
        self._dirty.set()

    def released_leases(self, tenant: str) -> list[str]:
        """Released leases of the tenant still in Redis, for its next admission to remove in passing."""
        return list(itertools.islice(self._released.get(tenant, ()), MAX_RELEASES_PER_ADMIT))

    def removed(self, tenant: str, lease_ids: Iterable[str]) -> None:
        """A round trip that removed these released leases from Redis succeeded."""
        pending = self._released.get(tenant)
        if pending is not None:
            pending.difference_update(lease_ids)
            if not pending:
                del self._released[tenant]

    # ---- reporter (background) -----------------------------------------------------------------------

    async def report(self) -> None:
        usage, self._usage = self._usage, []
        refunds, self._refunds = self._refunds, []
        released = {t: set(ids) for t, ids in self._released.items()}
        now = time.monotonic()
        leases = None
        if now - self._renewed_at >= HEARTBEAT_S:  # a lease lives LEASE_TTL_S (10 s): renewed every ~1 s
            leases = {t: [i for i, x in live.items() if x.shared] for t, live in self.leases.items()}
        load = {r: (n, self.replica_queued[r]) for r, n in self.replica_inflight.items()}
        per_model = {m: (self.model_inflight[m], self.model_held[m])
                     for m in self.model_inflight.keys() | self.model_held.keys()}  # fmt: skip
        store = self._redis.store
        try:
            await self._redis(
                "report_gateway", "background",
                lambda: store.report_gateway(self.gateway_id, load, dict(self.tenant_inflight), usage,
                                           leases=leases, released=released, refunds=refunds,
                                           model_load=per_model),
            )  # fmt: skip
        except BaseException:
            self._usage[:0] = usage  # keep the usage and the refunds for the next report
            self._refunds[:0] = refunds
            raise
        if leases is not None:
            self._renewed_at = now
        for tenant, ids in released.items():
            self.removed(tenant, ids)

    async def run(self) -> None:
        while True:
            self._dirty.clear()
            try:
                await self.report()
            except REDIS_ERRORS:
                await asyncio.sleep(HEARTBEAT_S)  # logged once by StoreCalls
                continue
            except Exception:
                logger.exception("reporting gateway load failed")
            await asyncio.sleep(self.interval)
            # not asyncio.wait_for: on Python 3.11 it drops a cancellation that comes as the event is set
            # (the requests ended at shutdown set it), and the reporter outlived the gateway's shutdown
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HEARTBEAT_S):
                    await self._dirty.wait()

    async def close(self) -> None:
        """Flush pending usage and remove this gateway's load (its requests are finished)."""
        store = self._redis.store
        try:
            await self.report()
            await self._redis("remove_gateway", "background", lambda: store.remove_gateway(self.gateway_id))
        except REDIS_ERRORS:
            logger.warning("could not flush usage to Redis at shutdown (%d records lost)", len(self._usage))
