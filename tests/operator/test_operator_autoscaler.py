"""The operator's autoscaler against the Kubernetes emulator and a real Redis.

The test plays the parts around the operator: the gateways (their load reports in Redis, through the same
`FleetStore.report_gateway` a gateway calls), the Deployment controller (Deployment status) and the engines
(signed heartbeats). The operator, its kopf handlers and its autoscaler run for real, ticking every 0.2 s.
The full loop with real engines, gateway and pod runner is e2e/test_autoscaling.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest

from kvfleet_common import replica_credentials
from kvfleet_common.fleet_store.store import FleetStore
from kvfleet_common.schemas import Heartbeat
from kvfleet_devkit.kube_emulator import KubeEmulator, eventually
from kvfleet_devkit.processes import free_port
from kvfleet_operator.handlers.autoscaler import DELETION_COST
from kvfleet_operator.runner import OperatorThread
from tests.operator.op_harness import REPLICA_KEY_ROOT, operator_args

NS = "default"
MODEL = "auto"
MODELS = f"/apis/kvfleet.io/v1alpha1/namespaces/{NS}/inferencemodels"
DEPLOYMENT = f"/apis/apps/v1/namespaces/{NS}/deployments/{MODEL}"
PODS = f"/api/v1/namespaces/{NS}/pods"
EVENTS = f"/api/v1/namespaces/{NS}/events"
GATEWAY = "gw-test"
AUTOSCALING = {
    "minReplicas": 0,
    "maxReplicas": 3,
    "target": 2,
    "scaleUpStabilizationSeconds": 1,
    "scaleDownDelaySeconds": 2,
    "scaleToZeroAfterSeconds": 3,
}


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def autoscaling_operator(kube: KubeEmulator, redis_url: str, metrics_port: int) -> Iterator[OperatorThread]:
    op = OperatorThread(operator_args(kube.url, redis_url, metrics_port=metrics_port)).start()
    try:
        yield op
    finally:
        op.stop()


def report(store: FleetStore, in_flight: int = 0, held: int = 0) -> None:
    """What a gateway publishes every ~50 ms while its load changes (and at least every second)."""
    store.report_gateway(GATEWAY, {}, {}, [], None, model_load={MODEL: (in_flight, held)})


def replicas(kube: KubeEmulator) -> int:
    dep = kube.get(DEPLOYMENT)
    assert dep is not None
    return int(dep["spec"].get("replicas", 0))


def autoscaling(kube: KubeEmulator) -> dict:
    return ((kube.get(f"{MODELS}/{MODEL}") or {}).get("status") or {}).get("autoscaling") or {}


def ready(kube: KubeEmulator, n: int, deployment: str = DEPLOYMENT) -> None:
    """Play the Deployment controller: ``n`` replicas ready."""
    dep = kube.get(deployment)
    assert dep is not None
    want = dep["spec"]["replicas"]
    kube.patch(deployment + "/status", {"status": {
        "observedGeneration": dep["metadata"]["generation"], "replicas": want, "updatedReplicas": want,
        "readyReplicas": n, "availableReplicas": n}})  # fmt: skip


def heartbeat(store: FleetStore, name: str, running: int) -> None:
    """Play an engine of the model (signed with the model's key, as the operator's Secret would give it)."""
    now = time.time()
    hb = Heartbeat(replica_id=f"{name}#{int(now * 1000)}", name=name, model=MODEL, base_url="http://127.0.0.1:9",
                   state="awake", running=running, block_size=16, max_model_len=2048, started_at=now,
                   updated_at=now)  # fmt: skip
    key = replica_credentials.model_key(bytes.fromhex(REPLICA_KEY_ROOT), MODEL)
    hb = msgspec.structs.replace(hb, signature=replica_credentials.sign_heartbeat(key, hb))
    store.claim_name(name, hb.replica_id)
    store.publish_heartbeat(hb, ttl=30)


def pod(kube: KubeEmulator, name: str) -> None:
    kube.post(PODS, {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": name, "namespace": NS, "labels": {"kvfleet.io/model": MODEL, "app.kubernetes.io/component": "engine"}}, "spec": {}})  # fmt: skip


def reasons(kube: KubeEmulator) -> list[str]:
    return [e.get("reason") for e in kube.list(EVENTS) if e.get("involvedObject", {}).get("name") == MODEL]


def test_from_zero_to_max_and_back_with_status_events_and_metrics(
    kube: KubeEmulator, store: FleetStore, autoscaling_operator: OperatorThread, metrics_port: int
) -> None:
    body = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceModel",
            "metadata": {"name": MODEL, "namespace": NS},
            "spec": {"model": {"uri": f"pvc://models/{MODEL}"}, "autoscaling": AUTOSCALING}}  # fmt: skip
    kube.post(MODELS, body)

    # applied with minReplicas 0: no replica, and the gateways are told they may hold requests for it
    eventually(lambda: autoscaling(kube).get("reason") == "ScaledToZero", timeout=30)
    assert replicas(kube) == 0
    assert store.get_model_policy(MODEL).scale_from_zero
    ready(kube, 0)
    eventually(lambda: (kube.get(f"{MODELS}/{MODEL}") or {})["status"]["phase"] == "ScaledToZero", timeout=10)

    # a request held at a gateway: one replica at once (no stabilization), a cold start in status
    report(store, held=1)
    eventually(lambda: replicas(kube) == 1, timeout=10)
    cold = eventually(lambda: autoscaling(kube).get("coldStarts") == 1 and autoscaling(kube), timeout=10)
    assert cold["reason"] in ("ColdStart", "Steady", "ReplicasNotReady")
    ready_cond = eventually(lambda: next((c for c in (kube.get(f"{MODELS}/{MODEL}") or {})["status"]["conditions"]
                                          if c["type"] == "Ready" and c["reason"] == "ColdStarting"), None),
                            timeout=10)  # fmt: skip
    assert ready_cond["status"] == "False"
    ready(kube, 1)
    report(store, in_flight=1)
    done = eventually(lambda: autoscaling(kube).get("lastColdStart", {}).get("readyAt") and autoscaling(kube),
                      timeout=10)  # fmt: skip
    assert done["lastColdStart"]["seconds"] >= 0

    # 7 in flight for a target of 2: 4 replicas' worth, capped at maxReplicas, after the 1 s window
    report(store, in_flight=7)
    eventually(lambda: replicas(kube) == 3, timeout=10)
    assert autoscaling(kube)["reason"] in ("ScaleUp", "ReplicasNotReady", "Steady")
    ready(kube, 3)
    for name, running in (("auto-a", 0), ("auto-b", 1), ("auto-c", 0)):
        pod(kube, name)
        heartbeat(store, name, running)

    # the load drops (1 in flight, as the engines' running counts agree): after the 2 s delay down to 1, the
    # idle pods marked to go first
    report(store, in_flight=1)
    eventually(lambda: replicas(kube) == 1, timeout=15)
    costs = {p["metadata"]["name"]: p["metadata"].get("annotations", {}).get(DELETION_COST)
             for p in kube.list(PODS) if p["metadata"]["name"].startswith("auto-")}  # fmt: skip
    assert costs == {"auto-a": "0", "auto-b": "1", "auto-c": "0"}  # the busy one stays
    ready(kube, 1)

    # no demand at all: zero after scaleToZeroAfterSeconds
    report(store)
    for name in ("auto-a", "auto-b", "auto-c"):
        heartbeat(store, name, 0)
    eventually(lambda: replicas(kube) == 0, timeout=15)
    eventually(lambda: autoscaling(kube).get("reason") in ("ScaleToZero", "ScaledToZero"), timeout=10)

    # each change has an Event with its reason, and the operator's metric counts them
    assert {"ColdStart", "ScaleUp", "ScaleDown", "ScaleToZero"} <= set(reasons(kube))
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    for reason in ("ColdStart", "ScaleUp", "ScaleDown", "ScaleToZero"):
        assert f'kvfleet_operator_autoscaler_scale_events_total{{model="{MODEL}",namespace="{NS}",reason="{reason}"}} 1.0' \
            in text, reason  # fmt: skip
    assert f'kvfleet_operator_cold_starts_total{{model="{MODEL}",namespace="{NS}"}} 1.0' in text
    gauge = f'kvfleet_operator_autoscaler_desired_replicas{{model="{MODEL}",namespace="{NS}"}}'
    assert gauge in text

    # a deleted model's gauges go with it (its pods go first, as the garbage collector would take them)
    for name in ("auto-a", "auto-b", "auto-c"):
        kube.delete(f"{PODS}/{name}")
    kube.delete(f"{MODELS}/{MODEL}")
    eventually(lambda: kube.get(f"{MODELS}/{MODEL}") is None, timeout=30)
    eventually(lambda: gauge not in httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text,
               timeout=10)  # fmt: skip


def test_a_blind_tick_changes_nothing(kube: KubeEmulator, store: FleetStore, module_redis,
                                      autoscaling_operator: OperatorThread) -> None:  # fmt: skip
    """With Redis down the autoscaler cannot see the load: it must not remove capacity it cannot judge."""
    name = "blind"
    body = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceModel",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"uri": f"pvc://models/{name}"},
                     "autoscaling": {**AUTOSCALING, "minReplicas": 1, "scaleDownDelaySeconds": 0}}}  # fmt: skip
    kube.post(MODELS, body)
    path = f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"
    eventually(lambda: (kube.get(path) or {}).get("spec", {}).get("replicas") == 1, timeout=30)
    ready(kube, 1, path)
    store.report_gateway("gw-blind", {}, {}, [], None, model_load={name: (6, 0)})
    eventually(lambda: kube.get(path)["spec"]["replicas"] == 3, timeout=15)
    module_redis.stop()
    try:
        time.sleep(2.0)  # ten ticks without Redis (no timing is asserted: the count must simply not move)
        assert kube.get(path)["spec"]["replicas"] == 3
    finally:
        module_redis.start()
