"""The chart's Redis requires a password by default (helm template through helm_chart.py): generated into the
chart's Secret or taken from the user's, handed to Redis and to every component through Secret references
only (never a literal in a pod spec or on a command line), and started for real from the rendered command;
the Redis NetworkPolicy admits the release's gateway and operator and the engine pods, nobody else."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import kubernetes_validate
import pytest
import redis
import redis.exceptions
import yaml

from kvfleet_devkit.processes import free_port
from kvfleet_operator import manifests
from kvfleet_operator.spec import OperatorConfig, model_spec_from
from tests.operator.helm_chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    by_kind,
    helm,
    pod_templates,
    render,
    values_file,
)

REDIS = f"{RELEASE}-redis"
CLIENTS = (f"{RELEASE}-gateway", f"{RELEASE}-operator")


def _container(docs: list[dict], workload: str) -> dict:
    (container,) = pod_templates(docs)[workload]["spec"]["containers"]
    return container


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _secret_ref(env: dict) -> tuple[str, str]:
    ref = env["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def _generated_password(docs: list[dict]) -> str:
    (secret,) = [s for s in by_kind(docs, "Secret") if s["metadata"]["name"] == f"{RELEASE}-credentials"]
    return base64.b64decode(secret["data"]["redis-password"]).decode()


def test_redis_requires_a_password_from_a_secret_by_default():
    docs = render({})
    password = _generated_password(docs)
    assert len(password) == 32 and password.isalnum()
    redis_container = _container(docs, REDIS)
    env = _env(redis_container)
    # Redis and redis-cli (probe, kubectl exec) read it from the Secret; it is on no command line.
    assert (
        _secret_ref(env["REDIS_PASSWORD"])
        == _secret_ref(env["REDISCLI_AUTH"])
        == (f"{RELEASE}-credentials", "redis-password")
    )
    assert "requirepass" in redis_container["command"][2]
    for workload in (REDIS, *CLIENTS):
        container = _container(docs, workload)
        spec = json.dumps(pod_templates(docs)[workload])
        assert password not in spec, workload
        assert not any("redis://" in a or "requirepass" in a for a in container.get("args", [])), workload
    # The gateway and the operator: the password from the Secret, the URL composed from it by the kubelet
    # (the password defined first: $(VAR) only expands variables defined earlier).
    for workload in CLIENTS:
        container = _container(docs, workload)
        names = [e["name"] for e in container["env"]]
        env = _env(container)
        assert _secret_ref(env["KVFLEET_REDIS_PASSWORD"]) == (f"{RELEASE}-credentials", "redis-password")
        assert names.index("KVFLEET_REDIS_PASSWORD") < names.index("KVFLEET_REDIS_URL")
        assert env["KVFLEET_REDIS_URL"]["value"] == (
            f"redis://:$(KVFLEET_REDIS_PASSWORD)@{REDIS}.{NAMESPACE}.svc:6379/0"
        )
    # A new password restarts Redis along with its clients (the checksum of the credentials Secret).
    fixed = {"adminToken": "fixed-token", "replicaKeyRoot": "ab" * 32,
             "redis": {"enabled": True, "auth": {"password": "one"}}}  # fmt: skip
    changed = {**fixed, "redis": {"enabled": True, "auth": {"password": "two"}}}
    checksums = [
        {
            pod_templates(render(v))[w]["metadata"]["annotations"]["checksum/credentials"]
            for w in (REDIS, *CLIENTS)
        }
        for v in (fixed, changed)
    ]
    assert len(checksums[0]) == len(checksums[1]) == 1 and checksums[0] != checksums[1]


def test_a_given_password_and_an_existing_secret():
    docs = render({"redis": {"enabled": True, "auth": {"password": "given-Password.1"}}})
    assert _generated_password(docs) == "given-Password.1"
    # GitOps: the password from the user's Secret; nothing generated, renders repeat exactly.
    values = VALUE_SETS["redis-password-secret"]
    docs = render(values)
    assert by_kind(docs, "Secret") == []
    assert _secret_ref(_env(_container(docs, REDIS))["REDIS_PASSWORD"]) == ("redis-auth", "password")
    for workload in CLIENTS:
        assert _secret_ref(_env(_container(docs, workload))["KVFLEET_REDIS_PASSWORD"]) == (
            "redis-auth",
            "password",
        )
    file = values_file(values)
    first, second = (helm("template", RELEASE, str(CHART), "-n", NAMESPACE, "-f", file).stdout for _ in "12")
    assert first == second
    # existingSecret (admin-token, redis-url): the bundled Redis reads its redis-password key.
    docs = render(VALUE_SETS["existing-secret"])
    assert _secret_ref(_env(_container(docs, REDIS))["REDIS_PASSWORD"]) == (
        "platform-credentials",
        "redis-password",
    )
    assert _secret_ref(_env(_container(docs, CLIENTS[0]))["KVFLEET_REDIS_URL"]) == (
        "platform-credentials",
        "redis-url",
    )


def test_auth_off_renders_the_redis_of_before():
    docs = render({"redis": {"enabled": True, "auth": {"enabled": False}}})
    container = _container(docs, REDIS)
    assert "command" not in container and "env" not in container
    assert _secret_ref(_env(_container(docs, CLIENTS[0]))["KVFLEET_REDIS_URL"]) == (
        f"{RELEASE}-credentials",
        "redis-url",
    )


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
@pytest.mark.parametrize("password", ["plainAlnum123", 'with "quotes", a \\ backslash, $dollar and spaces'])
def test_the_rendered_redis_command_starts_a_redis_that_requires_the_password(tmp_path, password):
    """The container's own command (its config directory moved to a temporary one), run by sh with a real
    redis-server: the password works, no password is refused, and it is on no process's command line."""
    for values in ({}, {"redis": {"enabled": True, "persistence": {"enabled": True}}}):
        container = _container(render(values), REDIS)
        mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["auth"]
        shell, flag, script, name = container["command"]
        script = script.replace(mount, str(tmp_path))
        port = free_port()
        argv = [shell, flag, script, name, *container["args"], "--port", str(port), "--bind", "127.0.0.1",
                "--dir", str(tmp_path)]  # fmt: skip
        proc = subprocess.Popen(
            argv,
            env={**os.environ, "REDIS_PASSWORD": password},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        try:
            client = redis.Redis(port=port, password=password, socket_timeout=2)
            for _ in range(100):
                try:
                    assert client.ping()
                    break
                except redis.exceptions.ConnectionError:
                    if proc.poll() is not None:
                        pytest.fail(f"redis exited with {proc.returncode}")
                    time.sleep(0.05)
            with pytest.raises(redis.exceptions.AuthenticationError):
                redis.Redis(port=port, socket_timeout=2).ping()
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace")
            assert password not in cmdline
            assert oct((tmp_path / "auth.conf").stat().st_mode & 0o777) == "0o600"
        finally:
            proc.terminate()
            proc.wait(10)


def _selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels and matchExpressions with In) applied to labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def _admits(policy: dict, namespace: str, pod_labels: dict) -> bool:
    ns_labels = {"kubernetes.io/metadata.name": namespace}
    for rule in policy["spec"]["ingress"]:
        for peer in rule["from"]:
            if "namespaceSelector" in peer:
                ns_ok = _selects(peer["namespaceSelector"], ns_labels)
            else:
                ns_ok = namespace == policy["metadata"]["namespace"]
            if ns_ok and _selects(peer.get("podSelector", {}), pod_labels):
                return True
    return False


