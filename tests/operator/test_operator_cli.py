"""`kvfleet operator crds` and `kvfleet operator render`: what the operator would install and create."""

from __future__ import annotations

from pathlib import Path

import yaml

from kvfleet_cli.main import main as kvfleet
from kvfleet_operator.operator_cli import crd_files

ROOT = Path(__file__).resolve().parents[2]


def test_crds_subcommand_writes_the_checked_in_files(tmp_path):
    assert kvfleet(["operator", "crds", "--out", str(tmp_path)]) == 0
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == crd_files()


def test_render_prints_every_owned_object(capsys):
    code = kvfleet(
        ["operator", "render", "-f", str(ROOT / "examples" / "llama-8b-gpu.yaml"), "--engine-image", "img:1"]
    )
    assert code == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == [
        "Secret",
        "ConfigMap",
        "Service",
        "PodDisruptionBudget",
        "Deployment",
    ]
    container = docs[-1]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "img:1" and container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_render_reports_a_bad_model(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: kvfleet.io/v1alpha1\nkind: InferenceModel\nmetadata: {name: bad}\n"
        "spec: {model: {uri: 'ftp://x'}, replicas: -2}\n"
    )
    assert kvfleet(["operator", "render", "-f", str(bad)]) == 1
    err = capsys.readouterr().err
    assert (
        "bad" in err and ".spec.replicas: -2 is less than the minimum of 0" in err and "spec.model.uri" in err
    )
