"""Settings of the whole-platform tests. Their harnesses live in ``kvfleet_devkit`` (the local platform, the pod
runner, the Kubernetes emulator, the Redis server), shared with the operator tests and the benchmarks."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis

from kvfleet_common.fleet_store.store import FleetStore
from kvfleet_devkit.local_platform import LocalPlatform

# The platform never reaches the Hugging Face Hub: its model is a demo model on local disk.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def store(platform: LocalPlatform) -> Iterator[FleetStore]:
    """The platform's Redis through the fleet store (each test module defines its own ``platform``)."""
    store = FleetStore(redis.Redis.from_url(platform.redis_url))
    try:
        yield store
    finally:
        store.close()
