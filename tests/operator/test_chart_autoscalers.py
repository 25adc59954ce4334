"""The chart's `modelAutoscalers`, rendered by a real helm (helm_chart.py): each entry becomes an autoscaling/v2
HPA (checked against the Kubernetes 1.30 and 1.33 schemas) or a KEDA ScaledObject (checked against a schema of
KEDA's documented keda.sh/v1alpha1 fields, below), scaling the InferenceModel through its /scale subresource on
the gateways' per-model gauges; values that cannot work fail the render with a message naming the entry."""

from __future__ import annotations

import re

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvfleet_gateway.metrics import ModelLoadGauges
from kvfleet_operator import crds
from kvfleet_operator.autoscaling import DEFAULT_TARGETS
from tests.operator.helm_chart import CHART, NAMESPACE, RELEASE, by_kind, helm, render, values_file
from tests.operator.test_chart_helm import RECOMMENDED_LABELS

K8S_VERSIONS = ("1.30", "1.33")
IN_FLIGHT = "kvfleet_gateway_model_requests_in_flight"
HELD = "kvfleet_gateway_model_requests_held"
SCALE_TARGET_KEYS = {"apiVersion", "kind", "name"}

AUTOSCALERS = [
    {"name": "llama", "namespace": "ml", "kind": "hpa", "maxReplicas": 4},  # every default
    {"name": "phi", "namespace": "ml", "kind": "hpa", "minReplicas": 2, "maxReplicas": 6, "metric": "held"},
    {
        "name": "qwen",
        "namespace": "research",
        "servedName": "org/Qwen2.5@v2",  # not a label value: fine in PromQL
        "kind": "keda",
        "minReplicas": 2,
        "maxReplicas": 3,
        "targetPerReplica": 2.5,
        "prometheusAddress": "http://prometheus-operated.monitoring.svc:9090",
        "pollingInterval": 10,
    },
    {  # the release namespace, the held gauge only, KEDA's defaults
        "name": "mistral",
        "kind": "keda",
        "maxReplicas": 2,
        "metric": "held",
        "prometheusAddress": "https://prometheus.example:9090",
    },
]
VALUES = {"modelAutoscalers": AUTOSCALERS}

# keda.sh/v1alpha1 ScaledObject as KEDA documents it (https://keda.sh/docs/latest/reference/scaledobject-spec/
# and the Prometheus scaler's page): the fields this chart may set, each with its type; trigger metadata values
# are strings (a map[string]string in KEDA's API).
KEDA_SCALED_OBJECT = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string", "minLength": 1},
                        "envSourceContainerName": {"type": "string"},
                    },
                },
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "initialCooldownPeriod": {"type": "integer", "minimum": 0},
                "idleReplicaCount": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "fallback": {"type": "object"},
                "advanced": {"type": "object"},
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            "authenticationRef": {"type": "object"},
                            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                        },
                        "if": {"properties": {"type": {"const": "prometheus"}}},
                        "then": {
                            "properties": {
                                "metadata": {
                                    "required": ["serverAddress", "query", "threshold"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "serverAddress": {"type": "string", "pattern": "^https?://"},
                                        "query": {"type": "string", "minLength": 1},
                                        "threshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
                                        "activationThreshold": {
                                            "type": "string",
                                            "pattern": r"^[0-9]+(\.[0-9]+)?$",
                                        },
                                        "namespace": {"type": "string"},
                                        "customHeaders": {"type": "string"},
                                        "ignoreNullValues": {"type": "string"},
                                        "unsafeSsl": {"type": "string"},
                                        "queryParameters": {"type": "string"},
                                    },
                                }
                            }
                        },
                    },
                },
            },
        },
    },
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict]:
    """InferenceModel name -> its autoscaler, from one render of VALUES."""
    docs = render(VALUES)
    scalers = by_kind(docs, "HorizontalPodAutoscaler") + by_kind(docs, "ScaledObject")
    by_model = {d["spec"]["scaleTargetRef"]["name"]: d for d in scalers}
    assert len(by_model) == len(scalers) and set(by_model) == {a["name"] for a in AUTOSCALERS}
    return by_model


def _entry(name: str) -> dict:
    (entry,) = [a for a in AUTOSCALERS if a["name"] == name]
    return entry


def test_the_chart_reads_gauges_the_gateway_exports():
    """The series the autoscalers name, with the `model` label they select on, as the gateway's /metrics
    exposes them."""
    gauges = ModelLoadGauges()
    gauges.source = lambda: {"org/m": (3, 1, 40)}
    samples = {(s.name, tuple(s.labels.items()), s.value) for f in gauges.collect() for s in f.samples}
    assert {(IN_FLIGHT, (("model", "org/m"),), 3), (HELD, (("model", "org/m"),), 1)} <= samples


