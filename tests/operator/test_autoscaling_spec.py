"""`spec.autoscaling` of an InferenceModel: its OpenAPI schema and defaults, its CEL rules (evaluated with
cel-python, cel_eval.py) each against its Python twin in validation.py, and the AutoscalingPolicy that
`model_spec_from` builds from it (defaults by metric from `autoscaling.DEFAULT_TARGETS`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_operator import crd_autoscaling, crds
from kvfleet_operator.autoscaling import DEFAULT_TARGETS, METRICS, AutoscalingPolicy
from kvfleet_operator.spec import model_spec_from
from kvfleet_operator.validation import SpecError, apply_defaults, schema_errors, validated_inference_model
from tests.operator.cel_eval import rule_failures

SCHEMA = crds.inference_model_schema()
AUTOSCALING_SCHEMA = SCHEMA["properties"]["spec"]["properties"]["autoscaling"]


def model(autoscaling: dict | None = None, **spec) -> dict:
    body = {"model": {"uri": "pvc://models/m"}, **spec}
    if autoscaling is not None:
        body["autoscaling"] = autoscaling
    return {
        "apiVersion": crds.API_VERSION,
        "kind": crds.MODEL_KIND,
        "metadata": {"name": "m", "namespace": "ml", "uid": "u"},
        "spec": body,
    }


def admission_errors(doc: dict) -> list[str]:
    """What the API server refuses ``doc`` for, after its defaulting: schema errors, else failed CEL rules."""
    defaulted = apply_defaults(doc, SCHEMA)
    return schema_errors(defaulted, SCHEMA) or rule_failures(SCHEMA, defaulted)


def twin_errors(doc: dict) -> str:
    """The operator's own verdict ('' when it accepts the object)."""
    try:
        model_spec_from(doc)
    except SpecError as e:
        return str(e)
    return ""


# ---- the schema and its defaults ---------------------------------------------------------------------------


def test_absent_autoscaling_keeps_fixed_replicas():
    spec = model_spec_from(model(replicas=3))
    assert spec.autoscaling is None and spec.replicas == 3
    assert "autoscaling" not in validated_inference_model(model())  # no default: absent stays absent


def test_only_max_replicas_is_required_and_the_rest_defaults():
    assert validated_inference_model(model({"maxReplicas": 4}))["autoscaling"] == {
        "maxReplicas": 4,
        "minReplicas": 1,
        "metric": "inFlight",
        "scaleUpStabilizationSeconds": 30,
        "scaleDownDelaySeconds": 300,
        "scaleToZeroAfterSeconds": 3600,
    }
    assert model_spec_from(model({"maxReplicas": 4})).autoscaling == AutoscalingPolicy(
        min_replicas=1,
        max_replicas=4,
        metric="inFlight",
        target=DEFAULT_TARGETS["inFlight"],
        scale_up_stabilization_s=30.0,
        scale_down_delay_s=300.0,
        scale_to_zero_after_s=3600.0,
    )


@pytest.mark.parametrize("metric", METRICS)
def test_the_target_defaults_by_metric(metric):
    policy = model_spec_from(model({"maxReplicas": 2, "metric": metric})).autoscaling
    assert policy is not None and policy.metric == metric and policy.target == DEFAULT_TARGETS[metric]


def test_every_field_reaches_the_policy():
    policy = model_spec_from(
        model(
            {
                "minReplicas": 0,
                "maxReplicas": 12,
                "metric": "waiting",
                "target": 3,
                "scaleUpStabilizationSeconds": 0,
                "scaleDownDelaySeconds": 45,
                "scaleToZeroAfterSeconds": 900,
            },
            sleep={"idleSeconds": 120},
        )
    ).autoscaling
    assert policy == AutoscalingPolicy(
        min_replicas=0,
        max_replicas=12,
        metric="waiting",
        target=3.0,
        scale_up_stabilization_s=0.0,
        scale_down_delay_s=45.0,
        scale_to_zero_after_s=900.0,
    )
    assert isinstance(policy.target, float)


