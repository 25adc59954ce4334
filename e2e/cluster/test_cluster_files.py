"""The cluster end-to-end set-up files agree with the chart, the examples and the command lines they use.

These run everywhere (no cluster): a typo in ``values-kind.yaml`` or ``demo-model.yaml`` would otherwise only
show up on a user's kind cluster, after a 20-minute image build.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvfleet_engine.demo_model.demo_model_cli import make_parser
from kvfleet_operator.spec import parse_model_uri

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CHART = ROOT / "charts" / "kvfleet"


def merged(base: dict, override: dict) -> dict:
    """Helm's merge of a values file over the chart's defaults (maps merge, everything else replaces)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def kind_values() -> dict:
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    return merged(defaults, yaml.safe_load((HERE / "values-kind.yaml").read_text()))


def demo_model_docs() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all((HERE / "demo-model.yaml").read_text()) if d}


def test_the_kind_values_pass_the_charts_schema_and_enable_observability():
    values = kind_values()
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(values)] == []
    assert values["observability"]["enabled"] is True
    assert (
        values["observability"]["otelCollector"]["enabled"] and values["observability"]["jaeger"]["enabled"]
    )


@pytest.mark.parametrize("kind", ["PersistentVolumeClaim", "Job"])
def test_the_demo_model_objects_are_valid_kubernetes(kind):
    for version in ("1.30", "1.33"):
        kubernetes_validate.validate(demo_model_docs()[kind], version, strict=True)


def test_the_job_writes_the_model_where_the_example_reads_it():
    example = yaml.safe_load((ROOT / "examples" / "demo-cpu.yaml").read_text())
    source = parse_model_uri(example["spec"]["model"]["uri"])
    docs = demo_model_docs()
    pod = docs["Job"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (volume,) = pod["volumes"]
    (mount,) = container["volumeMounts"]
    assert docs["PersistentVolumeClaim"]["metadata"]["name"] == volume["persistentVolumeClaim"]["claimName"]
    assert volume["persistentVolumeClaim"]["claimName"] == source.claim
    assert container["command"][:2] == ["kvfleet", "demo-model"]
    args = make_parser().parse_args(container["command"][2:])  # the real command line
    assert args.out == f"{mount['mountPath']}/{source.path}"
    assert args.preset == "small"
    # The engine pods run as uid 1000 and mount the claim read-only: the Job writes as that uid.
    assert pod["securityContext"]["runAsUser"] == 1000


def test_images_named_in_the_guide_are_the_ones_the_chart_pulls():
    values = kind_values()
    prefix = f"{values['image']['registry']}/"
    suffix = f":{values['image']['tag']}"
    chart_images = {values["operator"]["image"], values["gateway"]["image"]}
    operator_template = (CHART / "templates" / "operator-deployment.yaml").read_text()
    chart_images |= set(re.findall(r'"name" "(kvfleet-engine[\w-]*)"', operator_template))
    assert chart_images == {"kvfleet-operator", "kvfleet-gateway", "kvfleet-engine", "kvfleet-engine-cuda"}
    readme = (HERE / "README.md").read_text()
    built = set(re.findall(r"-t (\S+) ", readme))
    assert built == {prefix + name + suffix for name in chart_images - {"kvfleet-engine-cuda"}}
    for dockerfile in re.findall(r"docker build -f (\S+)", readme):
        assert (ROOT / dockerfile).is_file(), dockerfile
    job_image = demo_model_docs()["Job"]["spec"]["template"]["spec"]["containers"][0]["image"]
    assert job_image == prefix + "kvfleet-engine" + suffix
