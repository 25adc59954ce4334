"""Trace export settings: the operator's ``--otlp-endpoint`` reaches every engine pod, and the chart's
observability option (collector, Jaeger, dashboard) is wired consistently.

The engine side is checked for real: the env the operator renders, resolved as the kubelet would, makes
``kvfleet_common.server_kit.tracing`` in a fresh process send its spans over OTLP/HTTP to a local receiver, with resource
attributes naming the pod. The chart's templates cannot be rendered here (no ``helm``); its static parts are
checked: values against the schema, the collector configuration, and the names the templates share.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvfleet_cli.main import main as kvfleet
from kvfleet_operator import manifests
from kvfleet_operator.operator_cli import _config_args
from kvfleet_operator.spec import OperatorConfig, model_spec_from

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvfleet"
ENDPOINT = "http://kvfleet-otel-collector.kvfleet-system.svc:4318"


def model_obj(env: list[dict] | None = None, uri: str = "pvc://models/llama") -> dict:
    engine = {"env": env} if env else {}
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": "llama", "namespace": "ml", "uid": "uid-1", "generation": 1},
        "spec": {"model": {"uri": uri}, "accelerator": "cpu", "engine": engine},
    }


def pod_spec(obj: dict, config: OperatorConfig) -> dict:
    return manifests.deployment(model_spec_from(obj), config)["spec"]["template"]["spec"]


def env_of(container: dict) -> dict[str, dict]:
    names = [e["name"] for e in container["env"]]
    assert len(names) == len(set(names)), f"duplicate env names: {names}"
    return {e["name"]: e for e in container["env"]}


def test_without_an_endpoint_engines_get_no_exporter_settings():
    spec = pod_spec(model_obj(uri="hf://org/model"), OperatorConfig())
    for container in spec["containers"] + spec["initContainers"]:
        assert not [name for name in env_of(container) if name.startswith("OTEL_")]


def test_the_endpoint_and_the_pod_identity_reach_every_engine_container():
    config = OperatorConfig(otlp_endpoint=ENDPOINT)
    spec = pod_spec(model_obj(uri="hf://org/model"), config)
    for container in spec["containers"] + spec["initContainers"]:
        env = env_of(container)
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == ENDPOINT
        attributes = dict(kv.split("=", 1) for kv in env["OTEL_RESOURCE_ATTRIBUTES"]["value"].split(","))
        assert attributes == {
            "k8s.namespace.name": "$(KVFLEET_NAMESPACE)",
            "k8s.pod.name": "$(KVFLEET_REPLICA_NAME)",
            "kvfleet.model": "llama",
        }
        # The kubelet expands $(VAR) only from variables defined earlier in the list.
        names = [e["name"] for e in container["env"]]
        for i, e in enumerate(container["env"]):
            for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
                assert ref in names[:i], (e["name"], ref)


def test_a_models_own_otel_settings_win_and_names_stay_unique():
    own = [
        {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://team-collector:4318"},
        {"name": "OTEL_SERVICE_NAME", "value": "llama-engine"},
    ]
    env = env_of(pod_spec(model_obj(env=own), OperatorConfig(otlp_endpoint=ENDPOINT))["containers"][0])
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://team-collector:4318"
    assert env["OTEL_SERVICE_NAME"]["value"] == "llama-engine"
    assert "OTEL_RESOURCE_ATTRIBUTES" in env  # what the model does not set, the operator still adds


def test_a_changed_endpoint_rolls_the_pods_and_the_manifests_stay_valid():
    model = model_spec_from(model_obj())
    before = manifests.deployment(model, OperatorConfig())
    after = manifests.deployment(model, OperatorConfig(otlp_endpoint=ENDPOINT))
    assert before["spec"]["template"] != after["spec"]["template"]
    for version in ("1.30", "1.33"):
        kubernetes_validate.validate(after, version, strict=True)


def _rendered_engine_env(capsys, argv: list[str]) -> dict[str, dict]:
    assert kvfleet(["operator", "render", "-f", str(ROOT / "examples" / "demo-cpu.yaml"), *argv]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    return env_of(deployment["spec"]["template"]["spec"]["containers"][0])


def test_the_command_line_takes_the_endpoint_as_a_flag_or_from_the_environment(capsys, monkeypatch):
    monkeypatch.delenv("KVFLEET_OTLP_ENDPOINT", raising=False)
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in _rendered_engine_env(capsys, [])
    env = _rendered_engine_env(capsys, ["--otlp-endpoint", ENDPOINT])
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == ENDPOINT
    monkeypatch.setenv("KVFLEET_OTLP_ENDPOINT", "http://from-env:4318")
    env = _rendered_engine_env(capsys, [])
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://from-env:4318"


# ---- the rendered env drives the real tracing set-up -------------------------------------------------


class _Receiver(BaseHTTPRequestHandler):
    requests: list[ExportTraceServiceRequest]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path == "/v1/traces":
            msg = ExportTraceServiceRequest()
            msg.ParseFromString(body)
            self.server.received.append(msg)  # type: ignore[attr-defined]
        self.send_response(200 if self.path == "/v1/traces" else 404)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def otlp_receiver() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.received = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def kubelet_env(container: dict, fields: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: literal values with $(VAR) expanded from earlier
    entries, and downward-API fields; Secret references are left out (this test reads none of them)."""
    out: dict[str, str] = {}
    for e in container["env"]:
        if "value" in e:
            out[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out.get(m[1], m[0]), e["value"])
        elif "fieldRef" in e.get("valueFrom", {}):
            out[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return out


_EMIT_SPAN = """
from kvfleet_common.server_kit.tracing import setup_tracing, shutdown_tracing
from opentelemetry import trace
setup_tracing("kvfleet-engine")
with trace.get_tracer("kvfleet.engine").start_as_current_span("engine chat"):
    pass
shutdown_tracing()
"""


def test_an_engine_pod_exports_its_spans_to_the_configured_endpoint(otlp_receiver):
    endpoint = f"http://127.0.0.1:{otlp_receiver.server_address[1]}"
    container = pod_spec(model_obj(), OperatorConfig(otlp_endpoint=endpoint))["containers"][0]
    fields = {"metadata.name": "llama-6d9f-abcde", "metadata.namespace": "ml", "status.podIP": "127.0.0.1"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | kubelet_env(container, fields)
    subprocess.run([sys.executable, "-c", _EMIT_SPAN], env=env, check=True, timeout=60)

    (request,) = otlp_receiver.received
    (resource_spans,) = request.resource_spans
    attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert attributes["service.name"] == "kvfleet-engine"
    assert attributes["k8s.pod.name"] == "llama-6d9f-abcde" and attributes["k8s.namespace.name"] == "ml"
    assert attributes["kvfleet.model"] == "llama"
    assert [s.name for ss in resource_spans.scope_spans for s in ss.spans] == ["engine chat"]


# ---- the chart's observability option ------------------------------------------------------------------


def chart_values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def schema_errors(doc: dict) -> list[str]:
    schema = json.loads((CHART / "values.schema.json").read_text())
    return [
        "/".join(map(str, e.absolute_path)) + ": " + e.message
        for e in jsonschema.Draft7Validator(schema).iter_errors(doc)
    ]


def with_observability(**changes) -> dict:
    doc = copy.deepcopy(chart_values())
    obs = doc["observability"]
    obs["enabled"] = True
    for path, value in changes.items():
        node = obs
        *parents, leaf = path.split("__")
        for key in parents:
            node = node[key]
        node[leaf] = value
    return doc


def test_observability_is_off_by_default_and_its_values_validate():
    assert chart_values()["observability"]["enabled"] is False
    assert schema_errors(with_observability()) == []
    assert (
        schema_errors(with_observability(jaeger__enabled=False, otelCollector__tracesEndpoint="tempo:4317"))
        == []
    )
    assert schema_errors(with_observability(otlpEndpoint="https://otel.example:4318")) == []


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"jaeger__enabled": False}, "should be non-empty"),  # the collector would have nowhere to send spans
        ({"otlpEndpoint": "otel.example:4318"}, "does not match"),  # OTLP/HTTP needs a URL
        ({"otelCollector__tracesEndpoint": "http://tempo:4317"}, "does not match"),  # gRPC takes host:port
        ({"grafana__dashboards__namespace": "Monitoring"}, "does not match"),
        ({"jaeger__maxTraces": 0}, "less than the minimum"),
        ({"otelCollector__extra": 1}, "Additional properties are not allowed"),
    ],
)
def test_observability_values_are_checked(changes, message):
    errors = schema_errors(with_observability(**changes))
    assert any(message in e for e in errors), errors


