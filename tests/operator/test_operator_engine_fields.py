"""The InferenceModel's engine settings against the engine's own (``EngineArgs``), through the one table of
`kvfleet_operator.engine_fields`: both ways complete, same defaults, same command line. A new engine setting
that misses the CRD, or a CRD field the engine does not know, fails here."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from kvfleet_engine.engine_args import EngineArgs
from kvfleet_operator import crds, engine_fields, manifests
from kvfleet_operator.spec import model_spec_from

ENGINE_SCHEMA = crds.inference_model_schema()["properties"]["spec"]["properties"]["engine"]
ENGINE_ARGS_FIELDS = [f.name for f in dataclasses.fields(EngineArgs)]

# Every engine setting set, with a kvCacheMemory (the cache sized in bytes) and without (by
# gpuMemoryUtilization): the two are mutually exclusive.
FULL_ENGINE = {
    "tensorParallelSize": 2,
    "pipelineParallelSize": 2,
    "dtype": "bfloat16",
    "maxModelLen": 4096,
    "maxNumSeqs": 32,
    "maxNumBatchedTokens": 4096,
    "blockSize": 32,
    "gpuMemoryUtilization": 0.8,
    "enablePrefixCaching": False,
    "enforceEager": True,
    "seed": 3,
}
FULL_ENGINE_KV = {
    **{k: v for k, v in FULL_ENGINE.items() if k != "gpuMemoryUtilization"},
    "kvCacheMemory": "1Gi",
}


def model_doc(engine: dict, accelerator: str = "nvidia") -> dict:
    return {
        "apiVersion": crds.API_VERSION,
        "kind": crds.MODEL_KIND,
        "metadata": {"name": "m", "namespace": "ml", "uid": "u"},
        "spec": {"model": {"uri": "pvc://models/m"}, "accelerator": accelerator, "engine": engine},
    }


def engine_parser() -> argparse.ArgumentParser:
    """Just the flags EngineArgs generates (`parse_known_args` leaves the server's aside)."""
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    return p


def test_every_crd_engine_property_is_an_engine_setting_or_says_why_not():
    properties = set(ENGINE_SCHEMA["properties"])
    table = set(engine_fields.BY_CRD)
    assert properties == table | set(engine_fields.NOT_ENGINE_SETTINGS)
    assert not table & set(engine_fields.NOT_ENGINE_SETTINGS)
    assert len(table) == len(engine_fields.ENGINE_FIELDS)  # no CRD name twice


def test_every_engine_setting_is_in_the_crd_or_says_why_not():
    """A new EngineArgs field must be mapped to a spec.engine property or listed with the reason it is not."""
    mapped = set(engine_fields.BY_ARG)
    assert len(mapped) == len(engine_fields.ENGINE_FIELDS)  # no EngineArgs field twice
    accounted = [mapped, set(engine_fields.SET_BY_OPERATOR), set(engine_fields.NOT_IN_CRD)]
    for i, group in enumerate(accounted):
        for other in accounted[i + 1 :]:
            assert not group & other
    assert set().union(*accounted) == set(ENGINE_ARGS_FIELDS)
    assert all(reason for reason in {**engine_fields.SET_BY_OPERATOR, **engine_fields.NOT_IN_CRD}.values())


@pytest.mark.parametrize("field", engine_fields.ENGINE_FIELDS, ids=lambda f: f.crd)
def test_crd_defaults_are_the_engines(field):
    schema = ENGINE_SCHEMA["properties"][field.crd]
    if "default" in schema:
        assert schema["default"] == EngineArgs.default_of(field.arg)


@pytest.mark.parametrize("field", engine_fields.ENGINE_FIELDS, ids=lambda f: f.crd)
def test_crd_enums_are_values_the_engine_accepts(field):
    schema = ENGINE_SCHEMA["properties"][field.crd]
    choices = next(f for f in dataclasses.fields(EngineArgs) if f.name == field.arg).metadata["choices"]
    if "enum" in schema and choices:
        assert set(schema["enum"]) <= set(choices)


@pytest.mark.parametrize("engine", [FULL_ENGINE, FULL_ENGINE_KV], ids=["gpu-share", "kv-memory"])
def test_rendered_flags_of_a_full_spec_parse_back_to_the_same_settings(engine):
    assert set(FULL_ENGINE) | set(FULL_ENGINE_KV) == set(engine_fields.BY_CRD)  # the test sets every field
    model = model_spec_from(model_doc(engine))
    assert set(model.engine.settings) == {engine_fields.BY_CRD[name].arg for name in engine}
    namespace, _server_flags = engine_parser().parse_known_args(manifests.engine_args(model))
    args = EngineArgs.from_cli_args(namespace)
    for name, value in engine.items():
        field = engine_fields.BY_CRD[name]
        expected = 2**30 if field.bytes_quantity else value
        assert getattr(args, field.arg) == expected, name
    assert (args.model, args.device, args.scheduling_policy) == ("/models/m", "cuda", "priority")
    set_by_spec = {engine_fields.BY_CRD[name].arg for name in engine}
    for name in (set(engine_fields.BY_ARG) - set_by_spec) | set(engine_fields.NOT_IN_CRD):
        assert getattr(args, name) == EngineArgs.default_of(name), name


def test_an_empty_spec_renders_only_the_crd_defaults():
    model = model_spec_from(model_doc({}, accelerator="cpu"))
    args = EngineArgs.from_cli_args(engine_parser().parse_known_args(manifests.engine_args(model))[0])
    assert args == EngineArgs(model="/models/m", device="cpu", scheduling_policy="priority")


def test_every_flag_of_a_crd_setting_is_one_extra_args_may_not_set():
    owned = set(engine_fields.BY_ARG) | set(engine_fields.SET_BY_OPERATOR)
    for name in owned:
        flags = EngineArgs.option_strings(name)
        assert flags and set(flags) <= set(crds.MANAGED_ENGINE_FLAGS), name


def test_the_operator_reads_engine_settings_without_torch():
    code = (
        "import sys, kvfleet_operator.manifests, kvfleet_operator.crds, kvfleet_operator.validation\n"
        "assert 'kvfleet_engine.engine_args' in sys.modules\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