def _engine_labels(namespace: str) -> dict:
    """The labels of the engine pods the operator creates for the quickstart's model in ``namespace``."""
    demo = yaml.safe_load((CHART.parents[1] / "examples" / "demo-cpu.yaml").read_text())
    demo["metadata"].update(namespace=namespace, uid="u")
    model = model_spec_from(demo)
    return manifests.deployment(model, OperatorConfig())["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("values", ["defaults", "namespaced", "kind"])
def test_the_redis_network_policy_admits_only_the_platforms_pods(values):
    docs = render(VALUE_SETS[values])
    (policy,) = [p for p in by_kind(docs, "NetworkPolicy") if p["metadata"]["name"] == REDIS]
    for version in ("1.30", "1.33"):
        kubernetes_validate.validate(policy, version, strict=True)
    assert policy["metadata"]["namespace"] == NAMESPACE
    assert policy["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 6379}]
    pods = pod_templates(docs)
    assert _selects(policy["spec"]["podSelector"], pods[REDIS]["metadata"]["labels"])
    for workload in CLIENTS:
        assert _admits(policy, NAMESPACE, pods[workload]["metadata"]["labels"]), workload
        other_release = {**pods[workload]["metadata"]["labels"], "app.kubernetes.io/instance": "other"}
        assert not _admits(policy, NAMESPACE, other_release)
        assert not _admits(policy, "default", pods[workload]["metadata"]["labels"])  # not its namespace
    for other in ("otel-collector", "jaeger"):
        if f"{RELEASE}-{other}" in pods:
            assert not _admits(policy, NAMESPACE, pods[f"{RELEASE}-{other}"]["metadata"]["labels"]), other
    assert not _admits(policy, NAMESPACE, {"app": "anything"})
    watched = VALUE_SETS[values].get("operator", {}).get("watchNamespaces", [])
    for namespace in ("default", "ml", "research", NAMESPACE):
        managed = not watched or namespace in watched
        assert _admits(policy, namespace, _engine_labels(namespace)) == managed, namespace


def test_the_redis_network_policy_follows_the_values():
    extra = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    docs = render({"networkPolicy": {"redisIngressFrom": extra}})
    (policy,) = [p for p in by_kind(docs, "NetworkPolicy") if p["metadata"]["name"] == REDIS]
    assert _admits(policy, "monitoring", {"app": "redis-exporter"})
    assert not [p for p in by_kind(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy")]
    assert not [
        p for p in by_kind(render(VALUE_SETS["gitops"]), "NetworkPolicy") if p["metadata"]["name"] == REDIS
    ]


def test_an_external_tls_redis_gets_its_ca_mounted_in_the_gateway_and_operator():
    docs = render(VALUE_SETS["external-tls"])
    assert REDIS not in pod_templates(docs)
    for workload in CLIENTS:
        template = pod_templates(docs)[workload]
        (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == "redis-tls"]
        assert volume["secret"] == {"secretName": "redis-ca", "items": [{"key": "ca.pem", "path": "ca.crt"}]}
        (container,) = template["spec"]["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "redis-tls"]
        assert mount == {"name": "redis-tls", "mountPath": "/etc/kvfleet/redis-tls", "readOnly": True}
        assert _secret_ref(_env(container)["KVFLEET_REDIS_URL"]) == ("redis-connection", "url")
    # a password given in the values goes into a URL as it is: the schema refuses what would need escaping
    bad = helm("template", RELEASE, str(CHART), "--set", "redis.auth.password=has@and/slash", check=False)
    assert bad.returncode != 0 and "password" in bad.stderr
