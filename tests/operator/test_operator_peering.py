"""kopf peering: two operator replicas on one cluster never both act (nor both autoscale); the standby takes over
when the active one leaves. Each replica writes to its own Redis here, so which one acted is visible."""

from __future__ import annotations

import base64
import hashlib
import logging
import time
from collections.abc import Iterator

import pytest
import redis

from kvfleet_common.fleet_store.store import FleetStore
from kvfleet_devkit.kube_emulator import KubeEmulator, eventually
from kvfleet_devkit.redis_server import RedisServer
from kvfleet_operator.runner import OperatorThread
from tests.operator.op_harness import PEERING, add_peering, operator_args

PEERING_PATH = f"/apis/kopf.dev/v1/clusterkopfpeerings/{PEERING}"
MODELS = "/apis/kvfleet.io/v1alpha1/namespaces/default/inferencemodels"
DEPLOYMENT = "/apis/apps/v1/namespaces/default/deployments/scaled"
AUTOSCALED = {
    "apiVersion": "kvfleet.io/v1alpha1",
    "kind": "InferenceModel",
    "metadata": {"name": "scaled", "namespace": "default"},
    "spec": {"model": {"uri": "pvc://models/scaled"}, "autoscaling": {"minReplicas": 0, "maxReplicas": 2}},
}


@pytest.fixture
def two_redis() -> Iterator[tuple[FleetStore, FleetStore, str, str]]:
    servers = [RedisServer(), RedisServer()]
    for s in servers:
        s.start()
    stores = [FleetStore(redis.Redis.from_url(s.url)) for s in servers]
    try:
        yield stores[0], stores[1], servers[0].url, servers[1].url
    finally:
        for r in stores:
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
        # An autoscaled model at zero, with a request held in the standby's Redis only: were the standby's
        # autoscaler running, it would start a replica within a tick (0.2 s).
        kube.post(MODELS, AUTOSCALED)
        eventually(lambda: (kube.get(DEPLOYMENT) or {}).get("spec", {}).get("replicas") == 0)
        reg_b.report_gateway("gw", {}, {}, [], None, model_load={"scaled": (0, 1)})
        time.sleep(1.0)  # an active replica would have written within ~0.1 s
        # The standby saw a higher-priority peer and paused: it wrote nothing, and scaled nothing.
        assert reg_b.tenant_for_key_hash(first) is None and reg_b.list_tenants() == []
        assert kube.get(DEPLOYMENT)["spec"]["replicas"] == 0

        a.stop()  # leaves the peering object on exit
        a = None
        eventually(lambda: "replica-a" not in (kube.get(PEERING_PATH) or {}).get("status", {}))
        second = add_tenant(kube, "second", "sk-second")
        eventually(lambda: reg_b.tenant_for_key_hash(second), timeout=20)
        # the new leader's autoscaler sees the held request and cold-starts a replica
        reg_b.report_gateway("gw", {}, {}, [], None, model_load={"scaled": (0, 1)})
        eventually(lambda: kube.get(DEPLOYMENT)["spec"]["replicas"] == 1, timeout=20)
    finally:
        for op in (a, b):
            if op is not None:
                op.stop()
        kube.stop()


def test_a_missing_peering_object_is_reported_in_the_log_until_it_appears(two_redis, monkeypatch, caplog):
    """Without --standalone and without the peering object (which only the Helm chart creates) the operator
    does nothing: it says so, with the fix, instead of waiting silently; once the object exists it acts."""
    from kvfleet_operator.handlers import peering

    monkeypatch.setattr(peering, "PEERING_CHECK_INTERVAL", 0.2)
    caplog.set_level(logging.INFO, logger="kvfleet_operator.peering")
    store, _, url, _ = two_redis
    kube = KubeEmulator().start()
    op = None
    try:
        op = OperatorThread(operator_args(kube.url, url, peering="by-hand", priority=1)).start()
        warning = eventually(
            lambda: [
                r for r in caplog.records if r.name == "kvfleet_operator.peering" and r.levelname == "WARNING"
            ]
        )[0].getMessage()
        assert "ClusterKopfPeering 'by-hand'" in warning and "does nothing until it exists" in warning
        assert "--standalone" in warning and "kubectl apply" in warning
        key = add_tenant(kube, "early", "sk-early")
        time.sleep(1.0)
        assert store.tenant_for_key_hash(key) is None  # paused: kopf's peering is mandatory

        add_peering(kube, "by-hand")
        eventually(
            lambda: any(r.getMessage().startswith("peering object found") for r in caplog.records), timeout=5
        )
        eventually(lambda: store.tenant_for_key_hash(key), timeout=20)
    finally:
        if op is not None:
            op.stop()
        kube.stop()


def test_the_help_says_the_operator_needs_the_peering_object_or_standalone():
    from kvfleet_operator.operator_cli import run_parser

    text = " ".join(run_parser().format_help().split())
    assert "waits without acting while it is missing" in text and "The Helm chart creates it" in text
    assert "--standalone" in text and "ClusterKopfPeering" in text
