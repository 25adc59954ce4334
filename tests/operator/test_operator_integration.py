"""The operator for real: kopf watching KMock's Kubernetes emulator over HTTP, writing to a real redis-server.

The emulator runs no controllers, so the tests play the Deployment controller and the kubelet by writing
Deployment and Pod status themselves, and play an engine replica by publishing its heartbeat to Redis.
"""

from __future__ import annotations

import hashlib
import json
import time

import msgspec
import pytest

from kvfleet_common import replica_credentials
from kvfleet_common.fleet_store.store import FleetStore
from kvfleet_common.schemas import Heartbeat
from kvfleet_devkit.kube_emulator import KubeEmulator, eventually
from tests.operator.op_harness import ADMIN_TOKEN, REPLICA_KEY_ROOT

pytestmark = pytest.mark.usefixtures("operator", "delete_models_afterwards")

NS = "default"
MODELS = f"/apis/kvfleet.io/v1alpha1/namespaces/{NS}/inferencemodels"
TENANTS = "/apis/kvfleet.io/v1alpha1/tenants"


def model_path(name: str, sub: str = "") -> str:
    return f"{MODELS}/{name}" + (f"/{sub}" if sub else "")


def child(kind_path: str, name: str) -> str:
    return f"{kind_path}/{name}"


DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
SERVICES = f"/api/v1/namespaces/{NS}/services"
CONFIGMAPS = f"/api/v1/namespaces/{NS}/configmaps"
SECRETS = f"/api/v1/namespaces/{NS}/secrets"
PDBS = f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets"
NETWORK_POLICIES = f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies"
PODS = f"/api/v1/namespaces/{NS}/pods"


@pytest.fixture
def delete_models_afterwards(kube: KubeEmulator):
    """Keep the emulator small: every test's models are deleted (and finalized) when it ends."""
    yield
    for obj in kube.list(MODELS):
        if not obj["metadata"].get("deletionTimestamp"):
            kube.delete(model_path(obj["metadata"]["name"]))
    eventually(lambda: not kube.list(MODELS), timeout=30)


def create_model(kube: KubeEmulator, name: str, **spec) -> dict:
    body = {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"model": {"uri": f"pvc://models/{name}"}, **spec},
    }
    return kube.post(MODELS, body)


def status_of(kube: KubeEmulator, name: str) -> dict:
    return (kube.get(model_path(name)) or {}).get("status", {})


def condition(status: dict, type_: str) -> dict:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), {})


def args_of(deployment: dict) -> list[str]:
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def play_deployment_controller(
    kube: KubeEmulator, name: str, *, ready: int, replicas: int | None = None, **extra
):
    dep = kube.get(child(DEPLOYMENTS, name))
    assert dep is not None
    want = dep["spec"]["replicas"]
    status = {
        "observedGeneration": dep["metadata"]["generation"],
        "replicas": want if replicas is None else replicas,
        "updatedReplicas": want,
        "readyReplicas": ready,
        "availableReplicas": ready,
        **extra,
    }
    kube.patch(child(DEPLOYMENTS, name) + "/status", {"status": status})


