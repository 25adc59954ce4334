"""The Helm chart rendered by a real helm (helm_chart.py): lint, every value set validated against the
Kubernetes 1.30 and 1.33 schemas, and what the chart promises (labels, names that two releases never share,
renders that GitOps can repeat, credentials from existing Secrets, NOTES that work from the packaged chart,
operator arguments the operator accepts, and engine pods that only the release's gateway and operator
reach)."""

from __future__ import annotations

import copy
import json
import re
import textwrap

import kubernetes_validate
import pytest
import yaml

from kvfleet_operator import crds, manifests
from kvfleet_operator.operator_cli import config_from, run_parser
from kvfleet_operator.spec import model_spec_from
from kvfleet_operator.validation import schema_errors, validated_inference_model, validated_tenant
from tests.operator.helm_chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    by_kind,
    helm,
    operator_args,
    pod_templates,
    render,
    values_file,
)

K8S_VERSIONS = ("1.30", "1.33")
# Kinds no Kubernetes release defines: checked against their own CRDs (kopf.dev) or not at all
# (monitoring.coreos.com: the Prometheus operator's, not shipped here).
OWN_CRD_SCHEMAS = {
    "ClusterKopfPeering": crds.all_crds()["kopf-clusterkopfpeerings.yaml"],
    "KopfPeering": crds.all_crds()["kopf-kopfpeerings.yaml"],
}
UNCHECKED_KINDS = {"ServiceMonitor", "PodMonitor"}
RECOMMENDED_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/version",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/managed-by",
)
CLUSTER_SCOPED = {
    "ClusterRole",
    "ClusterRoleBinding",
    "ClusterKopfPeering",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}


@pytest.mark.parametrize("values", list(VALUE_SETS))
def test_helm_lint_strict(values):
    out = helm("lint", "--strict", str(CHART), "-f", values_file(VALUE_SETS[values]))
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("values", list(VALUE_SETS))
def test_every_rendered_object_is_valid_kubernetes(values):
    docs = render(VALUE_SETS[values])
    for doc in docs:
        kind = doc["kind"]
        if kind in OWN_CRD_SCHEMAS:
            schema = OWN_CRD_SCHEMAS[kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            assert schema_errors(doc, schema) == []
        elif kind not in UNCHECKED_KINDS:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)
    keys = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), "an object is rendered twice"
    for doc in docs:
        meta = doc["metadata"]
        assert (meta.get("namespace") is None) == (doc["kind"] in CLUSTER_SCOPED), meta["name"]
        labels = meta.get("labels", {})
        assert all(label in labels for label in RECOMMENDED_LABELS), (doc["kind"], meta["name"], labels)
    for dep in by_kind(docs, "Deployment"):
        selector = dep["spec"]["selector"]["matchLabels"]
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= pod_labels.items()
        assert {"app.kubernetes.io/name", "app.kubernetes.io/version"} <= pod_labels.keys()
        assert not {"app.kubernetes.io/name", "app.kubernetes.io/version"} & selector.keys()  # immutable


def test_the_values_schema_is_enforced_by_helm():
    bad = helm("template", RELEASE, str(CHART), "--set", "operator.bogus=1", check=False)
    assert bad.returncode != 0 and "bogus" in bad.stderr
    no_redis = helm("template", RELEASE, str(CHART), "--set", "redis.enabled=false", check=False)
    assert no_redis.returncode != 0 and "redis" in no_redis.stderr


