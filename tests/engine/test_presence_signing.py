"""The engine's heartbeats carry its model's signature when it holds a replica key (and none without)."""

from __future__ import annotations

import time

from kvfleet_common.fleet_store.store import FleetStore
from kvfleet_common.replica_credentials import heartbeat_fault, model_key, new_root
from kvfleet_common.schemas import ReplicaStats
from kvfleet_engine.presence import PresencePublisher

MODEL = "signed-model"


def _published(store: FleetStore, pub: PresencePublisher):
    deadline = time.monotonic() + 10
    while (hb := store.get_heartbeat(pub.replica_id)) is None:
        assert time.monotonic() < deadline, "no heartbeat published"
        time.sleep(0.05)
    return hb


def test_every_heartbeat_is_signed_with_the_replica_key(redis_server):
    key = model_key(bytes.fromhex(new_root()), MODEL)
    store = FleetStore.from_url(redis_server.url)
    pub = PresencePublisher(redis_server.url, name="s-0", model=MODEL, base_url="http://10.1.2.3:8000", block_size=4,
                            max_model_len=8, stats=ReplicaStats, heartbeat_interval=0.1, ttl=2.0, replica_key=key)  # fmt: skip
    pub.start()
    try:
        first = _published(store, pub)
        assert heartbeat_fault(key, first, time.time()) is None
        pub.set_state("awake")  # a state change goes out at once, signed too
        deadline = time.monotonic() + 10
        while (hb := store.get_heartbeat(pub.replica_id)).state != "awake":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert heartbeat_fault(key, hb, time.time()) is None and hb.signature != first.signature
        assert heartbeat_fault(model_key(bytes(32), MODEL), hb, time.time()) == "bad signature"
    finally:
        pub.stop()
        store.close()


def test_without_a_key_heartbeats_are_unsigned(redis_server):
    store = FleetStore.from_url(redis_server.url)
    pub = PresencePublisher(redis_server.url, name="u-0", model=MODEL, base_url="http://10.1.2.4:8000", block_size=4,
                            max_model_len=8, stats=ReplicaStats, heartbeat_interval=0.1, ttl=2.0)  # fmt: skip
    pub.start()
    try:
        assert _published(store, pub).signature == ""
    finally:
        pub.stop()
        store.close()