def test_create_renders_owned_objects_and_registers_the_model(kube: KubeEmulator, store: FleetStore):
    created = create_model(
        kube,
        "llama",
        replicas=2,
        engine={"tensorParallelSize": 2, "pipelineParallelSize": 2, "maxNumSeqs": 128},
        model={"uri": "pvc://models/llama", "servedName": "meta/llama-8b"},
        routing={"policy": "least-load"},
        access={"tenants": ["team-a"]},
    )
    uid = created["metadata"]["uid"]
    dep = eventually(lambda: kube.get(child(DEPLOYMENTS, "llama")))
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert dep["spec"]["replicas"] == 2
    assert container["command"] == ["kvfleet", "engine", "serve"]
    args = container["args"]
    assert flag(args, "--served-model-name") == "meta/llama-8b"
    assert flag(args, "--tensor-parallel-size") == "2" and flag(args, "--pipeline-parallel-size") == "2"
    assert flag(args, "--max-num-seqs") == "128"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4  # TP x PP
    assert container["image"] == "registry.test/kvfleet-engine:1"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"

    for path in (
        child(SERVICES, "llama"),
        child(CONFIGMAPS, "llama"),
        child(PDBS, "llama"),
        child(NETWORK_POLICIES, "llama"),
        child(SECRETS, "llama-credentials"),
        child(DEPLOYMENTS, "llama"),
    ):
        obj = eventually(lambda p=path: kube.get(p))
        (owner,) = obj["metadata"]["ownerReferences"]
        assert owner["kind"] == "InferenceModel" and owner["uid"] == uid and owner["controller"] is True
        assert obj["metadata"]["labels"]["kvfleet.io/model"] == "llama"

    # Only engine clients of the operator's namespace reach the replicas, though the model lives elsewhere.
    policy = kube.get(child(NETWORK_POLICIES, "llama"))
    assert policy["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    (peer,) = policy["spec"]["ingress"][0]["from"]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "kvfleet-system"}

    config = eventually(lambda: store.get_model_policy("meta/llama-8b"))
    assert config.routing_policy == "least-load" and config.allowed_tenants == ["team-a"]

    status = eventually(lambda: status_of(kube, "llama").get("servedName") and status_of(kube, "llama"))
    assert status["servedName"] == "meta/llama-8b"
    assert status["selector"] == "app.kubernetes.io/component=engine,kvfleet.io/model=llama"
    assert status["phase"] in ("Pending", "Progressing")
    assert condition(status, "Progressing")["status"] == "True"
    assert eventually(lambda: [e for e in kube.events_for("llama") if e["reason"] == "Created"])


def test_spec_change_rolls_the_deployment(kube: KubeEmulator):
    create_model(kube, "roll", engine={"maxNumSeqs": 16})
    eventually(lambda: kube.get(child(DEPLOYMENTS, "roll")))
    kube.patch(model_path("roll"), {"spec": {"engine": {"maxNumSeqs": 64, "dtype": "bfloat16"}}})
    dep = eventually(
        lambda: (
            (d := kube.get(child(DEPLOYMENTS, "roll"))) and flag(args_of(d), "--max-num-seqs") == "64" and d
        )
    )
    assert flag(args_of(dep), "--dtype") == "bfloat16"
    generation = kube.get(model_path("roll"))["metadata"]["generation"]
    assert generation == 2
    eventually(lambda: status_of(kube, "roll").get("observedGeneration") == generation)
    eventually(lambda: [e for e in kube.events_for("roll") if e["reason"] == "Updated"])


def test_scale_subresource_scales_the_deployment(kube: KubeEmulator):
    create_model(kube, "scaled", replicas=1, accelerator="cpu")
    eventually(lambda: kube.get(child(DEPLOYMENTS, "scaled")))
    kube.patch(model_path("scaled", "scale"), {"spec": {"replicas": 4}})
    eventually(lambda: kube.get(child(DEPLOYMENTS, "scaled"))["spec"]["replicas"] == 4)
    play_deployment_controller(kube, "scaled", ready=4)
    status = eventually(lambda: (s := status_of(kube, "scaled")).get("readyReplicas") == 4 and s)
    assert status["replicas"] == 4  # what /scale reports as status replicas


def test_status_and_conditions_follow_the_deployment(kube: KubeEmulator):
    create_model(kube, "follow", replicas=2)
    eventually(lambda: kube.get(child(DEPLOYMENTS, "follow")))

    play_deployment_controller(kube, "follow", ready=1)
    status = eventually(lambda: (s := status_of(kube, "follow")).get("readyReplicas") == 1 and s)
    assert status["phase"] == "Progressing"
    assert condition(status, "Ready")["reason"] == "SomeReplicasReady"

    play_deployment_controller(kube, "follow", ready=2)
    status = eventually(lambda: (s := status_of(kube, "follow")).get("phase") == "Ready" and s)
    assert condition(status, "Ready")["status"] == "True"
    assert condition(status, "Progressing")["status"] == "False"
    assert condition(status, "Degraded")["status"] == "False"
    eventually(lambda: [e for e in kube.events_for("follow") if e["reason"] == "Ready"])

    stuck = {
        "type": "Progressing",
        "status": "False",
        "reason": "ProgressDeadlineExceeded",
        "message": 'ReplicaSet "follow-7d9" has timed out progressing.',
    }
    play_deployment_controller(kube, "follow", ready=1, conditions=[stuck])
    status = eventually(lambda: (s := status_of(kube, "follow")).get("phase") == "Degraded" and s)
    assert condition(status, "Degraded")["reason"] == "ProgressDeadlineExceeded"
    warnings = eventually(
        lambda: [e for e in kube.events_for("follow") if e["reason"] == "ProgressDeadlineExceeded"]
    )
    assert warnings[0]["type"] == "Warning" and "timed out" in warnings[0]["message"]


def test_crash_looping_pods_degrade_the_model_with_an_event(kube: KubeEmulator):
    create_model(kube, "crashy")
    eventually(lambda: kube.get(child(DEPLOYMENTS, "crashy")))
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "crashy-5c9f-abcde",
            "namespace": NS,
            "labels": {"kvfleet.io/model": "crashy", "app.kubernetes.io/component": "engine"},
        },
        "spec": {"containers": [{"name": "engine", "image": "x"}]},
        "status": {
            "containerStatuses": [
                {
                    "name": "engine",
                    "ready": False,
                    "restartCount": 5,
                    "state": {
                        "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 2m40s restarting"}
                    },
                }
            ]
        },
    }
    kube.post(PODS, pod)
    status = eventually(lambda: (s := status_of(kube, "crashy")).get("phase") == "Degraded" and s)
    degraded = condition(status, "Degraded")
    assert degraded["reason"] == "CrashLoopBackOff" and "crashy-5c9f-abcde" in degraded["message"]
    events = eventually(lambda: [e for e in kube.events_for("crashy") if e["reason"] == "CrashLoopBackOff"])
    assert events[0]["type"] == "Warning"
    # Another model's status ignores this pod.
    create_model(kube, "neighbour")
    eventually(lambda: status_of(kube, "neighbour").get("phase") == "Pending" or status_of(kube, "neighbour"))
    assert condition(status_of(kube, "neighbour"), "Degraded").get("status") != "True"
    kube.delete(f"{PODS}/crashy-5c9f-abcde")


