"""The gateway's views of Redis (tenant cache, fleet snapshot) against a real Redis server."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib

from kvfleet_common.fleet_store.store import AsyncFleetStore
from kvfleet_common.schemas import TenantRecord
from kvfleet_gateway.metrics import GatewayMetrics
from kvfleet_gateway.store_calls import REDIS_ERRORS, StoreCalls
from kvfleet_gateway.tenant_cache import TenantCache


def round_trips(metrics: GatewayMetrics, path: str) -> float:
    value = metrics.registry.get_sample_value(
        "kvfleet_gateway_redis_round_trips_total", {"op": "tenant_for_key_hash", "path": path}
    )
    return value or 0.0


def test_concurrent_lookups_share_one_round_trip_and_refreshes_happen_behind_requests(redis_server):
    async def scenario() -> None:
        store = AsyncFleetStore.from_url(redis_server.url)
        key_hash = hashlib.sha256(b"sk-test").hexdigest()
        await store.put_tenant(TenantRecord(name="acme"))
        await store.add_api_key("acme", key_hash)
        metrics = GatewayMetrics()
        cache = TenantCache(StoreCalls(store, metrics), ttl=0.2, max_staleness=30)

        found = await asyncio.gather(*(cache.lookup(key_hash) for _ in range(50)))
        assert {t.name for t in found} == {"acme"}
        assert round_trips(metrics, "request") == 1  # 50 requests, one lookup

        await asyncio.sleep(0.25)  # past the TTL, within 2 x TTL: answered at once, refreshed behind
        await store.delete_tenant("acme")
        assert (await cache.lookup(key_hash)).name == "acme"
        await asyncio.sleep(0.05)
        assert round_trips(metrics, "background") == 1 and round_trips(metrics, "request") == 1
        assert await cache.lookup(key_hash) is None  # the refresh saw the deletion

        await asyncio.sleep(0.5)  # past 2 x TTL: the request waits for a fresh lookup
        assert await cache.lookup(key_hash) is None
        assert round_trips(metrics, "request") == 2
        await store.aclose()

    asyncio.run(scenario())


def test_a_model_lost_with_a_redis_restart_is_unavailable_not_unknown(redis_server):
    """After an outage, a model Redis forgot (restarted empty) stays known, without replicas, until its
    engines re-register: 503 territory, not 404. Without an outage, a model that vanished was deleted."""
    from kvfleet_common.fleet_store.store import FleetStore
    from kvfleet_gateway.fleet import FleetView
    from tests.common.test_fleet_store import MODEL, register

    async def scenario() -> None:
        register(FleetStore.from_url(redis_server.url), "r-0#1")
        calls = StoreCalls(AsyncFleetStore.from_url(redis_server.url), GatewayMetrics())
        view = FleetView(calls, calls.metrics, interval=0.5, max_staleness=30)
        await view.refresh()
        assert [hb.replica_id for hb in view.model(MODEL).replicas] == ["r-0#1"]

        redis_server.stop()
        with contextlib.suppress(*REDIS_ERRORS):
            await view.refresh()  # fails: the outage is noted
        redis_server.start()  # empty
        await view.refresh()
        assert view.model(MODEL) is not None and view.model(MODEL).replicas == []
        register(FleetStore.from_url(redis_server.url), "r-0#1")  # re-registered
        await view.refresh()
        assert len(view.model(MODEL).replicas) == 1

        quiet = FleetView(calls, calls.metrics, interval=0.5, max_staleness=30)
        calls.last_failure = None
        await quiet.refresh()
        redis_server.flush()  # no outage seen: the model was deleted
        await quiet.refresh()
        assert quiet.model(MODEL) is None
        await calls.store.aclose()

    asyncio.run(scenario())
