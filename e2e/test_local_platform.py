"""The platform end to end on one machine (issue 7): `kubectl` against the Kubernetes emulator, the real
operator, real engine processes run by the pod runner, a real Redis.

Scenario: apply the example Tenant and the local InferenceModel -> Ready -> a chat completion (official
``openai`` client) at the replica's base URL from its Redis heartbeat -> ``kubectl scale`` to 2 -> two live
replicas -> SIGKILL one engine -> the pod restarts (restartCount 1) and the model goes Degraded, then Ready
again -> ``kubectl delete`` -> no engine process and no Redis key of the model left.

The gateway steps of the issue (chat through the gateway with the tenant's key, prefix stickiness, sleep
and wake through the admin API) are marked ``GATEWAY`` below: they need ``LocalPlatform(with_gateway=True)``.
Polls use generous timeouts: the engines load the model on a shared 2-core machine.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from kube_emulator import eventually
from local_platform import EXAMPLES, LocalPlatform
from podrunner import group_members

from kvfleet_common.registry import Registry
from kvfleet_common.schemas import Heartbeat

pytestmark = [
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed"),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed"),
]

MODEL = "demo-tiny"  # examples/local-tiny.yaml
TENANT_KEY = "sk-team-a-change-me"  # examples/tenant.yaml
NS = "default"
PODS = f"/api/v1/namespaces/{NS}/pods"
DEPLOYMENT = f"/apis/apps/v1/namespaces/{NS}/deployments/{MODEL}"
STARTUP_S = 300  # an engine boot (torch import, model load) on a loaded machine, with margin


@pytest.fixture(scope="module")
def platform(tmp_path_factory) -> Iterator[LocalPlatform]:
    p = LocalPlatform(tmp_path_factory.mktemp("platform")).start()
    try:
        p.build_demo_model()
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def registry(platform: LocalPlatform) -> Iterator[Registry]:
    reg = Registry(redis.Redis.from_url(platform.redis_url))
    try:
        yield reg
    finally:
        reg.close()


def condition(status: dict, type_: str) -> dict:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), {})


def engine_pods(platform: LocalPlatform) -> list[dict]:
    assert platform.kube is not None
    return [p for p in platform.kube.list(PODS) if p["metadata"]["labels"].get("kvfleet.io/model") == MODEL]


def awake(registry: Registry) -> list[Heartbeat]:
    return [hb for hb in registry.live_replicas(MODEL) if hb.state == "awake"]


def pid_of(pod: dict) -> int:
    return int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("local://"))


def wait_ready(platform: LocalPlatform, replicas: int) -> dict:
    return eventually(
        lambda: (
            (s := platform.model_status(MODEL)).get("phase") == "Ready"
            and s.get("readyReplicas") == replicas
            and s
        ),
        timeout=STARTUP_S,
        interval=0.2,
    )


def chat(base_url: str) -> str:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello from the local platform"}], max_tokens=8
    )
    assert resp.model == MODEL and resp.usage is not None and resp.usage.completion_tokens > 0
    assert resp.choices[0].finish_reason in ("length", "stop")
    return resp.choices[0].message.content or ""


def model_keys(registry: Registry, pod_names: set[str]) -> list[str]:
    """Every Redis key that belongs to the model or to one of its replicas."""
    keys = [k.decode() for k in registry.client.scan_iter("kvf:*")]
    return [
        k
        for k in keys
        if f":model:{MODEL}:" in k or any(f":{name}#" in k or k.endswith(f":{name}") for name in pod_names)
    ]


def test_model_lifecycle_on_the_local_platform(platform: LocalPlatform, registry: Registry):
    kube, runner = platform.kube, platform.runner
    assert kube is not None and runner is not None
    # 1. kubectl apply the tenant and the model from examples/.
    platform.kubectl(
        "apply",
        "--validate=false",
        "-f",
        str(EXAMPLES / "tenant.yaml"),
        "-f",
        str(EXAMPLES / "local-tiny.yaml"),
    )
    key_hash = hashlib.sha256(TENANT_KEY.encode()).hexdigest()
    tenant = eventually(lambda: registry.tenant_for_key_hash(key_hash), timeout=60)
    assert tenant.name == "team-a"

    # 2. The operator renders the Deployment, the pod runner starts the engine, the status becomes Ready.
    status = wait_ready(platform, 1)
    assert condition(status, "Ready")["status"] == "True" and status["servedName"] == MODEL
    assert platform.kubectl("get", "im", MODEL, "-o", "jsonpath={.status.phase}") == "Ready"
    (pod,) = engine_pods(platform)
    assert pod["status"]["containerStatuses"][0]["ready"] is True

    # 3. The replica announced itself in Redis; it answers a chat completion at that URL.
    (hb,) = eventually(lambda: awake(registry), timeout=60)
    assert hb.name == pod["metadata"]["name"]  # KVFLEET_REPLICA_NAME from the downward API
    (local,) = runner.pods(deployment=MODEL)
    assert hb.base_url == f"http://127.0.0.1:{local.named_ports['http']}"  # KVFLEET_BASE_URL, rewritten
    assert chat(hb.base_url)
    assert registry.get_model_config(MODEL) is not None
    # GATEWAY: the same request through the gateway with the tenant's key (Bearer sk-team-a-change-me).

    # 4. kubectl scale -> two engine processes, two live replicas in Redis.
    assert "scaled" in platform.kubectl("scale", f"im/{MODEL}", "--replicas=2")
    wait_ready(platform, 2)
    replicas = eventually(lambda: len(r := awake(registry)) == 2 and r, timeout=60)
    pods = engine_pods(platform)
    assert {r.name for r in replicas} == {p["metadata"]["name"] for p in pods}
    assert len({r.base_url for r in replicas}) == 2
    for r in replicas:
        assert chat(r.base_url)
    # GATEWAY: requests sharing a prefix stick to one replica, unrelated ones spread over both.
    # GATEWAY: sleep the model through the admin API; a request wakes it and succeeds.

    # 5. SIGKILL one engine: the pod restarts it, the model is Degraded meanwhile, then Ready again.
    victim = pods[0]
    victim_pid = pid_of(victim)
    os.kill(victim_pid, signal.SIGKILL)
    phases: list[str] = []

    def recovered() -> bool:
        s = platform.model_status(MODEL)
        if not phases or phases[-1] != s.get("phase"):
            phases.append(s.get("phase", ""))
        assert "Degraded" in phases and s.get("phase") == "Ready" and s.get("readyReplicas") == 2, phases
        return True

    eventually(recovered, timeout=STARTUP_S, interval=0.1)
    assert phases.index("Degraded") < len(phases) - 1, phases
    warnings = eventually(lambda: [e for e in kube.events_for(MODEL) if e["type"] == "Warning"])
    assert any(victim["metadata"]["name"] in e["message"] for e in warnings), warnings
    (again,) = [p for p in engine_pods(platform) if p["metadata"]["name"] == victim["metadata"]["name"]]
    cs = again["status"]["containerStatuses"][0]
    assert cs["restartCount"] == 1 and cs["ready"] is True
    assert cs["lastState"]["terminated"]["exitCode"] == 137
    assert pid_of(again) != victim_pid and group_members(victim_pid) == []
    replicas = eventually(lambda: len(r := awake(registry)) == 2 and r, timeout=60)
    restarted = next(r for r in replicas if r.name == victim["metadata"]["name"])
    assert chat(restarted.base_url)

    # 6. kubectl delete waits for the finalizer: the pods stop, then the operator purges the model from
    # Redis (purging earlier would let a stopping engine re-register and re-publish its tokenizer).
    pod_names = {p["metadata"]["name"] for p in engine_pods(platform)}
    groups = runner.process_groups()
    platform.kubectl("delete", "--timeout=180s", "-f", str(EXAMPLES / "local-tiny.yaml"))
    assert kube.get(DEPLOYMENT) is None and engine_pods(platform) == []
    assert runner.pods(deployment=MODEL) == []
    assert model_keys(registry, pod_names) == []
    assert registry.live_replicas(MODEL) == [] and MODEL not in registry.list_models()
    assert registry.get_model_config(MODEL) is None
    eventually(lambda: all(group_members(g) == [] for g in groups), timeout=60)

    # The tenant goes too: nothing of the scenario is left in Redis.
    platform.kubectl("delete", "--timeout=60s", "-f", str(EXAMPLES / "tenant.yaml"))
    assert registry.tenant_for_key_hash(key_hash) is None
    assert [k for k in registry.client.scan_iter("kvf:*")] == []


def test_stopping_the_platform_leaves_no_process(tmp_path: Path):
    """Stopping the platform while an engine runs: no process survives, the logs stay in the given dir."""
    with LocalPlatform(tmp_path / "p", operator_idle_check_s=1.0) as p:
        p.build_demo_model()
        p.kubectl("apply", "--validate=false", "-f", str(EXAMPLES / "local-tiny.yaml"))
        runner = p.runner
        assert runner is not None
        eventually(lambda: any(pod.pid for pod in runner.pods(deployment=MODEL)), timeout=120)
        groups = runner.process_groups()
        operator = p.operator
        assert groups and all(group_members(g) for g in groups) and operator is not None
    # stop() SIGTERMed the engine mid-start (it raises if anything is left); check independently too.
    assert all(group_members(g) == [] for g in groups)
    assert operator.poll() is not None
    assert (tmp_path / "p" / "operator.log").exists()