@pytest.mark.parametrize(
    "name, spec, message",
    [
        ("bad-uri", {"model": {"uri": "s3://bucket/model"}}, "spec.model.uri"),
        (
            "bad-tp",
            {"model": {"uri": "pvc://m/x"}, "engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2}},
            "at most 8 accelerators per pod",
        ),
        (
            "bad-kv",
            {"model": {"uri": "pvc://m/x"}, "engine": {"kvCacheMemory": "1Gi", "gpuMemoryUtilization": 0.9}},
            "mutually exclusive",
        ),
    ],
)
def test_bad_specs_are_rejected_with_clear_messages(kube: KubeEmulator, name, spec, message):
    kube.post(
        MODELS,
        {
            "apiVersion": "kvfleet.io/v1alpha1",
            "kind": "InferenceModel",
            "metadata": {"name": name},
            "spec": spec,
        },
    )
    status = eventually(lambda: (s := status_of(kube, name)).get("phase") == "Failed" and s)
    degraded = condition(status, "Degraded")
    assert (
        degraded["status"] == "True"
        and degraded["reason"] == "InvalidSpec"
        and message in degraded["message"]
    )
    event = eventually(lambda: [e for e in kube.events_for(name) if e["reason"] == "InvalidSpec"])[0]
    assert event["type"] == "Warning" and message in event["message"]
    assert kube.get(child(DEPLOYMENTS, name)) is None


def test_delete_removes_owned_objects_and_purges_redis(kube: KubeEmulator, store: FleetStore):
    create_model(kube, "doomed", model={"uri": "pvc://models/doomed", "servedName": "doomed-model"})
    eventually(lambda: kube.get(child(DEPLOYMENTS, "doomed")))
    eventually(lambda: store.get_model_policy("doomed-model"))
    store.touch_activity("doomed-model")
    assert eventually(lambda: kube.get(model_path("doomed"))["metadata"].get("finalizers"))

    kube.delete(model_path("doomed"))
    eventually(lambda: kube.get(model_path("doomed")) is None)  # finalizer released
    assert store.get_model_policy("doomed-model") is None
    assert store.last_activity("doomed-model") is None
    assert "doomed-model" not in store.list_models()
    for path in (
        child(DEPLOYMENTS, "doomed"),
        child(SERVICES, "doomed"),
        child(CONFIGMAPS, "doomed"),
        child(PDBS, "doomed"),
        child(NETWORK_POLICIES, "doomed"),
        child(SECRETS, "doomed-credentials"),
    ):
        assert kube.get(path) is None, path


def test_delete_purges_redis_only_once_the_pods_are_gone(kube: KubeEmulator, store: FleetStore):
    # A replica still running after a purge would re-publish the model's tokenizer (no TTL) into Redis.
    create_model(kube, "draining", model={"uri": "pvc://models/draining", "servedName": "draining"})
    eventually(lambda: kube.get(child(DEPLOYMENTS, "draining")))
    eventually(lambda: store.get_model_policy("draining"))
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "draining-5c9f-abcde",
            "namespace": NS,
            "labels": {"kvfleet.io/model": "draining", "app.kubernetes.io/component": "engine"},
        },
        "spec": {"containers": [{"name": "engine", "image": "x"}]},
    }
    kube.post(PODS, pod)
    kube.delete(model_path("draining"))
    eventually(lambda: kube.get(child(DEPLOYMENTS, "draining")) is None)  # the delete handler runs...
    # ...but holds the finalizer while the pod stops.
    assert kube.get(model_path("draining"))["metadata"]["deletionTimestamp"]
    assert store.get_model_policy("draining") is not None
    kube.delete(f"{PODS}/draining-5c9f-abcde")
    eventually(lambda: kube.get(model_path("draining")) is None, timeout=30)
    assert store.get_model_policy("draining") is None


