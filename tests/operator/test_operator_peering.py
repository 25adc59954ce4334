"""kopf peering: two operator replicas on one cluster never both act; the standby takes over when the active
one leaves. Each replica writes to its own Redis here, so which one acted is visible."""

from __future__ import annotations

import base64
import hashlib
import time
from collections.abc import Iterator

import pytest
import redis
from kube_emulator import KubeEmulator, eventually
from op_harness import PEERING, add_peering, operator_args
from redis_server import RedisServer

from kvfleet_common.registry import Registry
from kvfleet_operator.runner import OperatorThread

PEERING_PATH = f"/apis/kopf.dev/v1/clusterkopfpeerings/{PEERING}"


@pytest.fixture
def two_redis() -> Iterator[tuple[Registry, Registry, str, str]]:
    servers = [RedisServer(), RedisServer()]
    for s in servers:
        s.start()
    registries = [Registry(redis.Redis.from_url(s.url)) for s in servers]
    try:
        yield registries[0], registries[1], servers[0].url, servers[1].url
    finally:
        for r in registries:
            r.close()
        for s in servers:
            s.close()


def add_tenant(kube: KubeEmulator, name: str, key: str) -> str:
    kube.post(
        "/api/v1/namespaces/kvfleet-system/secrets",
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": f"{name}-key", "namespace": "kvfleet-system"},
            "data": {"apiKey": base64.b64encode(key.encode()).decode()},
        },
    )
    kube.post(
        "/apis/kvfleet.io/v1alpha1/tenants",
        {
            "apiVersion": "kvfleet.io/v1alpha1",
            "kind": "Tenant",
            "metadata": {"name": name},
            "spec": {"apiKeySecretRef": {"name": f"{name}-key"}},
        },
    )
    return hashlib.sha256(key.encode()).hexdigest()


def test_only_the_highest_priority_replica_acts_and_the_standby_takes_over(two_redis):
    reg_a, reg_b, url_a, url_b = two_redis
    kube = KubeEmulator().start()
    add_peering(kube)
    a = b = None
    try:
        a = OperatorThread(operator_args(kube.url, url_a, priority=100, identity="replica-a")).start()
        eventually(lambda: "replica-a" in (kube.get(PEERING_PATH) or {}).get("status", {}))
        b = OperatorThread(operator_args(kube.url, url_b, priority=10, identity="replica-b")).start()
        eventually(lambda: "replica-b" in (kube.get(PEERING_PATH) or {}).get("status", {}))

        first = add_tenant(kube, "first", "sk-first")
        eventually(lambda: reg_a.tenant_for_key_hash(first))
        time.sleep(1.0)  # an active replica would have written within ~0.1 s
        # The standby saw a higher-priority peer and paused: it wrote nothing.
        assert reg_b.tenant_for_key_hash(first) is None and reg_b.list_tenants() == []

        a.stop()  # leaves the peering object on exit
        a = None
        eventually(lambda: "replica-a" not in (kube.get(PEERING_PATH) or {}).get("status", {}))
        second = add_tenant(kube, "second", "sk-second")
        eventually(lambda: reg_b.tenant_for_key_hash(second), timeout=20)
    finally:
        for op in (a, b):
            if op is not None:
                op.stop()
        kube.stop()
