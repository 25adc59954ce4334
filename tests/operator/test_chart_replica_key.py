"""The chart's replica key root: generated into the platform Secret (or from the user's), given to the gateway
and the operator only, and accepted by both components' command lines."""

from __future__ import annotations

import base64
import json

import pytest

from kvfleet_common.replica_credentials import parse_key
from kvfleet_gateway.gateway_cli import build_parser as gateway_parser
from kvfleet_operator.operator_cli import run_parser
from tests.operator.helm_chart import RELEASE, by_kind, pod_templates, render

SECRET = f"{RELEASE}-credentials"
HOLDERS = {f"{RELEASE}-gateway", f"{RELEASE}-operator"}


def _root_refs(docs: list[dict]) -> dict[str, tuple[str, str]]:
    out = {}
    for workload, template in pod_templates(docs).items():
        for container in template["spec"]["containers"] + template["spec"].get("initContainers", []):
            for env in container.get("env", []):
                if env["name"] == "KVFLEET_REPLICA_KEY_ROOT":
                    ref = env["valueFrom"]["secretKeyRef"]
                    out[workload] = (ref["name"], ref["key"])
    return out


def test_a_generated_root_reaches_the_gateway_and_operator_only():
    docs = render({})
    (secret,) = [s for s in by_kind(docs, "Secret") if s["metadata"]["name"] == SECRET]
    root = base64.b64decode(secret["data"]["replica-key-root"]).decode()
    assert len(root) == 64 and len(parse_key(root)) == 32  # what both components accept
    assert _root_refs(docs) == {w: (SECRET, "replica-key-root") for w in HOLDERS}
    assert root not in json.dumps(pod_templates(docs))  # only ever a Secret reference
    # the components' own parsers take it from the environment the chart sets
    assert gateway_parser().parse_args(["--replica-key-root", root]).replica_key_root == root
    assert run_parser().parse_args(["--replica-key-root", root]).replica_key_root == root


def test_the_root_from_values_or_an_existing_secret():
    fixed = "cd" * 32
    (secret,) = [
        s for s in by_kind(render({"replicaKeyRoot": fixed}), "Secret") if s["metadata"]["name"] == SECRET
    ]
    assert base64.b64decode(secret["data"]["replica-key-root"]).decode() == fixed
    docs = render({"replicaKeyRootSecret": {"name": "my-root", "key": "root"}})
    assert _root_refs(docs) == {w: ("my-root", "root") for w in HOLDERS}
    assert all("replica-key-root" not in s["data"] for s in by_kind(docs, "Secret"))
    assert _root_refs(render({"existingSecret": "platform"})) == {
        w: ("platform", "replica-key-root") for w in HOLDERS
    }


def test_the_operator_refuses_a_malformed_root(capsys):
    with pytest.raises(SystemExit):
        run_parser().parse_args(["--replica-key-root", "not-hex"])
    assert "must be hex" in capsys.readouterr().err