def _secret(name: str, key: str) -> dict:
    import base64

    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": "kvfleet-system"},
        "data": {"apiKey": base64.b64encode(key.encode()).decode()},
    }


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_tenant_lifecycle_in_redis(kube: KubeEmulator, store: FleetStore):
    secrets = "/api/v1/namespaces/kvfleet-system/secrets"
    kube.post(secrets, _secret("acme-key", "sk-acme-1"))
    kube.post(
        TENANTS,
        {
            "apiVersion": "kvfleet.io/v1alpha1",
            "kind": "Tenant",
            "metadata": {"name": "acme"},
            "spec": {
                "apiKeySecretRef": {"name": "acme-key"},
                "models": ["meta/*"],
                "limits": {"requestsPerMinute": 60, "maxConcurrent": 4},
                "priority": 5,
                "cacheSalt": "acme",
            },
        },
    )
    record = eventually(lambda: store.tenant_for_key_hash(_sha("sk-acme-1")))
    assert record.name == "acme" and record.models == ["meta/*"]
    assert (
        record.requests_per_minute == 60 and record.max_concurrent == 4 and record.tokens_per_minute is None
    )
    assert record.priority == 5 and record.cache_salt == "acme"
    # Only the hash reaches Redis, never the key itself.
    raw = b"".join(store.client.dump(k) or b"" for k in store.client.keys("*"))
    assert b"sk-acme-1" not in raw
    eventually(lambda: (kube.get(f"{TENANTS}/acme") or {}).get("status", {}).get("phase") == "Active")

    kube.patch(f"{TENANTS}/acme", {"spec": {"limits": {"requestsPerMinute": 120}}})
    eventually(lambda: store.get_tenant("acme").requests_per_minute == 120)

    # Rotating the key in the Secret: the periodic resync replaces the old hash with the new one.
    kube.patch(f"{secrets}/acme-key", {"data": _secret("acme-key", "sk-acme-2")["data"]})
    eventually(lambda: store.tenant_for_key_hash(_sha("sk-acme-2")), timeout=20)
    assert store.tenant_for_key_hash(_sha("sk-acme-1")) is None

    kube.delete(f"{TENANTS}/acme")
    eventually(lambda: kube.get(f"{TENANTS}/acme") is None)
    assert store.get_tenant("acme") is None
    assert store.tenant_for_key_hash(_sha("sk-acme-2")) is None


def post_tenant(kube: KubeEmulator, name: str, secret: str) -> None:
    ref = {"name": secret, "namespace": "kvfleet-system"}
    body = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "Tenant", "metadata": {"name": name}}
    kube.post(TENANTS, {**body, "spec": {"apiKeySecretRef": ref}})


def first_tenant_status(kube: KubeEmulator, name: str) -> dict:
    return eventually(
        lambda: (s := (kube.get(f"{TENANTS}/{name}") or {}).get("status", {})).get("phase") and s
    )