def _secret_refs(docs: list[dict]) -> set[tuple[str, str, str]]:
    """(env name, Secret, key) of the credentials every pod of the chart reads."""
    refs = set()
    for template in pod_templates(docs).values():
        for container in template["spec"]["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref and env["name"].startswith("KVFLEET_"):
                    refs.add((env["name"], ref["name"], ref["key"]))
    return refs


def test_gitops_renders_repeat_exactly_with_credentials_from_existing_secrets():
    """`helm template` (Argo CD, Flux) has no cluster for `lookup`: with adminTokenSecret (and the Redis URL
    from redis.externalUrlSecret) two renders are identical and nothing is generated."""
    file = values_file(VALUE_SETS["gitops"])
    first, second = (helm("template", RELEASE, str(CHART), "-n", NAMESPACE, "-f", file).stdout for _ in "12")
    assert first == second
    docs = render(VALUE_SETS["gitops"])
    assert by_kind(docs, "Secret") == []  # nothing for the chart to generate
    assert _secret_refs(docs) == {
        ("KVFLEET_ADMIN_TOKEN", "kvfleet-admin", "token"),
        ("KVFLEET_REDIS_URL", "redis-connection", "url"),
        ("KVFLEET_REPLICA_KEY_ROOT", "kvfleet-replica-key-root", "root"),
    }
    # Without them a token is generated per render (what NOTES warns GitOps users about).
    a, b = (helm("template", RELEASE, str(CHART), "-n", NAMESPACE).stdout for _ in "12")
    assert a != b


def test_credentials_sources():
    docs = render(VALUE_SETS["existing-secret"])
    assert by_kind(docs, "Secret") == []
    assert _secret_refs(docs) == {
        ("KVFLEET_ADMIN_TOKEN", "platform-credentials", "admin-token"),
        ("KVFLEET_REDIS_URL", "platform-credentials", "redis-url"),
        ("KVFLEET_REPLICA_KEY_ROOT", "platform-credentials", "replica-key-root"),
    }
    # Only the admin token from a Secret: the chart still generates the (bundled) Redis's password.
    docs = render({"adminTokenSecret": {"name": "mine"}})
    (secret,) = by_kind(docs, "Secret")
    assert set(secret["data"]) == {"redis-password", "replica-key-root"}
    assert ("KVFLEET_ADMIN_TOKEN", "mine", "admin-token") in _secret_refs(docs)
    (secret,) = by_kind(render({}), "Secret")
    assert set(secret["data"]) == {"admin-token", "redis-password", "replica-key-root"}
    # A Redis without a password (redis.auth.enabled: false) gets its URL from the chart's Secret, as before.
    (secret,) = by_kind(render({"redis": {"enabled": True, "auth": {"enabled": False}}}), "Secret")
    assert set(secret["data"]) == {"admin-token", "redis-url", "replica-key-root"}


def _key(doc: dict) -> tuple[str, str | None, str]:
    return doc["kind"], doc["metadata"].get("namespace"), doc["metadata"]["name"]


def _cluster_names(docs: list[dict]) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs if d["kind"] in CLUSTER_SCOPED}


def test_two_releases_share_no_cluster_object_and_no_peering():
    values = VALUE_SETS["namespaced"]
    a = render(values, release="alpha")
    b = render(values, release="beta")
    same_name_elsewhere = render(values, release="alpha", namespace="team-b")
    assert not _cluster_names(a) & _cluster_names(b)
    assert not _cluster_names(a) & _cluster_names(same_name_elsewhere)
    # Nor a namespaced one in a namespace both reach (watched, Tenant keys).
    assert not {_key(d) for d in a} & {_key(d) for d in same_name_elsewhere}
    # In a namespace both watch, each release has its own peering object and Role.
    shared = {
        (d["kind"], d["metadata"]["name"])
        for d in a
        if d["metadata"].get("namespace") == "ml" and d["kind"] in ("KopfPeering", "Role", "RoleBinding")
    }
    assert shared and not shared & {(d["kind"], d["metadata"]["name"]) for d in b}
    for docs in (a, b, render({}), render({}, release="other")):
        peerings = by_kind(docs, "KopfPeering") + by_kind(docs, "ClusterKopfPeering")
        assert {p["metadata"]["name"] for p in peerings} == {
            a.split("=", 1)[1] for a in operator_args(docs) if a.startswith("--peering=")
        }


