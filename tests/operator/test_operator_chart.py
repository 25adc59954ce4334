"""The Helm chart's static files. No `helm` binary here, so templates are not rendered: the checks cover
values.yaml against values.schema.json, Chart.yaml, the CRDs (see test_operator_schemas.py) and the
operator's RBAC rules, which are plain YAML inside their template."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "kvfleet"


def values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def errors(doc: dict) -> list[str]:
    return [
        "/".join(map(str, e.absolute_path)) + ": " + e.message
        for e in jsonschema.Draft7Validator(schema()).iter_errors(doc)
    ]


def test_values_schema_is_valid_and_accepts_the_defaults():
    jsonschema.Draft7Validator.check_schema(schema())
    assert errors(values()) == []


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("redis", "enabled"), False, "redis/externalUrl: "),
        (("redis", "externalUrl"), "http://redis:6379", "does not match"),
        (("operator", "replicas"), 0, "less than the minimum"),
        (("gateway", "service", "type"), "Ingress", "is not one of"),
        (("image", "pullPolicy"), "Sometimes", "is not one of"),
        (("operator", "unknownKey"), 1, "Additional properties are not allowed"),
        (("serviceMonitor", "interval"), "30 seconds", "does not match"),
    ],
)
def test_values_schema_rejects_bad_values(path, value, message):
    doc = copy.deepcopy(values())
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert any(message in e for e in errors(doc)), errors(doc)


def test_chart_metadata():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "kvfleet" and chart["type"] == "application"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])
    assert {p.name for p in (CHART / "crds").glob("*.yaml")} >= {"inferencemodels.yaml", "tenants.yaml"}


def _cluster_role_rules() -> list[dict]:
    text = (CHART / "templates" / "operator-rbac.yaml").read_text()
    block = text.split("kind: ClusterRole\n", 1)[1].split("\n---", 1)[0]
    rules = "rules:" + block.split("\nrules:", 1)[1]
    return yaml.safe_load(rules)["rules"]


def allowed(rules: list[dict], group: str, resource: str, verb: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)


def test_operator_rbac_covers_every_call_and_stays_least_privilege():
    rules = _cluster_role_rules()
    needed = [("kvfleet.io", "inferencemodels", v) for v in ("get", "list", "watch", "patch")] + [
        ("kvfleet.io", "tenants", "watch"),
        ("kvfleet.io", "inferencemodels/status", "patch"),
        ("kvfleet.io", "tenants/status", "patch"),
        ("apps", "deployments", "get"),
        ("apps", "deployments", "watch"),
        ("apps", "deployments", "patch"),
        ("apps", "deployments", "delete"),
        ("", "services", "patch"),
        ("", "configmaps", "patch"),
        ("", "secrets", "patch"),
        ("policy", "poddisruptionbudgets", "patch"),
        ("", "pods", "list"),
        ("", "events", "create"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
        ("kopf.dev", "clusterkopfpeerings", "patch"),
    ]
    missing = [n for n in needed if not allowed(rules, *n)]
    assert missing == []
    # Cluster-wide, the operator may write Secrets (each model's credentials) but never read them, and may
    # not touch pods beyond watching.
    for verb in ("get", "list", "watch"):
        assert not allowed(rules, "", "secrets", verb)
    for verb in ("create", "patch", "delete", "watch"):
        assert not allowed(rules, "", "pods", verb)
    assert not any("*" in r["verbs"] or "*" in r["resources"] for r in rules)
