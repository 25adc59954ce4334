"""Shared pieces of the operator tests (importable by test modules, unlike conftest)."""

from __future__ import annotations

from typing import Any

from kvfleet_devkit.kube_emulator import KubeEmulator
from kvfleet_operator.handlers.context import RuntimeOptions
from kvfleet_operator.runner import RunArgs
from kvfleet_operator.spec import OperatorConfig

ADMIN_TOKEN = "test-admin-token"
REPLICA_KEY_ROOT = b"0perat0r".hex() * 4  # the platform's replica key root (32 bytes)
PEERING = "kvfleet"


def add_peering(kube: KubeEmulator, name: str = PEERING) -> None:
    kube.post(
        "/apis/kopf.dev/v1/clusterkopfpeerings",
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}},
    )


def operator_args(server: str, redis_url: str, **options: Any) -> RunArgs:
    return RunArgs(
        config=OperatorConfig(
            engine_image="registry.test/kvfleet-engine:1",
            redis_url=redis_url,
            admin_token=ADMIN_TOKEN,
            replica_key_root=REPLICA_KEY_ROOT,
            namespace="kvfleet-system",
            engine_network_policy=True,
        ),
        options=RuntimeOptions(
            server=server,
            idle_check_seconds=options.pop("idle_check_seconds", 2.0),
            resync_seconds=1.0,
            autoscale_seconds=options.pop("autoscale_seconds", 0.2),  # only models with spec.autoscaling
        ),
        peering=options.pop("peering", PEERING),
        **options,
    )