@pytest.mark.parametrize(
    "autoscaling, field",
    [
        ({}, "maxReplicas"),  # required
        ({"maxReplicas": 0}, "maxReplicas"),
        ({"maxReplicas": 1025}, "maxReplicas"),
        ({"maxReplicas": 2.5}, "maxReplicas"),
        ({"maxReplicas": 4, "minReplicas": -1}, "minReplicas"),
        ({"maxReplicas": 4, "minReplicas": 1025}, "minReplicas"),
        ({"maxReplicas": 4, "metric": "qps"}, "metric"),
        ({"maxReplicas": 4, "target": 0}, "target"),
        ({"maxReplicas": 4, "target": -2.5}, "target"),
        ({"maxReplicas": 4, "target": "8"}, "target"),
        ({"maxReplicas": 4, "scaleUpStabilizationSeconds": 3601}, "scaleUpStabilizationSeconds"),
        ({"maxReplicas": 4, "scaleUpStabilizationSeconds": -1}, "scaleUpStabilizationSeconds"),
        ({"maxReplicas": 4, "scaleDownDelaySeconds": 86401}, "scaleDownDelaySeconds"),
        ({"maxReplicas": 4, "scaleToZeroAfterSeconds": 604801}, "scaleToZeroAfterSeconds"),
        ({"maxReplicas": 4, "scaleToZeroAfterSeconds": -1}, "scaleToZeroAfterSeconds"),
    ],
    ids=lambda v: v if isinstance(v, str) else repr(v),
)
def test_the_schema_refuses_out_of_range_fields_and_so_does_the_operator(autoscaling, field):
    errors = admission_errors(model(autoscaling))
    assert errors and all(".spec.autoscaling" in e for e in errors), errors
    assert any(field in e for e in errors), errors
    assert ".spec.autoscaling" in twin_errors(model(autoscaling))
    assert field in twin_errors(model(autoscaling))


def test_bounds_are_inclusive():
    autoscaling = {
        "minReplicas": 1024,
        "maxReplicas": 1024,
        "target": 0.001,
        "scaleUpStabilizationSeconds": 3600,
        "scaleDownDelaySeconds": 86400,
        "scaleToZeroAfterSeconds": 604800,
    }
    assert admission_errors(model(autoscaling)) == [] and twin_errors(model(autoscaling)) == ""
    zero = {"minReplicas": 0, "maxReplicas": 1, "scaleUpStabilizationSeconds": 0, "scaleDownDelaySeconds": 0}
    zero["scaleToZeroAfterSeconds"] = 0
    assert admission_errors(model(zero)) == [] and twin_errors(model(zero)) == ""


# ---- the CEL rules and their twins -------------------------------------------------------------------------

REFUSED = {
    crd_autoscaling.AUTOSCALING_MIN_MAX_MESSAGE: [
        (model({"minReplicas": 3, "maxReplicas": 2}), "spec.autoscaling"),
        (model({"maxReplicas": 1, "minReplicas": 1024}), "spec.autoscaling"),
    ],
    crd_autoscaling.AUTOSCALING_KV_TARGET_MESSAGE: [
        (model({"maxReplicas": 2, "metric": "kvCacheUsage", "target": 1.01}), "spec.autoscaling.target"),
        (model({"maxReplicas": 2, "metric": "kvCacheUsage", "target": 2}), "spec.autoscaling.target"),
    ],
    crd_autoscaling.AUTOSCALING_ZERO_AFTER_SLEEP_MESSAGE: [
        (
            model(
                {"minReplicas": 0, "maxReplicas": 2, "scaleToZeroAfterSeconds": 600},
                sleep={"idleSeconds": 600},
            ),
            "spec.autoscaling.scaleToZeroAfterSeconds",
        ),
        (  # the default (3600 s) against a longer idle sleep
            model({"minReplicas": 0, "maxReplicas": 2}, sleep={"idleSeconds": 7200, "level": 2}),
            "spec.autoscaling.scaleToZeroAfterSeconds",
        ),
    ],
}

ACCEPTED = [
    model({"minReplicas": 2, "maxReplicas": 2}),
    model({"maxReplicas": 2, "metric": "kvCacheUsage"}),  # the default target, 0.7
    model({"maxReplicas": 2, "metric": "kvCacheUsage", "target": 1}),
    model({"maxReplicas": 2, "metric": "kvCacheUsage", "target": 0.85}),
    model({"maxReplicas": 2, "metric": "inFlight", "target": 32}),  # a count: no upper bound
    model({"maxReplicas": 2, "metric": "waiting", "target": 1.5}),
    model({"minReplicas": 0, "maxReplicas": 2, "scaleToZeroAfterSeconds": 601}, sleep={"idleSeconds": 600}),
    model({"minReplicas": 0, "maxReplicas": 2, "scaleToZeroAfterSeconds": 0}),  # no idle sleep: no ladder
    model({"minReplicas": 1, "maxReplicas": 2, "scaleToZeroAfterSeconds": 60}, sleep={"idleSeconds": 600}),
    model(sleep={"idleSeconds": 600}),  # no autoscaling at all
]


