"""The real client path: `kubectl` applies the repository's CRDs and examples to the Kubernetes emulator, and
the operator — started through the `kvfleet operator` command line, as its own process — reacts."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfleet_common.fleet_store.store import FleetStore
from kvfleet_devkit.kube_emulator import KubeEmulator, eventually
from tests.operator.op_harness import PEERING, add_peering

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")


@pytest.fixture(scope="module")
def cluster() -> Iterator[KubeEmulator]:
    emulator = KubeEmulator().start()
    add_peering(emulator)
    try:
        yield emulator
    finally:
        emulator.stop()


def kubectl(cluster: KubeEmulator, *args: str) -> str:
    proc = subprocess.run(
        ["kubectl", f"--server={cluster.url}", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KUBECONFIG": "/dev/null"},
    )
    assert proc.returncode == 0, f"kubectl {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def operator_process(cluster: KubeEmulator, redis_url: str, tmp_path_factory) -> Iterator[subprocess.Popen]:
    kubectl(cluster, "apply", "--validate=false", "-f", str(ROOT / "crds"))
    log = (tmp_path_factory.mktemp("operator") / "operator.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvfleet_cli.main",
            "operator",
            f"--server={cluster.url}",
            f"--redis-url={redis_url}",
            "--admin-token=kubectl-test-token",
            "--operator-namespace=kvfleet-system",
            "--engine-image=registry.test/engine:2",
            f"--peering={PEERING}",
            "--idle-check-seconds=5",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield proc
    finally:
        log.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_kubectl_apply_examples_and_the_operator_reacts(
    cluster: KubeEmulator, operator_process, store: FleetStore
):
    kubectl(cluster, "apply", "--validate=false", "-f", str(ROOT / "examples"))
    deployments = "/apis/apps/v1/namespaces/default/deployments"
    for name in ("demo-llama", "llama-8b", "qwen-72b"):
        eventually(lambda n=name: cluster.get(f"{deployments}/{n}"), timeout=30)
    qwen = cluster.get(f"{deployments}/qwen-72b")["spec"]["template"]["spec"]
    assert qwen["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert qwen["containers"][0]["image"] == "registry.test/engine:2"
    assert qwen["priorityClassName"] == "inference-high"
    # The Redis config is written right after the owned objects.
    config = eventually(lambda: store.get_model_policy("meta-llama/Llama-3.1-8B-Instruct"), timeout=30)
    assert config.allowed_tenants == ["team-a", "team-b"]

    # The Secret came in with stringData; the tenant's key is stored only as its SHA-256.
    key_hash = hashlib.sha256(b"sk-team-a-change-me").hexdigest()
    tenant = eventually(lambda: store.tenant_for_key_hash(key_hash), timeout=30)
    assert tenant.name == "team-a" and tenant.requests_per_minute == 600

    out = kubectl(cluster, "scale", "im/demo-llama", "--replicas=3")
    assert "scaled" in out
    eventually(lambda: cluster.get(f"{deployments}/demo-llama")["spec"]["replicas"] == 3, timeout=30)
    assert kubectl(cluster, "get", "im", "demo-llama", "-o", "jsonpath={.status.servedName}") == "demo-llama"

    kubectl(cluster, "delete", "--timeout=30s", "-f", str(ROOT / "examples" / "tenant.yaml"))
    assert store.get_tenant("team-a") is None
    kubectl(cluster, "delete", "--timeout=30s", "inferencemodel", "llama-8b")
    assert store.get_model_policy("meta-llama/Llama-3.1-8B-Instruct") is None
    assert cluster.get(f"{deployments}/llama-8b") is None

    # SIGTERM stops the operator cleanly.
    operator_process.send_signal(signal.SIGTERM)
    assert operator_process.wait(timeout=30) == 0