def test_the_collector_configuration_is_a_complete_pipeline():
    config = yaml.safe_load((CHART / "files" / "otel-collector.yaml").read_text())
    service = config["service"]
    assert set(service["extensions"]) <= set(config["extensions"])
    for pipeline in service["pipelines"].values():
        assert set(pipeline["receivers"]) <= set(config["receivers"])
        assert set(pipeline["processors"]) <= set(config["processors"])
        assert set(pipeline["exporters"]) <= set(config["exporters"])
    assert "traces" in service["pipelines"]
    # Receivers listen on the pod's address (the collector's default is localhost only).
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317" and protocols["http"]["endpoint"] == "0.0.0.0:4318"
    # memory_limiter must run first: it refuses data before the batch processor buffers it.
    assert service["pipelines"]["traces"]["processors"][0] == "memory_limiter"
    # The one variable part comes from the env the Deployment sets.
    (exporter,) = [config["exporters"][name] for name in service["pipelines"]["traces"]["exporters"]]
    variable = re.fullmatch(r"\$\{env:(\w+)\}", exporter["endpoint"])
    assert variable is not None
    template = (CHART / "templates" / "otel-collector.yaml").read_text()
    assert f"- name: {variable[1]}" in template
    assert '.Files.Get "files/otel-collector.yaml"' in template


def test_every_component_is_pointed_at_the_collector_service():
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    collector = (CHART / "templates" / "otel-collector.yaml").read_text()
    jaeger = (CHART / "templates" / "jaeger.yaml").read_text()
    # The endpoint the helper builds is the collector Service's OTLP/HTTP port, and the collector's default
    # destination is Jaeger's OTLP/gRPC port.
    assert 'printf "http://%s-otel-collector.%s.svc:4318"' in helpers
    assert "name: {{ $fullname }}-otel-collector\n" in collector and "port: 4318" in collector
    assert 'printf "%s-jaeger.%s.svc:4317"' in collector
    assert "name: {{ $fullname }}-jaeger\n" in jaeger and "port: 4317" in jaeger
    gateway = (CHART / "templates" / "gateway.yaml").read_text()
    operator = (CHART / "templates" / "operator-deployment.yaml").read_text()
    assert 'include "kvfleet.otelEnv" (dict "root" . "service" "kvfleet-gateway")' in gateway
    assert 'include "kvfleet.otelEnv" (dict "root" . "service" "kvfleet-operator")' in operator
    # Engines: through the operator's flag, which the operator's parser knows.
    assert "- --otlp-endpoint={{ . }}" in operator
    parser = argparse.ArgumentParser()
    _config_args(parser)
    assert parser.parse_args([f"--otlp-endpoint={ENDPOINT}"]).otlp_endpoint == ENDPOINT