def test_helm_lint_strict_with_model_autoscalers():
    out = helm("lint", "--strict", str(CHART), "-f", values_file(VALUES))
    assert "0 chart(s) failed" in out.stdout


def test_the_defaults_render_no_model_autoscaler():
    docs = render({})
    assert by_kind(docs, "ScaledObject") == []
    assert [
        d for d in by_kind(docs, "HorizontalPodAutoscaler") if "kvfleet.io/model" in d["metadata"]["labels"]
    ] == []


def test_each_entry_targets_its_inference_model_in_its_namespace(rendered):
    for name, scaler in rendered.items():
        entry = _entry(name)
        assert scaler["kind"] == {"hpa": "HorizontalPodAutoscaler", "keda": "ScaledObject"}[entry["kind"]]
        assert scaler["spec"]["scaleTargetRef"] == {
            "apiVersion": crds.API_VERSION,
            "kind": crds.MODEL_KIND,
            "name": name,
        }
        meta = scaler["metadata"]
        assert meta["namespace"] == entry.get("namespace", NAMESPACE)  # an HPA scales only in its namespace
        assert meta["labels"]["kvfleet.io/model"] == name
        assert all(label in meta["labels"] for label in RECOMMENDED_LABELS), meta["labels"]


def test_the_scale_target_has_the_scale_subresource():
    """HPA and KEDA reach spec.replicas through /scale, and find the pods through its label selector."""
    scale = crds.inference_model_crd()["spec"]["versions"][0]["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.replicas" and scale["labelSelectorPath"] == ".status.selector"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_hpas_are_valid_kubernetes(rendered, version):
    hpas = [d for d in rendered.values() if d["kind"] == "HorizontalPodAutoscaler"]
    assert len(hpas) == 2
    for hpa in hpas:
        assert hpa["apiVersion"] == "autoscaling/v2"
        kubernetes_validate.validate(hpa, version, strict=True)


def test_the_hpa_metrics_select_the_model(rendered):
    llama, phi = rendered["llama"]["spec"], rendered["phi"]["spec"]
    assert (llama["minReplicas"], llama["maxReplicas"]) == (1, 4)
    assert (phi["minReplicas"], phi["maxReplicas"]) == (2, 6)
    # inFlight: both gauges (an HPA takes the larger recommendation); held: the held gauge alone.
    for spec, names, served, target in [
        (llama, [IN_FLIGHT, HELD], "llama", DEFAULT_TARGETS["inFlight"]),
        (phi, [HELD], "phi", 1),
    ]:
        assert [m["external"]["metric"]["name"] for m in spec["metrics"]] == names
        for metric in spec["metrics"]:
            assert metric["type"] == "External"
            assert metric["external"]["metric"]["selector"] == {"matchLabels": {"model": served}}
            assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": f"{target:g}"}


def test_the_scaled_objects_match_kedas_schema(rendered):
    scaled = [d for d in rendered.values() if d["kind"] == "ScaledObject"]
    assert len(scaled) == 2
    for obj in scaled:
        jsonschema.Draft7Validator(KEDA_SCALED_OBJECT).validate(obj)
        spec = obj["spec"]
        assert spec["minReplicaCount"] <= spec["maxReplicaCount"]
    for broken in (
        {"minReplicas": 1},  # the HPA's spelling, not KEDA's
        {
            "triggers": [
                {
                    "type": "prometheus",
                    "metadata": {"serverAddress": "http://p", "query": "q", "threshold": 8},
                }
            ]
        },
        {"triggers": [{"type": "prometheus", "metadata": {"serverAddress": "http://p", "threshold": "8"}}]},
    ):
        obj = {**scaled[0], "spec": {**scaled[0]["spec"], **broken}}
        assert not jsonschema.Draft7Validator(KEDA_SCALED_OBJECT).is_valid(obj), broken
    qwen, mistral = rendered["qwen"]["spec"], rendered["mistral"]["spec"]
    assert (qwen["minReplicaCount"], qwen["maxReplicaCount"], qwen["pollingInterval"]) == (2, 3, 10)
    assert (mistral["minReplicaCount"], mistral["maxReplicaCount"], mistral["pollingInterval"]) == (1, 2, 15)


def _selector_terms(query: str) -> list[tuple[str, str]]:
    """(metric, model label) of every series selector in a PromQL query."""
    return re.findall(r'(\w+)\{model="([^"]*)"\}', query)


def test_the_keda_queries_sum_the_gauges_of_the_model(rendered):
    (qwen,) = rendered["qwen"]["spec"]["triggers"]
    assert qwen["type"] == "prometheus"
    metadata = qwen["metadata"]
    assert metadata["serverAddress"] == _entry("qwen")["prometheusAddress"]
    assert metadata["threshold"] == "2.5"
    query = metadata["query"]
    served = "org/Qwen2.5@v2"
    assert _selector_terms(query) == [(IN_FLIGHT, served), (HELD, served)]
    # Summed over the gateway pods, then added; a gauge with no series yet counts 0 instead of emptying the sum.
    assert query == (
        f'(sum({IN_FLIGHT}{{model="{served}"}}) or vector(0)) + (sum({HELD}{{model="{served}"}}) or vector(0))'
    )
    (mistral,) = rendered["mistral"]["spec"]["triggers"]
    assert _selector_terms(mistral["metadata"]["query"]) == [(HELD, "mistral")]
    assert mistral["metadata"]["threshold"] == "1"


def test_two_releases_never_share_an_autoscaler():
    first = render(VALUES, release="a")
    second = render(VALUES, release="b")
    names = {
        (d["metadata"]["namespace"], d["metadata"]["name"])
        for d in by_kind(first, "HorizontalPodAutoscaler") + by_kind(first, "ScaledObject")
    }
    others = {
        (d["metadata"]["namespace"], d["metadata"]["name"])
        for d in by_kind(second, "HorizontalPodAutoscaler") + by_kind(second, "ScaledObject")
    }
    assert len(names) == len(AUTOSCALERS) and not names & others


def test_the_documented_example_renders():
    """The commented entry under `modelAutoscalers: []` in values.yaml, uncommented, is a working entry."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    start = lines.index("modelAutoscalers: []") + 1
    block = []
    for line in lines[start:]:
        if not line.startswith("# "):
            break
        block.append(line[2:])
    example = yaml.safe_load("\n".join(block))
    assert isinstance(example, list) and len(example) == 1
    (scaler,) = by_kind(render({"modelAutoscalers": example}), "ScaledObject")
    assert scaler["spec"]["scaleTargetRef"]["name"] == example[0]["name"]
    jsonschema.Draft7Validator(KEDA_SCALED_OBJECT).validate(scaler)


def _entry_with(**changes) -> dict:
    return {"name": "m", "kind": "hpa", "maxReplicas": 2, **changes}


@pytest.mark.parametrize(
    "entries, message",
    [
        (
            [_entry_with(minReplicas=3)],
            "modelAutoscalers[0] (kvfleet-system/m): minReplicas (3) must be at most",
        ),
        ([_entry_with(kind="vpa")], "modelAutoscalers/0/kind"),  # values.schema.json
        (
            [_entry_with(minReplicas=0)],
            "minReplicas 0: a model scaled to zero by an HPA or KEDA would never come",
        ),
        (
            [_entry_with(kind="keda", minReplicas=0, prometheusAddress="http://p:9090")],
            "scale to zero with the InferenceModel's own spec.autoscaling",
        ),
        ([_entry_with(minReplicas=-1)], "modelAutoscalers/0/minReplicas"),
        ([_entry_with(kind="keda")], "kind keda needs prometheusAddress"),
        ([_entry_with(servedName="org/m")], 'served name "org/m" is not a Kubernetes label value'),
        (
            [_entry_with(), _entry_with(maxReplicas=4)],
            "modelAutoscalers[1] (kvfleet-system/m): a second autoscaler",
        ),
        ([_entry_with(targetPerReplica=0)], "modelAutoscalers/0/targetPerReplica"),
        ([_entry_with(metric="kvCacheUsage")], "modelAutoscalers/0/metric"),
        ([_entry_with(name="Llama_3")], "modelAutoscalers/0/name"),
        ([_entry_with(maxReplicas=None)], "modelAutoscalers/0"),
        ([_entry_with(prometheusUrl="http://p:9090")], "prometheusUrl"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_entries_fail_the_render_naming_the_problem(entries, message):
    entries = [{k: v for k, v in e.items() if v is not None} for e in entries]
    args = [
        "template",
        RELEASE,
        str(CHART),
        "-n",
        NAMESPACE,
        "-f",
        values_file({"modelAutoscalers": entries}),
    ]
    out = helm(*args, check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"kind": "vpa"}, "kind must be hpa or keda, not vpa"),
        ({"metric": "qps"}, "metric must be inFlight or held"),
    ],
)
def test_the_template_checks_what_the_schema_checks_too(changes, message):
    """Without values.schema.json (`--skip-schema-validation`) the template still refuses, clearly."""
    file = values_file({"modelAutoscalers": [_entry_with(**changes)]})
    out = helm("template", RELEASE, str(CHART), "--skip-schema-validation", "-f", file, check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr
