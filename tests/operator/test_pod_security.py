"""Pod Security "restricted" on every pod kvfleet runs: the engine pods the operator renders (every model
source and accelerator) and the chart's own pods (every value set), field by field and through the profile's
full set of checks (pod_security.py)."""

from __future__ import annotations

import copy

import pytest

from kvfleet_operator import manifests
from kvfleet_operator.spec import OperatorConfig, model_spec_from
from tests.operator.helm_chart import VALUE_SETS, pod_templates, render
from tests.operator.pod_security import RESTRICTED_VOLUMES, containers, restricted_violations

VARIANTS = {
    "pvc-gpu": {"model": {"uri": "pvc://models/llama"}, "engine": {"tensorParallelSize": 2}},
    "hf-gpu": {"model": {"uri": "hf://Qwen/Qwen2.5-0.5B@main"}},
    "file-cpu": {"model": {"uri": "file:///opt/models/tiny"}, "accelerator": "cpu"},
    "hf-cpu-own-env": {
        "model": {"uri": "hf://org/model"},
        "accelerator": "cpu",
        "engine": {"env": [{"name": "HF_HOME", "value": "/tmp/hf"}, {"name": "HF_TOKEN", "value": "t"}]},
    },
}


def engine_pod(spec: dict) -> dict:
    doc = {"metadata": {"name": "m", "namespace": "ml", "uid": "u"}, "spec": copy.deepcopy(spec)}
    return manifests.deployment(model_spec_from(doc), OperatorConfig())["spec"]["template"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_engine_pods_pass_restricted_field_by_field(variant):
    template = engine_pod(VARIANTS[variant])
    pod = template["spec"]
    psc = pod["securityContext"]
    # Pod level: non-root with a non-zero uid, RuntimeDefault seccomp, no host namespaces.
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] == 1000 and psc["runAsUser"] != 0
    assert psc["runAsGroup"] == 1000 and psc["fsGroup"] == 1000
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    for field in ("hostNetwork", "hostPID", "hostIPC", "hostUsers", "shareProcessNamespace"):
        assert field not in pod
    assert pod["automountServiceAccountToken"] is False  # the engine never calls the Kubernetes API
    # Volumes: only restricted types; no hostPath.
    for volume in pod["volumes"]:
        assert set(volume) - {"name"} <= RESTRICTED_VOLUMES, volume
    # Every container, init containers included.
    names = [where for where, _ in containers(pod)]
    assert ("initContainers[fetch-model]" in names) == variant.startswith("hf")
    for where, container in containers(pod):
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, where
        assert sc["capabilities"] == {"drop": ["ALL"]}, where  # nothing added back
        assert sc["readOnlyRootFilesystem"] is True, where
        assert sc["runAsNonRoot"] is True, where
        assert "privileged" not in sc and "runAsUser" not in sc and "seccompProfile" not in sc, where
        assert "procMount" not in sc and "seLinuxOptions" not in sc, where
        assert not any(p.get("hostPort") for p in container.get("ports", [])), where
    assert restricted_violations(pod, template["metadata"].get("annotations")) == []


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_engine_writes_only_to_its_emptydirs(variant):
    """Read-only root: /tmp (the ZMQ ipc sockets, temporary files) and the home directory (XDG cache with
    the compiled CPU kernels, Triton's cache, the CUDA JIT cache, HF_HOME) are emptyDirs, and the cache
    variables point into them. A model's own env wins (and is not duplicated)."""
    pod = engine_pod(VARIANTS[variant])["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for where, container in containers(pod):
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert "emptyDir" in volumes[mounts["/tmp"]], where
        assert "emptyDir" in volumes[mounts["/home/kvfleet"]], where
        env = [e["name"] for e in container["env"]]
        assert len(env) == len(set(env)), f"{where}: duplicate env {env}"
        values = {e["name"]: e.get("value") for e in container["env"]}
        assert values["HOME"] == "/home/kvfleet"
        assert values["XDG_CACHE_HOME"] == "/home/kvfleet/.cache"
        assert values["TRITON_CACHE_DIR"] == "/home/kvfleet/.cache/triton"
        writable = [path for path, name in mounts.items() if "emptyDir" in volumes[name]]
        for var in ("HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "HF_HOME"):
            assert any(values[var] == p or values[var].startswith(p + "/") for p in writable), (where, var)
    if variant == "hf-cpu-own-env":
        assert values["HF_HOME"] == "/tmp/hf"


@pytest.mark.parametrize(
    "change, violation",
    [
        (lambda p: p["securityContext"].pop("seccompProfile"), "seccompProfile must be RuntimeDefault"),
        (lambda p: p["securityContext"].update(seccompProfile={"type": "Unconfined"}), "Unconfined"),
        (lambda p: p["containers"][0]["securityContext"].update(runAsNonRoot=False), "runAsNonRoot must be"),
        (lambda p: p["securityContext"].update(runAsUser=0), "runAsUser must not be 0"),
        (
            lambda p: p["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
            "allowPrivilegeEsc",
        ),
        (lambda p: p["containers"][0]["securityContext"].update(capabilities={}), "must drop ALL"),
        (
            lambda p: p["containers"][0]["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
            "may not be added",
        ),
        (lambda p: p["containers"][0]["securityContext"].update(privileged=True), "privileged"),
        (lambda p: p["containers"][0]["securityContext"].pop("readOnlyRootFilesystem"), "readOnlyRoot"),
        (lambda p: p.update(hostNetwork=True), "hostNetwork"),
        (lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "hostPath"),
        (lambda p: p["containers"][0]["ports"][0].update(hostPort=8000), "hostPort"),
        (lambda p: p["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]), "sysctl"),
    ],
)
def test_the_checker_catches_each_violation(change, violation):
    """The checker itself: each broken field of an otherwise passing engine pod is reported."""
    pod = engine_pod(VARIANTS["pvc-gpu"])["spec"]
    change(pod)
    assert any(violation in v for v in restricted_violations(pod)), restricted_violations(pod)


@pytest.mark.parametrize("values", list(VALUE_SETS))
def test_the_charts_pods_pass_restricted(values):
    templates = pod_templates(render(VALUE_SETS[values]))
    assert templates
    for name, template in templates.items():
        pod = template["spec"]
        assert restricted_violations(pod, template["metadata"].get("annotations")) == [], name
        psc = pod["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0, name
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for where, container in containers(pod):
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], where
