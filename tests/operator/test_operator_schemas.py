"""The CRDs, the examples and every rendered manifest against the Kubernetes schemas.

`kubernetes_validate` checks objects against the OpenAPI schemas of a given Kubernetes release (no cluster
needed); the CRDs' own OpenAPI schemas check the examples; the CEL rules' Python twins are exercised one by one.
"""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfleet_operator import crds, manifests
from kvfleet_operator.operator_cli import crd_files
from kvfleet_operator.spec import OperatorConfig, model_spec_from
from kvfleet_operator.validation import (
    SpecError,
    apply_defaults,
    schema_errors,
    validated_inference_model,
    validated_tenant,
)

ROOT = Path(__file__).resolve().parents[2]
# The oldest and newest Kubernetes releases the manifests are checked against.
K8S_VERSIONS = ("1.30", "1.33")
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def example_docs() -> list[tuple[str, dict]]:
    return [(p.name, d) for p in EXAMPLES for d in yaml.safe_load_all(p.read_text()) if d]


def k8s_validate(obj: dict) -> None:
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("folder", ["crds", "charts/kvfleet/crds"])
def test_checked_in_crds_are_what_the_code_builds(folder):
    on_disk = {p.name: p.read_text() for p in (ROOT / folder).glob("*.yaml")}
    assert on_disk == crd_files(), f"regenerate with: kvfleet operator crds --out {folder}"


@pytest.mark.parametrize("name", list(crds.all_crds()))
def test_crds_validate_against_kubernetes(name):
    k8s_validate(crds.all_crds()[name])


def _walk_structural(schema: dict, path: str, problems: list[str]) -> None:
    """The structural-schema rules the API server enforces that a JSON-schema validator does not."""
    special = schema.get("x-kubernetes-int-or-string") or schema.get("x-kubernetes-preserve-unknown-fields")
    if "type" not in schema and not special:
        problems.append(f"{path}: no type")
    if "anyOf" in schema:
        if not schema.get("x-kubernetes-int-or-string"):
            problems.append(f"{path}: anyOf only for int-or-string")
        for branch in schema["anyOf"]:
            if set(branch) != {"type"}:
                problems.append(f"{path}: anyOf branches may only name a type")
    if "default" in schema:
        errors = schema_errors(schema["default"], schema)
        if errors:
            problems.append(f"{path}: default {schema['default']!r} is invalid: {errors}")
    for key, sub in schema.get("properties", {}).items():
        _walk_structural(sub, f"{path}.{key}", problems)
    if isinstance(schema.get("items"), dict):
        _walk_structural(schema["items"], f"{path}[]", problems)
    if isinstance(schema.get("additionalProperties"), dict):
        _walk_structural(schema["additionalProperties"], f"{path}.*", problems)


@pytest.mark.parametrize("schema_fn", [crds.inference_model_schema, crds.tenant_schema])
def test_schemas_are_structural_and_defaults_valid(schema_fn):
    problems: list[str] = []
    _walk_structural(schema_fn(), "", problems)
    assert problems == []


@pytest.mark.parametrize("name, doc", example_docs(), ids=lambda v: v if isinstance(v, str) else "")
def test_examples_validate(name, doc):
    if doc["apiVersion"] == crds.API_VERSION:
        schema = crds.inference_model_schema() if doc["kind"] == crds.MODEL_KIND else crds.tenant_schema()
        assert schema_errors(apply_defaults(doc, schema), schema) == []
        if doc["kind"] == crds.MODEL_KIND:
            validated_inference_model(doc)
        else:
            validated_tenant(doc)
    else:
        k8s_validate(doc)


def test_every_example_model_renders_manifests_valid_for_kubernetes():
    models = [d for _, d in example_docs() if d["kind"] == crds.MODEL_KIND]
    assert len(models) >= 3
    config = OperatorConfig()
    for doc in models:
        doc = copy.deepcopy(doc)
        doc["metadata"].update(namespace="default", uid="6f1d9d5c-3f8a-4d0e-9a43-0c2f8a1b7e55")
        for obj in manifests.children(model_spec_from(doc), config):
            k8s_validate(obj)


def test_cpu_and_hf_variants_render_valid_manifests():
    doc = {
        "metadata": {"name": "m", "namespace": "default", "uid": "u"},
        "spec": {"model": {"uri": "hf://org/model"}, "accelerator": "cpu", "replicas": 0},
    }
    for obj in manifests.children(model_spec_from(doc), OperatorConfig()):
        k8s_validate(obj)