def test_every_autoscaling_rule_has_refused_examples():
    messages = {rule["message"] for rule in AUTOSCALING_SCHEMA["x-kubernetes-validations"]}
    messages |= {
        rule["message"]
        for rule in SCHEMA["properties"]["spec"]["x-kubernetes-validations"]
        if "autoscaling" in rule["rule"]
    }
    assert messages == set(REFUSED)


@pytest.mark.parametrize(
    "message, doc, path",
    [(message, doc, path) for message, cases in REFUSED.items() for doc, path in cases],
    ids=lambda v: v[:30] if isinstance(v, str) else "",
)
def test_each_rule_refuses_and_so_does_its_twin_naming_the_field(message, doc, path):
    assert admission_errors(doc) == [message]
    errors = twin_errors(doc)
    assert f"{path}: {message}" in errors, errors


@pytest.mark.parametrize("doc", ACCEPTED, ids=lambda d: repr(d["spec"].get("autoscaling")))
def test_valid_specs_pass_the_rules_and_the_twin(doc):
    assert admission_errors(doc) == []
    assert twin_errors(doc) == ""


def test_an_invalid_spec_names_every_problem():
    doc = model(
        {"minReplicas": 0, "maxReplicas": 0, "metric": "kvCacheUsage", "target": 3}, sleep={"idleSeconds": 10}
    )
    errors = twin_errors(doc)  # a schema error (maxReplicas 0) is reported before the rules run
    assert ".spec.autoscaling.maxReplicas: 0 is less than the minimum of 1" in errors
    doc["spec"]["autoscaling"]["maxReplicas"] = 1
    doc["spec"]["autoscaling"]["minReplicas"] = 2
    doc["spec"]["autoscaling"]["scaleToZeroAfterSeconds"] = 5
    errors = twin_errors(doc)
    assert crd_autoscaling.AUTOSCALING_MIN_MAX_MESSAGE in errors and crd_autoscaling.AUTOSCALING_KV_TARGET_MESSAGE in errors
    assert crd_autoscaling.AUTOSCALING_ZERO_AFTER_SLEEP_MESSAGE not in errors  # minReplicas is 2 now: no ladder
    assert admission_errors(doc) == [crd_autoscaling.AUTOSCALING_MIN_MAX_MESSAGE, crd_autoscaling.AUTOSCALING_KV_TARGET_MESSAGE]


@st.composite
def autoscaled_models(draw) -> dict:
    scaling: dict = {"maxReplicas": draw(st.integers(1, 1024))}
    for name, low, high in [
        ("minReplicas", 0, 1024),
        ("scaleUpStabilizationSeconds", 0, 3600),
        ("scaleDownDelaySeconds", 0, 86400),
        ("scaleToZeroAfterSeconds", 0, 604800),
    ]:
        if draw(st.booleans()):
            scaling[name] = draw(st.sampled_from([low, high, (low + high) // 2, low + 1, 600, 3600]))
            scaling[name] = min(max(scaling[name], low), high)
    if draw(st.booleans()):
        scaling["metric"] = draw(st.sampled_from(METRICS))
    if draw(st.booleans()):
        scaling["target"] = draw(
            st.one_of(st.integers(1, 64), st.floats(0.01, 64, allow_nan=False, allow_infinity=False))
        )
    sleep = {"idleSeconds": draw(st.sampled_from([0, 1, 600, 3599, 3600, 7200, 10**6]))}
    return model(scaling, sleep=sleep)


@settings(max_examples=200, deadline=None)
@given(autoscaled_models())
def test_the_cel_rules_and_their_twins_agree(doc):
    cel = admission_errors(doc)
    twin = twin_errors(doc)
    assert (cel == []) == (twin == ""), (cel, twin)
    for message in cel:
        assert message in twin
    if twin == "":
        policy = model_spec_from(doc).autoscaling
        assert policy is not None and policy.min_replicas <= policy.max_replicas and policy.target > 0


# ---- the CRD around it -------------------------------------------------------------------------------------


def test_the_scale_subresource_is_unchanged():
    """HPA, KEDA and `kubectl scale` go through /scale; with spec.autoscaling the operator writes the same
    spec.replicas."""
    assert crds.inference_model_crd()["spec"]["versions"][0]["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
