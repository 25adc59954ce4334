"""The pod runner on its own: Deployments written straight to the Kubernetes emulator become local processes
of a small HTTP app (no engine, no operator), so each kubelet / Deployment-controller behaviour is checked
in a second or two."""

from __future__ import annotations

import base64
import os
import signal
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvfleet_devkit.kube_emulator import KubeEmulator, eventually
from kvfleet_devkit.pod_translation import (
    expand_vars,
    rewrite_args,
    rewrite_env_value,
    rollout_budget,
    template_hash,
)
from kvfleet_devkit.podrunner import PodRunner
from kvfleet_devkit.processes import group_members

NS = "default"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
PODS = f"/api/v1/namespaces/{NS}/pods"
SECRETS = f"/api/v1/namespaces/{NS}/secrets"

# The "image": serves /health (503 while a file `unready-$APP_NAME` sits in the claim) and /info.
APP = textwrap.dedent(
    """
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    data = args[args.index("--data") + 1]

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                flag = os.path.join(data, "..", "unready-" + os.environ["APP_NAME"])
                code = 503 if os.path.exists(flag) else 200
                body = b"{}"
            else:
                code, body = 200, json.dumps({"argv": args, "env": dict(os.environ), "pid": os.getpid(),
                                              "cwd": os.getcwd()}).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


@pytest.fixture(scope="module")
def kube() -> Iterator[KubeEmulator]:
    emulator = KubeEmulator().start()
    try:
        yield emulator
    finally:
        emulator.stop()


@pytest.fixture(scope="module")
def pvc_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pvc")
    (root / "app-claim" / "bin").mkdir(parents=True)
    (root / "app-claim" / "bin" / "app.py").write_text(APP)
    return root


@pytest.fixture(scope="module")
def runner(kube: KubeEmulator, pvc_root: Path, tmp_path_factory) -> Iterator[PodRunner]:
    r = PodRunner(
        kube.url,
        pvc_root=pvc_root,
        work_dir=tmp_path_factory.mktemp("pods"),
        commands={"python": [sys.executable]},
        crash_backoff_s=1.5,
        probe_period_s=0.2,
        extra_env={"NODE_DEFAULT": "node", "MODEL_DIR": "overridden by the template"},
    ).start()
    try:
        yield r
    finally:
        r.stop()
        assert r.errors == []


def deployment(name: str, *, replicas: int = 1, env: list[dict] | None = None, **spec: Any) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS, "labels": {"kvfleet.io/model": name}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": {"app": name, "kvfleet.io/model": name}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {
                            "name": "app",
                            "image": "ignored:1",
                            "command": ["python", "/data/bin/app.py"],
                            "args": ["--host", "0.0.0.0", "--port", "8080", "--data", "/data/bin"],
                            "ports": [{"name": "http", "containerPort": 8080}],
                            "env": [*(env or []), {"name": "APP_NAME", "value": name}],
                            "readinessProbe": {
                                "httpGet": {"path": "/health", "port": "http"},
                                "periodSeconds": 1,
                            },
                            "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
                        }
                    ],
                    "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "app-claim"}}],
                },
            },
            **spec,
        },
    }


def pods_of(kube: KubeEmulator, name: str) -> list[dict]:
    return [p for p in kube.list(PODS) if p["metadata"]["labels"].get("app") == name]


def ready_pods(kube: KubeEmulator, name: str) -> list[dict]:
    return [
        p
        for p in pods_of(kube, name)
        if any(
            c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", [])
        )
    ]


def dep_status(kube: KubeEmulator, name: str) -> dict:
    return (kube.get(f"{DEPLOYMENTS}/{name}") or {}).get("status", {})


def info(runner: PodRunner, pod: str) -> dict:
    (local,) = [p for p in runner.pods() if p.name == pod]
    return httpx.get(f"http://127.0.0.1:{local.named_ports['http']}/info", timeout=10).json()


def pid_of(pod: dict) -> int:
    return int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("local://"))


def test_pure_translation_helpers():
    assert expand_vars("http://$(IP):$(PORT)/$(NOPE)$$(IP)", {"IP": "1.2.3.4", "PORT": "80"}) == (
        "http://1.2.3.4:80/$(NOPE)$(IP)"
    )
    mounts = {"/models": "/srv/pvc/models", "/models/cache": "/srv/cache"}
    assert rewrite_args(
        ["--model", "/models/llama", "--port", "8000", "--host", "0.0.0.0", "--cache=/models/cache/x", "/modelsx"],
        {8000: 41000},
        mounts,
    ) == ["--model", "/srv/pvc/models/llama", "--port", "41000", "--host", "127.0.0.1", "--cache=/srv/cache/x",
          "/modelsx"]  # fmt: skip
    assert rewrite_env_value("http://127.0.0.1:8000", {8000: 41000}, {}) == "http://127.0.0.1:41000"
    assert rewrite_env_value("http://127.0.0.1:80001", {8000: 41000}, {}) == "http://127.0.0.1:80001"
    assert rollout_budget({"spec": {"replicas": 4}}) == (1, 1)  # 25 % each, surge rounded up
    assert rollout_budget({"spec": {"replicas": 2, "strategy": {"rollingUpdate": {"maxSurge": 0, "maxUnavailable": 0}}}}) == (0, 1)  # fmt: skip
    t = deployment("x")["spec"]["template"]
    assert template_hash(t) == template_hash(dict(t)) and len(template_hash(t)) == 10


def test_pods_run_with_the_template_translated_for_this_machine(kube: KubeEmulator, runner: PodRunner):
    token = base64.b64encode(b"s3cret").decode()
    kube.post(
        SECRETS, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds"}, "data": {"tok": token}}
    )
    env = [
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "BASE_URL", "value": "http://$(IP):8080"},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "tok"}}},
        {"name": "KVFLEET_FROM_TEMPLATE", "value": "yes"},
        {"name": "MODEL_DIR", "value": "/data/bin"},
    ]
    created = kube.post(DEPLOYMENTS, deployment("web", replicas=2, env=env))
    pods = eventually(lambda: len(ready_pods(kube, "web")) == 2 and ready_pods(kube, "web"), timeout=60)
    status = eventually(lambda: (s := dep_status(kube, "web")).get("readyReplicas") == 2 and s, timeout=30)
    assert status["replicas"] == status["updatedReplicas"] == status["availableReplicas"] == 2
    assert status["observedGeneration"] == created["metadata"]["generation"]
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Available": "True",
        "Progressing": "True",
    }

    ports = set()
    for pod in pods:
        meta = pod["metadata"]
        assert meta["labels"]["pod-template-hash"] in meta["name"]
        assert meta["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
        assert pod["status"]["phase"] == "Running" and pod["status"]["podIP"] == "127.0.0.1"
        (cs,) = pod["status"]["containerStatuses"]
        assert cs["ready"] and cs["restartCount"] == 0 and "running" in cs["state"]
        got = info(runner, meta["name"])
        assert got["pid"] == pid_of(pod)
        e = got["env"]
        assert e["POD"] == meta["name"] and e["IP"] == "127.0.0.1" and e["TOKEN"] == "s3cret"
        port = int(e["BASE_URL"].rsplit(":", 1)[1])
        assert port != 8080 and got["argv"][got["argv"].index("--port") + 1] == str(port)
        assert got["argv"][got["argv"].index("--host") + 1] == "127.0.0.1"
        assert e["MODEL_DIR"] == str(runner.pvc_root / "app-claim" / "bin")  # the template wins
        assert e["NODE_DEFAULT"] == "node"  # the runner's extra_env reaches every container
        assert e["KVFLEET_FROM_TEMPLATE"] == "yes"
        assert not any(k.startswith("KVFLEET_") and k != "KVFLEET_FROM_TEMPLATE" for k in e)
        ports.add(port)
    assert len(ports) == 2


def test_a_killed_container_is_restarted_and_reported(kube: KubeEmulator, runner: PodRunner):
    kube.post(DEPLOYMENTS, deployment("crash"))
    (pod,) = eventually(lambda: ready_pods(kube, "crash"), timeout=60)
    name, first_pid = pod["metadata"]["name"], pid_of(pod)
    os.kill(first_pid, signal.SIGKILL)

    def restarted() -> dict | None:
        (p,) = pods_of(kube, "crash")
        cs = p["status"]["containerStatuses"][0]
        return cs if cs["restartCount"] == 1 else None

    cs = eventually(restarted, timeout=30)
    assert cs["lastState"]["terminated"]["exitCode"] == 137
    assert cs["lastState"]["terminated"]["reason"] == "Error"
    (again,) = eventually(lambda: ready_pods(kube, "crash"), timeout=60)
    assert again["metadata"]["name"] == name  # same pod, new process
    assert pid_of(again) != first_pid and group_members(first_pid) == []
    eventually(lambda: dep_status(kube, "crash").get("readyReplicas") == 1)

    # A second crash soon after backs off: waiting in CrashLoopBackOff, then running again.
    os.kill(pid_of(again), signal.SIGKILL)

    def backing_off() -> dict | None:
        (p,) = pods_of(kube, "crash")
        cs = p["status"]["containerStatuses"][0]
        return cs if cs["state"].get("waiting", {}).get("reason") == "CrashLoopBackOff" else None

    cs = eventually(backing_off, timeout=30)
    assert cs["restartCount"] == 2 and cs["ready"] is False
    eventually(lambda: ready_pods(kube, "crash"), timeout=60)


def test_readiness_follows_the_probe(kube: KubeEmulator, runner: PodRunner):
    kube.post(DEPLOYMENTS, deployment("flaky"))
    eventually(lambda: ready_pods(kube, "flaky"), timeout=60)
    flag = runner.pvc_root / "app-claim" / "unready-flaky"
    flag.touch()
    try:
        eventually(lambda: not ready_pods(kube, "flaky") and dep_status(kube, "flaky")["readyReplicas"] == 0)
        status = dep_status(kube, "flaky")
        assert {c["type"]: c["reason"] for c in status["conditions"]}[
            "Available"
        ] == "MinimumReplicasUnavailable"
    finally:
        flag.unlink()
    eventually(lambda: ready_pods(kube, "flaky"), timeout=30)


def test_scale_rollout_and_deletion(kube: KubeEmulator, runner: PodRunner):
    kube.post(DEPLOYMENTS, deployment("scaled", replicas=1))
    eventually(lambda: len(ready_pods(kube, "scaled")) == 1, timeout=60)
    kube.patch(f"{DEPLOYMENTS}/scaled", {"spec": {"replicas": 3}})
    pods = eventually(lambda: len(ready_pods(kube, "scaled")) == 3 and ready_pods(kube, "scaled"), timeout=60)
    pids = {p["metadata"]["name"]: pid_of(p) for p in pods}

    kube.patch(f"{DEPLOYMENTS}/scaled", {"spec": {"replicas": 2}})
    eventually(lambda: len(pods_of(kube, "scaled")) == 2, timeout=30)
    (gone,) = set(pids) - {p["metadata"]["name"] for p in pods_of(kube, "scaled")}
    eventually(lambda: group_members(pids[gone]) == [], timeout=30)  # SIGTERM, then the group
    eventually(lambda: dep_status(kube, "scaled").get("replicas") == 2)

    # A new template rolls the pods: a new pod comes up before an old one goes (maxUnavailable 0).
    kube.patch(
        f"{DEPLOYMENTS}/scaled",
        {"spec": {"template": {"metadata": {"annotations": {"rev": "2"}}}}},
    )
    new_hash = template_hash(kube.get(f"{DEPLOYMENTS}/scaled")["spec"]["template"])

    def rolled() -> bool:
        ready = ready_pods(kube, "scaled")
        assert len(ready) >= 2 or len(pods_of(kube, "scaled")) > 2  # never below 2 ready without a surge pod
        return len(ready) == 2 and all(
            p["metadata"]["labels"]["pod-template-hash"] == new_hash for p in ready
        )

    eventually(rolled, timeout=90)
    eventually(lambda: len(pods_of(kube, "scaled")) == 2, timeout=30)
    assert all(group_members(pid) == [] for pid in pids.values())

    # Deleting a Pod through the API: stopped and replaced.
    victim = pods_of(kube, "scaled")[0]
    kube.delete(f"{PODS}/{victim['metadata']['name']}")
    eventually(lambda: group_members(pid_of(victim)) == [], timeout=30)
    eventually(lambda: len(ready_pods(kube, "scaled")) == 2, timeout=60)

    # Deleting the Deployment: the emulator has no garbage collector, the runner cleans up.
    last = [pid_of(p) for p in pods_of(kube, "scaled")]
    kube.delete(f"{DEPLOYMENTS}/scaled")
    eventually(lambda: pods_of(kube, "scaled") == [], timeout=30)
    eventually(lambda: all(group_members(pid) == [] for pid in last), timeout=30)
    assert runner.pods(deployment="scaled") == []


def test_missing_secret_is_a_config_error_until_it_exists(kube: KubeEmulator, runner: PodRunner):
    env = [{"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "late", "key": "k"}}}]
    kube.post(DEPLOYMENTS, deployment("waits", env=env))

    def config_error() -> dict | None:
        pods = pods_of(kube, "waits")
        statuses = pods[0].get("status", {}).get("containerStatuses", []) if pods else []
        waiting = statuses[0]["state"].get("waiting", {}) if statuses else {}
        return waiting if waiting.get("reason") == "CreateContainerConfigError" else None

    waiting = eventually(config_error, timeout=30)
    assert "late" in waiting["message"]
    kube.post(
        SECRETS,
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "late"}, "stringData": {"k": "v"}},
    )
    (pod,) = eventually(lambda: ready_pods(kube, "waits"), timeout=60)
    assert info(runner, pod["metadata"]["name"])["env"]["KEY"] == "v"


def test_stop_leaves_no_process(kube: KubeEmulator, pvc_root: Path, tmp_path: Path):
    own = PodRunner(
        kube.url,
        pvc_root=pvc_root,
        work_dir=tmp_path,
        label="e2e.kvfleet.io/own",
        commands={"python": [sys.executable]},
    )
    dep = deployment("stopper", replicas=2)
    dep["metadata"]["labels"] = {"e2e.kvfleet.io/own": "yes"}  # only this runner selects it
    own.start()
    try:
        kube.post(DEPLOYMENTS, dep)
        eventually(lambda: len(ready_pods(kube, "stopper")) == 2, timeout=60)
        groups = own.process_groups()
        assert len(groups) == 2 and all(group_members(g) for g in groups)
    finally:
        own.stop()
    assert own.leftover_processes() == {}
    assert all(group_members(g) == [] for g in groups)
    assert pods_of(kube, "stopper") == []  # the runner deleted its Pods