def test_tenant_with_a_missing_secret_fails_then_recovers(kube: KubeEmulator, store: FleetStore):
    post_tenant(kube, "late", "late-key")
    status = first_tenant_status(kube, "late")
    assert status["phase"] == "Failed" and status["conditions"][0]["reason"] == "SecretNotFound"
    assert "kvfleet-system/late-key" in status["conditions"][0]["message"]
    eventually(lambda: [e for e in kube.events_for("late") if e["reason"] == "SecretNotFound"])
    kube.post("/api/v1/namespaces/kvfleet-system/secrets", _secret("late-key", "sk-late"))
    eventually(lambda: store.tenant_for_key_hash(_sha("sk-late")), timeout=20)
    eventually(lambda: kube.get(f"{TENANTS}/late")["status"]["phase"] == "Active")


def test_tenant_whose_secret_the_operator_may_not_read_fails_without_hot_retries(
    kube: KubeEmulator, store: FleetStore, caplog
):
    """A 403 on the key Secret: status Failed with reason SecretForbidden and a Warning Event; the reconcile
    handler fails for good instead of retrying, and only the periodic resync looks again, which picks the
    key up once access is granted."""
    secrets = "/api/v1/namespaces/kvfleet-system/secrets"
    kube.post(secrets, _secret("locked-key", "sk-locked"))
    kube.forbid_secrets("kvfleet-system")
    try:
        post_tenant(kube, "locked", "locked-key")
        status = first_tenant_status(kube, "locked")
        (ready,) = status["conditions"]
        assert status["phase"] == "Failed" and ready["status"] == "False"
        assert ready["reason"] == "SecretForbidden"
        assert "Secret kvfleet-system/locked-key (HTTP 403)" in ready["message"]
        assert "operator.tenantSecretNamespaces" in ready["message"]
        eventually(lambda: [e for e in kube.events_for("locked") if e["reason"] == "SecretForbidden"])
        eventually(
            lambda: any(
                "reconcile_tenant" in r.getMessage() and "failed permanently" in r.getMessage()
                for r in caplog.records
            )
        )
        assert not any(
            "reconcile_tenant" in r.getMessage() and "failed temporarily" in r.getMessage()
            for r in caplog.records
        )
        assert store.tenant_for_key_hash(_sha("sk-locked")) is None
    finally:
        kube.forbid_secrets("kvfleet-system", False)
    eventually(lambda: store.tenant_for_key_hash(_sha("sk-locked")), timeout=20)
    eventually(lambda: kube.get(f"{TENANTS}/locked")["status"]["phase"] == "Active")
    kube.delete(f"{TENANTS}/locked")
    eventually(lambda: kube.get(f"{TENANTS}/locked") is None)


def _heartbeat(store: FleetStore, *, name: str, model: str, base_url: str, state: str) -> Heartbeat:
    now = time.time()
    hb = Heartbeat(
        replica_id=f"{name}#{int(now * 1000)}",
        name=name,
        model=model,
        base_url=base_url,
        state=state,
        block_size=16,
        max_model_len=2048,
        started_at=now,
        updated_at=now,
    )
    hb = _signed(hb)
    store.claim_name(name, hb.replica_id)
    store.publish_heartbeat(hb, ttl=30)
    return hb


def _model_key(model: str) -> bytes:
    return replica_credentials.model_key(bytes.fromhex(REPLICA_KEY_ROOT), model)


def _signed(hb: Heartbeat, **changes) -> Heartbeat:
    """``hb`` with ``changes``, re-signed as an engine holding the model's key (the operator's Secret) would."""
    hb = msgspec.structs.replace(hb, **changes)
    return msgspec.structs.replace(hb, signature=replica_credentials.sign_heartbeat(_model_key(hb.model), hb))