# The CEL rules (and their twins) are evaluated one by one in test_operator_cel.py.


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"model": {"uri": "pvc://m"}, "replicas": -1}, ".spec.replicas: -1 is less than the minimum of 0"),
        ({"model": {"uri": "s3://bucket/m"}}, ".spec.model.uri: 's3://bucket/m' is not of the expected form"),
        ({}, "'model' is a required property"),
        ({"model": {"uri": "pvc://m"}, "accelerator": "tpu"}, "'tpu' is not one of ['nvidia', 'cpu']"),
        (
            {"model": {"uri": "pvc://m"}, "engine": {"kvCacheMemory": "lots"}},
            "must be an integer or a quantity",
        ),
        ({"model": {"uri": "pvc://m"}, "engine": {"gpuMemoryUtilization": 0}}, "gpuMemoryUtilization"),
        (
            {"model": {"uri": "pvc://m"}, "engine": {"extraArgs": ["--port=9"]}},
            "extraArgs[0]: '--port=9': extraArgs may not set a flag the operator sets",
        ),
        ({"model": {"uri": "pvc://m"}, "sleep": {"level": 3}}, ".spec.sleep.level: 3 is greater than"),
        (
            {"model": {"uri": "pvc://m", "servedName": "org/m:latest"}},
            ".spec.model.servedName: 'org/m:latest'",
        ),
        ({"model": {"uri": "pvc://m"}, "access": {"tenants": ["team a"]}}, ".spec.access.tenants[0]"),
    ],
)
def test_bad_model_specs_are_rejected_with_clear_messages(spec, message):
    with pytest.raises(SpecError) as err:
        validated_inference_model({"spec": spec})
    assert message in str(err.value)


def test_bad_model_names_are_rejected():
    with pytest.raises(SpecError, match="DNS-1035"):
        model_spec_from({"metadata": {"name": "Llama_3"}, "spec": {"model": {"uri": "pvc://m"}}})
    with pytest.raises(SpecError, match="at most 46"):
        model_spec_from({"metadata": {"name": "m" * 47}, "spec": {"model": {"uri": "pvc://m"}}})


def test_bad_tenant_specs_are_rejected():
    with pytest.raises(SpecError, match="'apiKeySecretRef' is a required property"):
        validated_tenant({"spec": {}})
    with pytest.raises(SpecError, match=r"spec.models\[0\]"):
        validated_tenant({"spec": {"apiKeySecretRef": {"name": "s"}, "models": ["meta/* extra"]}})
    with pytest.raises(SpecError, match="requestsPerMinute: -5 is less than the minimum"):
        validated_tenant({"spec": {"apiKeySecretRef": {"name": "s"}, "limits": {"requestsPerMinute": -5}}})
    spec = validated_tenant({"spec": {"apiKeySecretRef": {"name": "s"}}})
    assert spec["models"] == ["*"] and spec["apiKeySecretRef"]["key"] == "apiKey" and spec["priority"] == 0


# ---- property: any valid spec renders objects the API server would accept --------------------------------


@st.composite
def valid_model_docs(draw) -> dict:
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    pp = draw(st.sampled_from([p for p in (1, 2, 4, 8) if tp * p <= 8]))
    accelerator = draw(st.sampled_from(["nvidia", "cpu"]))
    engine: dict = {"tensorParallelSize": tp, "pipelineParallelSize": pp}
    engine["dtype"] = draw(st.sampled_from(["auto", "float32", "float16", "bfloat16"]))
    if draw(st.booleans()):
        engine["maxNumSeqs"] = draw(st.integers(1, 512))
        engine["maxNumBatchedTokens"] = engine["maxNumSeqs"] * draw(st.integers(1, 64))
    memory = draw(st.sampled_from(["none", "kv", "gpu"] if accelerator == "nvidia" else ["none", "kv"]))
    if memory == "kv":
        engine["kvCacheMemory"] = draw(st.sampled_from(["512Mi", "8Gi", "1G", 1073741824]))
    elif memory == "gpu":
        engine["gpuMemoryUtilization"] = draw(st.floats(0.05, 1.0))
    engine["enablePrefixCaching"] = draw(st.booleans())
    uri = draw(
        st.sampled_from(
            ["pvc://models", "pvc://models/a/b", "hf://org/name", "hf://org/name@v2", "file:///opt/m"]
        )
    )
    spec: dict = {
        "model": {"uri": uri},
        "engine": engine,
        "replicas": draw(st.integers(0, 16)),
        "accelerator": accelerator,
        "sleep": {"idleSeconds": draw(st.integers(0, 3600)), "level": draw(st.sampled_from([1, 2]))},
        "startupTimeoutSeconds": draw(st.integers(60, 7200)),
    }
    if draw(st.booleans()):
        spec["resources"] = {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "32Gi"}}
    if draw(st.booleans()):
        spec["nodeSelector"] = {"pool": "gpu"}
        spec["tolerations"] = [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]
    name = draw(st.from_regex(r"[a-z][a-z0-9-]{0,20}[a-z0-9]", fullmatch=True))
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": "4b1c7c9e-0000-4000-8000-000000000001"},
        "spec": spec,
    }


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_model_docs())
def test_any_valid_model_renders_manifests_kubernetes_accepts(doc):
    for obj in manifests.children(model_spec_from(doc), OperatorConfig()):
        kubernetes_validate.validate(obj, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize(
    "name", ["meta-llama/Llama-3.1-8B", "a", "team_a", "m@rev", "x+y=z", "org/m:latest", "-x", "a b", "é"]
)
def test_crd_name_pattern_matches_the_redis_contract(name):
    import re

    from kvfleet_common.redis_keys import check_name

    try:
        check_name(name)
        accepted = True
    except ValueError:
        accepted = False
    assert bool(re.match(crds.NAME_PATTERN, name)) == accepted
