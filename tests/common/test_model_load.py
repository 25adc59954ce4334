"""``FleetStore.model_load`` against a real redis-server: a model's demand summed over the gateways' load hashes
(what the operator's autoscaler reads each tick)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvfleet_common import redis_keys as keys
from kvfleet_common.fleet_store.admission import op_report_gateway
from kvfleet_common.fleet_store.model_load import ModelLoad
from kvfleet_common.fleet_store.store import AsyncFleetStore, FleetStore
from kvfleet_common.schemas import Heartbeat

MODEL = "org/cold-model"
OTHER = "other-model"


def register(store: FleetStore, replica_id: str, model: str) -> None:
    name, _ = keys.parse_replica_id(replica_id)
    now = time.time()
    store.claim_name(name, replica_id, ttl=60)
    store.publish_heartbeat(Heartbeat(replica_id=replica_id, name=name, model=model, base_url=f"http://{name}:8000",
                                      state="awake", block_size=16, max_model_len=256, started_at=now,
                                      updated_at=now), ttl=60)  # fmt: skip


@pytest.fixture
def store(redis_server):
    s = FleetStore.from_url(redis_server.url)
    yield s
    s.close()


def test_no_gateway_means_no_demand(store):
    assert store.model_load(MODEL) == ModelLoad(0, 0, 0, 0)


def test_two_gateways_reports_are_summed_and_other_models_ignored(store):
    register(store, "cold-0#1", MODEL)
    register(store, "cold-1#1", MODEL)
    register(store, "other-0#1", OTHER)
    store.report_gateway("gw-a", {"cold-0#1": (2, 300), "other-0#1": (5, 999)}, {"acme": 7},
                         model_load={MODEL: (2, 1), OTHER: (5, 4)})  # fmt: skip
    store.report_gateway("gw-b", {"cold-1#1": (1, 40)}, {"acme": 1}, model_load={MODEL: (1, 3)})
    store.report_gateway("gw-idle", {}, {})  # live, holds nothing: its hash is gone, it still counts
    assert store.model_load(MODEL) == ModelLoad(in_flight=3, held=4, queued_prompt_tokens=340, gateways=3)
    assert store.model_load(OTHER) == ModelLoad(in_flight=5, held=4, queued_prompt_tokens=999, gateways=3)
    assert store.model_load("never-seen") == ModelLoad(0, 0, 0, 3)

    # reports are absolute: a gateway's next report replaces its counts (zeros leave the fields out)
    store.report_gateway("gw-b", {}, {}, model_load={MODEL: (0, 0)})
    assert store.model_load(MODEL) == ModelLoad(2, 1, 300, 3)
    load = store.client.hgetall(keys.gateway_load("gw-a"))
    assert load[b"mi:" + MODEL.encode()] == b"2" and load[b"mh:" + MODEL.encode()] == b"1"
    assert not any(f.startswith((b"mi:", b"mh:")) for f in store.client.hgetall(keys.gateway_load("gw-b")))


def test_a_dead_gateways_hash_is_not_counted(store):
    stale = time.time() - 2 * keys.GATEWAY_LOAD_TTL_S  # its last report: longer ago than the load TTL
    store.report_gateway("gw-dead", {}, {}, now=stale, model_load={MODEL: (4, 6)})
    assert store.client.exists(keys.gateway_load("gw-dead"))  # the hash has not expired yet...
    assert store.model_load(MODEL) == ModelLoad(0, 0, 0, 0)  # ...but its gateway is gone: not counted
    store.report_gateway("gw-live", {}, {}, model_load={MODEL: (0, 2)})
    assert store.model_load(MODEL) == ModelLoad(0, 2, 0, 1)
    store.remove_gateway("gw-live")  # a gateway that stops removes its demand at once
    assert store.model_load(MODEL) == ModelLoad(0, 0, 0, 0)


def test_fields_use_the_key_contracts_prefixes_and_names_are_checked():
    cmds = next(op_report_gateway("gw-a", {}, {}, [], 1000.0, model_load={MODEL: (1, 2)})).commands
    [hset] = [c for c in cmds if c[0] == "HSET"]
    assert hset[2:] == (keys.LOAD_FIELD_MODEL_REQUESTS + MODEL, 1, keys.LOAD_FIELD_MODEL_HELD + MODEL, 2)
    with pytest.raises(ValueError):
        next(op_report_gateway("gw-a", {}, {}, [], 1000.0, model_load={"bad:name": (1, 0)}))


def test_async_store_reads_the_same(redis_server, store):
    store.report_gateway("gw-a", {}, {}, model_load={MODEL: (1, 1)})

    async def read() -> ModelLoad:
        s = AsyncFleetStore.from_url(redis_server.url)
        try:
            return await s.model_load(MODEL)
        finally:
            await s.aclose()

    assert asyncio.run(read()) == ModelLoad(1, 1, 0, 1)
