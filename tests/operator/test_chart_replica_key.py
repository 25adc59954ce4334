"""The chart's replica key root: generated into the platform Secret (or from the user's), given to the gateway
and the operator only, and accepted by both components' command lines."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import pytest

from kvfleet_common.replica_credentials import parse_key
from kvfleet_gateway.gateway_cli import build_parser as gateway_parser
from kvfleet_operator.operator_cli import run_parser
from tests.operator.helm_chart import NAMESPACE, RELEASE, by_kind, pod_templates, render
from tests.operator.test_chart_helm import _notes

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


# ---- a Secret without the root (existingSecret made before the key existed) stops both components at start --

EXISTING = "platform"
ROOT_SOURCE = f"Secret {EXISTING}, key replica-key-root, named by existingSecret"


def _kubelet_env(container: dict, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The environment the kubelet gives ``container`` with these Secrets: a missing key of an optional
    reference leaves the variable unset, and $(VAR) expands what came before (as in the chart's URLs)."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            value = item["value"]
            for name, earlier in env.items():
                value = value.replace(f"$({name})", earlier)
            env[item["name"]] = value
        elif "secretKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["secretKeyRef"]
            value = secrets.get(ref["name"], {}).get(ref["key"])
            if value is None:
                assert ref.get("optional"), f"the kubelet would refuse the pod: {ref} is missing"
                continue
            env[item["name"]] = value
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = NAMESPACE  # POD_NAMESPACE: the only field the chart reads
    return env


def _start_as_the_chart_would(workload: str, secret: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run the component's real command line with the environment the chart renders, the Secret's keys
    resolved like the kubelet does. Redis is never reached: the root is checked first."""
    (container,) = pod_templates(render({"existingSecret": EXISTING}))[workload]["spec"]["containers"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")}
    env |= _kubelet_env(container, {EXISTING: secret})
    args = [a.replace("$(POD_NAMESPACE)", NAMESPACE) for a in container["args"]]
    return subprocess.run([sys.executable, "-m", "kvfleet_cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip


@pytest.mark.parametrize("workload", sorted(HOLDERS))
@pytest.mark.parametrize(
    ("root", "complaint"),
    [
        (None, "is not set: that Secret key must exist"),
        ("0123abcd", "must be at least 32 bytes (64 hex digits)"),
    ],
    ids=["missing", "too-short"],
)
def test_an_existing_secret_without_a_valid_root_stops_the_component_naming_the_key(
    workload, root, complaint
):
    secret = {"admin-token": "t" * 40, "redis-url": "redis://:pw@127.0.0.1:1/0", "redis-password": "pw"}
    if root is not None:
        secret["replica-key-root"] = root
    done = _start_as_the_chart_would(workload, secret)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert ROOT_SOURCE in output and complaint in output and "KVFLEET_REPLICA_KEY_ROOT" in output, output
    assert "Traceback" not in output and (root is None or root not in output)  # one line, never the value


def test_the_chart_says_where_the_root_comes_from_and_asks_for_it_by_name():
    for values, source in [
        ({}, f"Secret {SECRET}, key replica-key-root, named by the chart"),
        ({"replicaKeyRootSecret": {"name": "my-root", "key": "root"}},
         "Secret my-root, key root, named by replicaKeyRootSecret"),
        ({"existingSecret": EXISTING}, ROOT_SOURCE),
    ]:  # fmt: skip
        for workload, template in pod_templates(render(values)).items():
            env = {e["name"]: e for c in template["spec"]["containers"] for e in c.get("env", [])}
            if workload in HOLDERS:
                assert env["KVFLEET_REPLICA_KEY_ROOT_SOURCE"] == {"name": "KVFLEET_REPLICA_KEY_ROOT_SOURCE",
                                                                  "value": source}  # fmt: skip
                # optional: a missing key starts the component, which stops with the message above
                assert env["KVFLEET_REPLICA_KEY_ROOT"]["valueFrom"]["secretKeyRef"]["optional"] is True
            else:
                assert "KVFLEET_REPLICA_KEY_ROOT_SOURCE" not in env and "KVFLEET_REPLICA_KEY_ROOT" not in env
    notes = _notes({"existingSecret": EXISTING})
    assert f"Secret {EXISTING} (existingSecret) must hold the keys admin-token, redis-url, redis-password and " \
           "replica-key-root" in " ".join(notes.split())  # fmt: skip
    assert "replica-key-root" not in _notes({})


# ---- the components themselves, with no chart -------------------------------------------------------------


def _run_component(component: str, env_changes: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")} | env_changes
    env["KVFLEET_REDIS_URL"] = "redis://:pw@127.0.0.1:1/0"  # never reached: the root is checked first
    return subprocess.run([sys.executable, "-m", "kvfleet_cli.main", component, "--standalone"
                           if component == "operator" else "--port=0"], env=env, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip


@pytest.mark.parametrize("component", ["gateway", "operator"])
def test_a_root_set_but_empty_is_refused_not_taken_for_none(component):
    """An empty variable (a Secret key left empty) must not turn the replica checks off, as no root does."""
    done = _run_component(component, {"KVFLEET_REPLICA_KEY_ROOT": ""})
    assert done.returncode == 2, done.stdout + done.stderr
    assert (
        "replica key root (KVFLEET_REPLICA_KEY_ROOT or --replica-key-root) is empty"
        in done.stdout + done.stderr
    )
