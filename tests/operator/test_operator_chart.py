"""The Helm chart's static files: values.yaml against values.schema.json, and Chart.yaml. The rendered chart
(helm lint and template, RBAC, Pod Security) is tested in test_chart_helm.py, test_chart_rbac.py and
test_pod_security.py; the CRDs in test_operator_schemas.py."""

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
        (("redis", "enabled"), False, "redis: {'enabled': False"),
        (("redis", "externalUrlSecret"), {"name": "Bad_Name"}, "does not match"),
        (("operator", "watchNamespaces"), ["Team_A"], "does not match"),
        (("operator", "tenantSecretNamespaces"), ["-x"], "does not match"),
        (("gateway", "podDisruptionBudget"), {"maxUnavailable": "half"}, "is not valid under any"),
        (("adminTokenSecret",), {"name": "s", "keys": "x"}, "Additional properties are not allowed"),
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