def test_pdbs_and_spread_by_default_and_every_pod_knob():
    docs = render({})
    pods = pod_templates(docs)
    pdbs = {p["metadata"]["name"]: p for p in by_kind(docs, "PodDisruptionBudget")}
    assert set(pdbs) == {"kvfleet-gateway", "kvfleet-operator"}
    for name, pdb in pdbs.items():
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pods[name]["metadata"]["labels"].items()
        (term,) = pods[name]["spec"]["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ]
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        assert (
            term["podAffinityTerm"]["labelSelector"]["matchLabels"] == pdb["spec"]["selector"]["matchLabels"]
        )

    docs = render(VALUE_SETS["custom"])
    pods = pod_templates(docs)
    operator, gateway, redis = (pods[f"kvfleet-{c}"] for c in ("operator", "gateway", "redis"))
    assert operator["metadata"]["labels"]["app.kubernetes.io/name"] == "fleet"
    assert operator["metadata"]["labels"]["app.kubernetes.io/version"] == "1.2.3_build.4"
    assert operator["metadata"]["annotations"]["example.com/team"] == "operator-owners"  # its own wins
    assert gateway["metadata"]["annotations"]["example.com/team"] == "ml-platform"
    own = {k: v for k, v in redis["metadata"]["annotations"].items() if not k.startswith("checksum/")}
    assert own == {"example.com/team": "ml-platform"}
    assert operator["spec"]["priorityClassName"] == "platform-critical"
    assert gateway["spec"]["priorityClassName"] == redis["spec"]["priorityClassName"] == "platform"
    assert {"name": "KVFLEET_LOG_LEVEL", "value": "debug"} in operator["spec"]["containers"][0]["env"]
    assert gateway["spec"]["containers"][0]["env"][-1]["name"] == "HTTP_PROXY"
    assert gateway["spec"]["affinity"] == VALUE_SETS["custom"]["gateway"]["affinity"]
    assert "podAntiAffinity" in operator["spec"]["affinity"]
    assert {
        p["metadata"]["name"]: p["spec"]["maxUnavailable"] for p in by_kind(docs, "PodDisruptionBudget")
    } == {"kvfleet-gateway": "50%"}
    assert operator["spec"]["imagePullSecrets"] == [{"name": "registry-pull"}]
    assert not by_kind(docs, "ValidatingAdmissionPolicy")  # operator.tenantAdmissionPolicy: false
    assert not [a for a in operator_args(docs) if a.startswith("--engine-network-policy")]


def _notes(values: dict) -> str:
    args = ("install", RELEASE, str(CHART), "-n", NAMESPACE, "--dry-run=client", "-f", values_file(values))
    out = helm(*args, check=False)
    if out.returncode != 0 and "cluster unreachable" in out.stderr:
        pytest.skip("this helm (3.x) renders NOTES only against a cluster; helm 4 does without")
    assert out.returncode == 0, out.stderr
    return out.stdout.split("NOTES:", 1)[1]


@pytest.mark.parametrize("values", ["defaults", "namespaced", "gitops"])
def test_notes_work_from_the_packaged_chart(values):
    """NOTES may not point at files the packaged chart lacks (examples/): its examples are inline, and
    valid; the admin-token command names the Secret the token really is in."""
    notes = _notes(VALUE_SETS[values])
    assert not re.search(r"-f\s+examples/", notes)
    blocks = re.findall(r"<<'YAML'\n(.*?)\n\s*YAML\n", notes, re.S)
    docs = [yaml.safe_load(textwrap.dedent(block)) for block in blocks]
    assert [d["kind"] for d in docs] == ["InferenceModel", "Tenant"]
    model_spec_from({**docs[0], "metadata": {**docs[0]["metadata"], "namespace": "default"}})
    validated_inference_model(docs[0])
    assert validated_tenant(docs[1])["apiKeySecretRef"]["namespace"] == NAMESPACE
    token_secret = {
        "defaults": "kvfleet-credentials -o jsonpath='{.data.admin-token}'",
        "namespaced": "kvfleet-credentials -o jsonpath='{.data.admin-token}'",
        "gitops": "kvfleet-admin -o jsonpath='{.data.token}'",
    }[values]
    assert token_secret in notes
    assert ("set adminTokenSecret.name" in notes) == (values != "gitops")


def _labels_match(selector: dict, labels: dict) -> bool:
    return selector.get("matchLabels", {}).items() <= labels.items() and not selector.get("matchExpressions")


def _admits(policy: dict, namespace: str, pod_labels: dict) -> bool:
    """Whether a NetworkPolicy's ingress admits a pod (namespaces labelled as Kubernetes labels them)."""
    ns_labels = {"kubernetes.io/metadata.name": namespace}
    for rule in policy["spec"]["ingress"]:
        for peer in rule["from"]:
            ns_ok = (
                _labels_match(peer["namespaceSelector"], ns_labels)
                if "namespaceSelector" in peer
                else (namespace == policy["metadata"]["namespace"])
            )
            pod_ok = _labels_match(peer["podSelector"], pod_labels) if "podSelector" in peer else True
            if ns_ok and pod_ok:
                return True
    return False


@pytest.mark.parametrize("values", ["defaults", "namespaced", "kind"])
def test_a_model_in_another_namespace_is_reachable_only_from_the_releases_gateway_and_operator(values):
    """The quickstart's case: the release in kvfleet-system, the demo model in `default`. The operator the
    chart runs (its real command line, parsed by `kvfleet operator`'s parser) gives the model a NetworkPolicy
    in `default` that admits the chart's gateway and operator pods, and no other pod."""
    docs = render(VALUE_SETS[values])
    args = [a.replace("$(POD_NAMESPACE)", NAMESPACE) for a in operator_args(docs)]
    config = config_from(run_parser().parse_args(args))
    assert config.engine_network_policy and config.namespace == NAMESPACE
    demo = yaml.safe_load((CHART.parents[1] / "examples" / "demo-cpu.yaml").read_text())
    demo["metadata"].update(namespace="default", uid="u")
    model = model_spec_from(demo)
    (policy,) = [o for o in manifests.children(model, config) if o["kind"] == "NetworkPolicy"]
    assert policy["metadata"]["namespace"] == "default"
    engine_labels = manifests.deployment(model, config)["spec"]["template"]["metadata"]["labels"]
    assert _labels_match(policy["spec"]["podSelector"], engine_labels)
    pods = pod_templates(docs)
    for component in ("gateway", "operator"):
        labels = pods[f"kvfleet-{component}"]["metadata"]["labels"]
        assert _admits(policy, NAMESPACE, labels), component
    for other in ("redis", "otel-collector", "jaeger"):
        if f"kvfleet-{other}" in pods:
            assert not _admits(policy, NAMESPACE, pods[f"kvfleet-{other}"]["metadata"]["labels"]), other
    assert not _admits(policy, "default", {"app": "anything"})
    assert not _admits(
        policy, "default", {manifests.ENGINE_CLIENT_LABEL: "true"}
    )  # not the release's namespace
    extra = VALUE_SETS[values].get("networkPolicy", {}).get("extraIngressFrom", [])
    assert _admits(policy, "monitoring", {"app": "prometheus"}) == bool(extra)


def test_the_engine_ingress_flag_carries_json_through_the_cli():
    docs = render(VALUE_SETS["namespaced"])
    (arg,) = [a for a in operator_args(docs) if a.startswith("--engine-ingress-from=")]
    peers = json.loads(arg.split("=", 1)[1])
    assert peers == VALUE_SETS["namespaced"]["networkPolicy"]["extraIngressFrom"]
    args = run_parser().parse_args(["--engine-ingress-from", json.dumps(copy.deepcopy(peers))])
    assert config_from(args).engine_ingress_from == tuple(peers)
    with pytest.raises(SystemExit):
        run_parser().parse_args(["--engine-ingress-from", "{not json"])
