"""The operator's RBAC as the chart renders it, evaluated as the API server's authorizer would: every call
the operator makes is allowed where models and Tenant keys live, nothing else is, with `watchNamespaces` no
write access reaches beyond the watched namespaces, and docs/SECURITY.md's table lists exactly what renders.
Plus the admission policy on Tenants' key namespace, its CEL evaluated with cel-python."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from tests.operator.cel_eval import evaluate
from tests.operator.helm_chart import NAMESPACE, ROOT, VALUE_SETS, by_kind, operator_args, render

OPERATOR_SA = (NAMESPACE, "kvfleet-operator")
CLUSTER = "cluster"  # a cluster-scoped resource
NAMESPACED_WRITES = [
    ("apps", "deployments"),
    ("", "services"),
    ("", "configmaps"),
    ("", "secrets"),
    ("policy", "poddisruptionbudgets"),
    ("networking.k8s.io", "networkpolicies"),
]

# Every API call the operator (kvfleet_operator and kopf) makes: (verbs, group, resource, where).
CALLS_ON_CLUSTER = [
    ("get list watch patch", "kvfleet.io", "tenants"),  # kopf watches, adds finalizers and progress
    ("patch", "kvfleet.io", "tenants/status"),  # handlers.tenants.write_tenant_status
    ("list watch", "apiextensions.k8s.io", "customresourcedefinitions"),  # kopf: resource discovery
    ("list watch", "", "namespaces"),  # kopf: which watched namespaces exist
]
CALLS_WHERE_MODELS_LIVE = [
    ("get list watch patch", "kvfleet.io", "inferencemodels"),
    ("patch", "kvfleet.io", "inferencemodels/status"),
    ("update", "kvfleet.io", "inferencemodels/finalizers"),  # ownerReferences with blockOwnerDeletion
    ("get list watch create patch delete", "apps", "deployments"),
    ("create patch delete", "", "services"),
    ("create patch delete", "", "configmaps"),
    ("create patch delete", "", "secrets"),  # each model's credentials: written, never read
    ("create patch delete", "policy", "poddisruptionbudgets"),
    ("create patch delete", "networking.k8s.io", "networkpolicies"),
    ("list", "", "pods"),  # status and deletion list the model's pods
    ("create", "", "events"),  # kopf posts the models' Events
]
CALLS_IN_THE_RELEASE_NAMESPACE = [("get", "", "secrets"), ("create", "", "events")]  # Tenant keys, Events


@dataclass
class Authorizer:
    """RBAC of one ServiceAccount: (namespace or None for every namespace, rules) per binding."""

    grants: list[tuple[str | None, list[dict]]]

    @classmethod
    def of(cls, docs: list[dict], subject: tuple[str, str] = OPERATOR_SA) -> Authorizer:
        cluster_roles = {d["metadata"]["name"]: d["rules"] for d in by_kind(docs, "ClusterRole")}
        roles = {
            (d["metadata"]["namespace"], d["metadata"]["name"]): d["rules"] for d in by_kind(docs, "Role")
        }
        grants: list[tuple[str | None, list[dict]]] = []
        for binding in by_kind(docs, "ClusterRoleBinding") + by_kind(docs, "RoleBinding"):
            if not any(
                s["kind"] == "ServiceAccount" and (s["namespace"], s["name"]) == subject
                for s in binding["subjects"]
            ):
                continue
            ref, ns = binding["roleRef"], binding["metadata"].get("namespace")
            rules = cluster_roles[ref["name"]] if ref["kind"] == "ClusterRole" else roles[(ns, ref["name"])]
            grants.append((ns, rules))
        return cls(grants)

    def allows(self, verb: str, group: str, resource: str, namespace: str, name: str | None = None) -> bool:
        for scope, rules in self.grants:
            if scope is not None and scope != namespace:  # a RoleBinding: its namespace only
                continue
            for r in rules:
                if (
                    group in r["apiGroups"]
                    and resource in r["resources"]
                    and verb in r["verbs"]
                    and (not r.get("resourceNames") or name in r["resourceNames"])
                ):
                    return True
        return False


def _calls(table: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    return [(verb, group, resource) for verbs, group, resource in table for verb in verbs.split()]


def _peering(docs: list[dict]) -> str:
    (arg,) = [a for a in operator_args(docs) if a.startswith("--peering=")]
    return arg.split("=", 1)[1]


def test_cluster_wide_operator_may_do_every_call_in_any_namespace():
    docs = render({})
    auth = Authorizer.of(docs)
    for verb, group, resource in _calls(CALLS_ON_CLUSTER):
        assert auth.allows(verb, group, resource, CLUSTER), (verb, group, resource)
    for namespace in ("default", "team-a", NAMESPACE):
        for verb, group, resource in _calls(CALLS_WHERE_MODELS_LIVE):
            assert auth.allows(verb, group, resource, namespace), (verb, group, resource, namespace)
    for verb, group, resource in _calls(CALLS_IN_THE_RELEASE_NAMESPACE):
        assert auth.allows(verb, group, resource, NAMESPACE)
    peering = _peering(docs)
    for verb in ("list", "watch", "get", "patch"):
        assert auth.allows(verb, "kopf.dev", "clusterkopfpeerings", CLUSTER, peering)
    for verb in ("get", "patch"):  # another release's peering object is not this operator's to write
        assert not auth.allows(verb, "kopf.dev", "clusterkopfpeerings", CLUSTER, "default.other-kvfleet")


def test_with_watch_namespaces_no_write_access_reaches_beyond_them():
    values = VALUE_SETS["namespaced"]
    docs = render(values)
    auth = Authorizer.of(docs)
    watched = values["operator"]["watchNamespaces"]
    for namespace in watched:
        for verb, group, resource in _calls(CALLS_WHERE_MODELS_LIVE):
            assert auth.allows(verb, group, resource, namespace), (verb, group, resource, namespace)
        for verb in ("list", "watch", "get", "patch"):
            assert auth.allows(verb, "kopf.dev", "kopfpeerings", namespace, _peering(docs))
    for verb, group, resource in _calls(CALLS_ON_CLUSTER):
        assert auth.allows(verb, group, resource, CLUSTER)
    for namespace in ("default", "kube-system", NAMESPACE, "tenant-keys"):
        for group, resource in NAMESPACED_WRITES:
            for verb in ("create", "patch", "update", "delete"):
                assert not auth.allows(verb, group, resource, namespace), (verb, resource, namespace)
        assert not auth.allows("list", "", "pods", namespace)
        assert not auth.allows("patch", "kvfleet.io", "inferencemodels", namespace)
    # Nothing namespaced is granted cluster-wide at all.
    for role in by_kind(docs, "ClusterRole"):
        for rule in role["rules"]:
            assert not {"deployments", "secrets", "services", "configmaps", "pods", "inferencemodels"} & set(
                rule["resources"]
            ), rule


@pytest.mark.parametrize("values", ["defaults", "namespaced"])
def test_secrets_are_read_only_where_tenant_keys_may_live_and_never_listed(values):
    docs = render(VALUE_SETS[values])
    auth = Authorizer.of(docs)
    key_namespaces = [NAMESPACE, *VALUE_SETS[values].get("operator", {}).get("tenantSecretNamespaces", [])]
    for namespace in ("default", "ml", "kube-system", *key_namespaces):
        assert auth.allows("get", "", "secrets", namespace) == (namespace in key_namespaces), namespace
        for verb in ("list", "watch"):
            assert not auth.allows(verb, "", "secrets", namespace)
    for _, rules in auth.grants:
        for rule in rules:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
            if "pods" in rule["resources"]:
                assert rule["verbs"] == ["list"]


def test_no_network_policy_permission_without_network_policies():
    auth = Authorizer.of(render(VALUE_SETS["custom"]))  # networkPolicy.enabled: false
    assert not auth.allows("create", "networking.k8s.io", "networkpolicies", "default")
    assert auth.allows("create", "apps", "deployments", "default")


def _rendered_rbac_rows() -> set[tuple[str, str, str, str]]:
    """(role, apiGroup, resource, verb) over both modes; roles named by their suffix after the release's
    name (`operator`, `operator-models`, `operator-tenant-keys`)."""
    rows = set()
    for values in ("defaults", "namespaced"):
        for doc in by_kind(render(VALUE_SETS[values]), "ClusterRole") + by_kind(
            render(VALUE_SETS[values]), "Role"
        ):
            role = re.sub(r"^(kvfleet-system\.)?kvfleet-", "", doc["metadata"]["name"])
            for rule in doc["rules"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        rows |= {(role, group, resource, verb) for verb in rule["verbs"]}
    return rows


def _documented_rbac_rows() -> set[tuple[str, str, str, str]]:
    text = (ROOT / "docs" / "SECURITY.md").read_text()
    table = text.split("<!-- rbac-table -->", 2)[1]
    rows = set()
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 5 or not cells[0].startswith("`"):
            continue
        role, group = cells[0].strip("`"), cells[1].strip("`").replace('""', "")
        for resource in re.findall(r"[a-z/]+", cells[2]):
            rows |= {(role, group, resource, verb) for verb in re.findall(r"[a-z]+", cells[3])}
    return rows


def test_docs_security_table_lists_exactly_the_rendered_rbac():
    assert _documented_rbac_rows() == _rendered_rbac_rows()


def _tenant_policy(values: dict) -> tuple[str, str]:
    (policy,) = by_kind(render(values), "ValidatingAdmissionPolicy")
    (validation,) = policy["spec"]["validations"]
    rules = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rules == [
        {
            "apiGroups": ["kvfleet.io"],
            "apiVersions": ["*"],
            "operations": ["CREATE", "UPDATE"],
            "resources": ["tenants"],
        }
    ]
    return validation["expression"], validation["message"]


def _tenant(namespace: str | None) -> dict:
    ref = {"name": "key"} | ({"namespace": namespace} if namespace else {})
    return {"apiVersion": "kvfleet.io/v1alpha1", "kind": "Tenant", "spec": {"apiKeySecretRef": ref}}


@pytest.mark.parametrize(
    "values, allowed",
    [("defaults", [NAMESPACE]), ("namespaced", [NAMESPACE, "tenant-keys"])],
)
def test_tenants_with_a_key_where_the_operator_cannot_read_are_refused_at_admission(values, allowed):
    expression, message = _tenant_policy(VALUE_SETS[values])
    assert evaluate(expression, object=_tenant(None))  # default: the operator's namespace
    for namespace in allowed:
        assert evaluate(expression, object=_tenant(namespace))
        assert namespace in message
    for namespace in ("default", "kube-system", "tenant-keys-2"):
        assert not evaluate(expression, object=_tenant(namespace)), namespace
    # The binding denies (not merely warns or audits).
    (binding,) = by_kind(render(VALUE_SETS[values]), "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["validationActions"] == ["Deny"]