def test_idle_models_are_put_to_sleep_through_the_admin_endpoint(
    kube: KubeEmulator, store: FleetStore, admin_recorder
):
    create_model(
        kube,
        "sleepy",
        sleep={"idleSeconds": 1, "level": 2},
        model={"uri": "pvc://m/s", "servedName": "sleepy"},
    )
    eventually(lambda: kube.get(child(DEPLOYMENTS, "sleepy")))
    play_deployment_controller(kube, "sleepy", ready=1)
    hb = _heartbeat(store, name="sleepy-0", model="sleepy", base_url=admin_recorder.url, state="awake")
    store.touch_activity("sleepy", now=time.time() - 3600)

    def beat() -> None:  # like the engine, every second or so: the operator calls only fresh signed replicas
        nonlocal beat_at
        if time.monotonic() - beat_at > 1:
            store.publish_heartbeat(_signed(hb, updated_at=time.time()), ttl=30)
            beat_at = time.monotonic()

    beat_at = time.monotonic()
    calls = eventually(lambda: beat() or admin_recorder.calls, timeout=20)
    assert calls[0]["path"] == "/sleep?level=2"
    # the model's own admin token, derived from its key, never the platform token
    token = replica_credentials.engine_admin_token(_model_key("sleepy"))
    assert calls[0]["authorization"] == f"Bearer {token}" != f"Bearer {ADMIN_TOKEN}"
    eventually(lambda: [e for e in kube.events_for("sleepy") if e["reason"] == "IdleSleep"])

    # The engine reports the new state in its heartbeat; the status follows.
    store.publish_heartbeat(_signed(hb, state="sleeping", updated_at=time.time()), ttl=30)
    status = eventually(lambda: (s := status_of(kube, "sleepy")).get("phase") == "Sleeping" and s, timeout=5)
    assert status["sleepingReplicas"] == 1 and status["awakeReplicas"] == 0
    assert condition(status, "Sleeping")["status"] == "True"
    assert status["lastActivity"].endswith("Z")


def test_busy_or_recently_used_models_stay_awake(kube: KubeEmulator, store: FleetStore, admin_recorder):
    create_model(kube, "busy", sleep={"idleSeconds": 1}, model={"uri": "pvc://m/b", "servedName": "busy"})
    create_model(
        kube, "fresh", sleep={"idleSeconds": 3600}, model={"uri": "pvc://m/f", "servedName": "fresh"}
    )
    eventually(lambda: kube.get(child(DEPLOYMENTS, "busy")) and kube.get(child(DEPLOYMENTS, "fresh")))
    hb = _heartbeat(store, name="busy-0", model="busy", base_url=admin_recorder.url, state="awake")
    store.publish_heartbeat(_signed(hb, running=3, updated_at=time.time()), ttl=30)
    _heartbeat(store, name="fresh-0", model="fresh", base_url=admin_recorder.url, state="awake")
    store.touch_activity("busy", now=time.time() - 3600)
    # Two idle checks (2 s apart) pass without a sleep call.
    eventually(lambda: status_of(kube, "busy").get("awakeReplicas") == 1)
    time.sleep(4.5)
    assert admin_recorder.calls == []


def test_config_map_holds_the_resolved_model(kube: KubeEmulator):
    create_model(kube, "documented", sleep={"idleSeconds": 30})
    cm = eventually(lambda: kube.get(child(CONFIGMAPS, "documented")))
    doc = json.loads(cm["data"]["model.json"])
    assert doc["servedName"] == "documented" and doc["sleep"]["idleSeconds"] == 30
    assert doc["service"] == "documented.default.svc"


def test_a_redis_that_lost_its_data_is_repaired(kube: KubeEmulator, store: FleetStore, module_redis):
    create_model(kube, "durable", model={"uri": "pvc://m/d", "servedName": "durable"})
    kube.post("/api/v1/namespaces/kvfleet-system/secrets", _secret("durable-key", "sk-durable"))
    kube.post(
        TENANTS,
        {
            "apiVersion": "kvfleet.io/v1alpha1",
            "kind": "Tenant",
            "metadata": {"name": "durable"},
            "spec": {"apiKeySecretRef": {"name": "durable-key"}},
        },
    )
    eventually(
        lambda: store.get_model_policy("durable") and store.tenant_for_key_hash(_sha("sk-durable"))
    )
    module_redis.restart()  # same port, empty: a Redis without persistence after a restart
    # The timers re-assert the model config (every 2 s here) and re-sync the tenant (every 1 s here).
    eventually(lambda: store.get_model_policy("durable"), timeout=20)
    eventually(lambda: store.tenant_for_key_hash(_sha("sk-durable")), timeout=20)
    kube.delete(f"{TENANTS}/durable")
    eventually(lambda: kube.get(f"{TENANTS}/durable") is None)
