"""What the API server refuses at admission, checked rule by rule: every CEL rule of the CRDs evaluated with
cel-python (cel_eval.py) on the refused examples and on valid specs, each against its Python twin in
validation.py; the OpenAPI patterns (kvCacheMemory, the Tenant's Secret reference) with a JSON-schema
validator; the extraArgs rule against the engine's real argument parser."""

from __future__ import annotations

import contextlib
import copy
import io
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_operator import crd_autoscaling, crds, manifests, openapi_schema
from kvfleet_operator.spec import model_spec_from
from kvfleet_operator.validation import (
    SpecError,
    apply_defaults,
    parse_bytes,
    schema_errors,
    sets_managed_flag,
    validated_tenant,
)
from tests.operator.cel_eval import evaluate, program, rule_failures, rules_of

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
MODEL_SCHEMA = crds.inference_model_schema()
TENANT_SCHEMA = crds.tenant_schema()
EXTRA_ARGS_RULE = MODEL_SCHEMA["properties"]["spec"]["properties"]["engine"]["properties"]["extraArgs"][
    "items"
]["x-kubernetes-validations"][0]["rule"]


def model(name: str = "m", **spec) -> dict:
    return {
        "apiVersion": crds.API_VERSION,
        "kind": crds.MODEL_KIND,
        "metadata": {"name": name, "namespace": "ml", "uid": "u"},
        "spec": {"model": {"uri": "pvc://models/m"}, **spec},
    }


def cel_failures(doc: dict) -> list[str]:
    """The messages of the CEL rules the API server would refuse ``doc`` with (after its defaulting)."""
    schema = MODEL_SCHEMA if doc["kind"] == crds.MODEL_KIND else TENANT_SCHEMA
    return rule_failures(schema, apply_defaults(doc, schema))


def twin_errors(doc: dict) -> str:
    """The operator's own verdict on ``doc`` ('' when it accepts it)."""
    try:
        model_spec_from(doc) if doc["kind"] == crds.MODEL_KIND else validated_tenant(doc)
    except SpecError as e:
        return str(e)
    return ""


# One refused object per CEL rule, keyed by the rule's message.
CEL_VIOLATIONS = {
    "kvCacheMemory and gpuMemoryUtilization are mutually exclusive": model(
        engine={"kvCacheMemory": "1Gi", "gpuMemoryUtilization": 0.5}
    ),
    "tensorParallelSize × pipelineParallelSize must be at most 8 accelerators per pod": model(
        engine={"tensorParallelSize": 4, "pipelineParallelSize": 4}
    ),
    "maxNumBatchedTokens must be at least maxNumSeqs": model(
        engine={"maxNumSeqs": 64, "maxNumBatchedTokens": 32}
    ),
    "gpuMemoryUtilization needs accelerator nvidia; size the cache with kvCacheMemory on cpu": model(
        accelerator="cpu", engine={"gpuMemoryUtilization": 0.5}
    ),
    crds.EXTRA_ARGS_MESSAGE: model(engine={"extraArgs": ["--log-level", "debug", "--port=9000"]}),
    crds.MODEL_NAME_MESSAGE: model(name="Llama_3"),
    # spec.autoscaling (more cases in test_autoscaling_spec.py)
    crd_autoscaling.AUTOSCALING_MIN_MAX_MESSAGE: model(autoscaling={"minReplicas": 3, "maxReplicas": 2}),
    crd_autoscaling.AUTOSCALING_KV_TARGET_MESSAGE: model(
        autoscaling={"maxReplicas": 2, "metric": "kvCacheUsage", "target": 1.5}
    ),
    crd_autoscaling.AUTOSCALING_ZERO_AFTER_SLEEP_MESSAGE: model(
        autoscaling={"minReplicas": 0, "maxReplicas": 2, "scaleToZeroAfterSeconds": 60},
        sleep={"idleSeconds": 600},
    ),
}


def test_every_cel_rule_compiles_and_has_a_refused_example():
    rules = rules_of(MODEL_SCHEMA) + rules_of(TENANT_SCHEMA)
    for _, rule in rules:
        program(rule["rule"])  # compiles
    assert sorted(rule["message"] for _, rule in rules) == sorted(CEL_VIOLATIONS)


@pytest.mark.parametrize("message", list(CEL_VIOLATIONS), ids=lambda m: m[:40])
def test_each_cel_rule_refuses_its_example_and_so_does_its_twin(message):
    doc = CEL_VIOLATIONS[message]
    assert cel_failures(doc) == [message]
    assert message in twin_errors(doc)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_the_examples_pass_every_rule(path):
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc["apiVersion"] == crds.API_VERSION:
            doc = copy.deepcopy(doc)
            doc["metadata"].setdefault("namespace", "default")
            assert cel_failures(doc) == [] and twin_errors(doc) == ""


@pytest.mark.parametrize(
    "name, ok",
    [
        *[("a", True), ("llama-3", True), ("m" * 46, True)],
        *[("m" * 47, False), ("Llama", False), ("3b", False), ("a-", False), ("a_b", False), ("a.b", False)],
    ],
)
def test_model_names_are_checked_at_admission(name, ok):
    doc = model(name=name)
    assert (cel_failures(doc) == []) == ok
    assert (twin_errors(doc) == "") == ok


# ---- kvCacheMemory: an OpenAPI pattern and minimum, the same set as validation.parse_bytes -----------------

REFUSED_BYTES = ["-1Gi", "0", 0, -1, "0.5", 0.5, "+1Gi", "500m", "0Gi", "0.0Gi", "1e-3", "1.5", "Gi", "1 Gi"]
ACCEPTED_BYTES = {
    "1": 1,
    1: 1,
    "8Gi": 8 * 2**30,
    "1.5Gi": 3 * 2**29,
    "0.5Gi": 2**29,
    ".5Gi": 2**29,
    "1e9": 10**9,
    "500M": 5 * 10**8,
    "1k": 1000,
    "1.3Ki": 1332,  # 1331.2 bytes: rounds up, as Kubernetes rounds quantities
    "0001Mi": 2**20,
}


def kv_cache_errors(value) -> list[str]:
    return schema_errors(apply_defaults(model(engine={"kvCacheMemory": value}), MODEL_SCHEMA), MODEL_SCHEMA)


@pytest.mark.parametrize("value", REFUSED_BYTES, ids=repr)
def test_kv_cache_memory_must_be_a_positive_byte_count(value):
    assert kv_cache_errors(value), value
    assert "kvCacheMemory" in twin_errors(model(engine={"kvCacheMemory": value}))


@pytest.mark.parametrize("value, expected", list(ACCEPTED_BYTES.items()), ids=repr)
def test_kv_cache_memory_accepted_forms(value, expected):
    assert kv_cache_errors(value) == []
    assert (
        model_spec_from(model(engine={"kvCacheMemory": value})).engine.settings["kv_cache_memory_bytes"]
        == expected
    )


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789.+-eEkKMGTPim", max_size=7))
def test_the_pattern_and_parse_bytes_agree(text):
    """What the API server admits (RE2: the whole string) is exactly what the operator can read."""
    admitted = re.fullmatch(openapi_schema.BYTES_PATTERN, text) is not None
    try:
        value = parse_bytes(text)
        parsed = True
    except SpecError:
        parsed = False
    assert admitted == parsed, text
    if parsed:
        assert value >= 1


# ---- extraArgs: no flag the operator owns, nor an abbreviation of one ------------------------------------

REFUSED_ARGS = [
    "--port", "--port=9000", "--tensor-parallel-size=4", "--tensor-parallel", "--tensor", "-tp", "-tp=4",
    "-tp4", "-t", "-pp", "--served-model", "--dtype=float16", "--no-enable-prefix", "--redis-url=redis://x",
    "--admin-token", "--scheduling-policy=fcfs", "--enforce-eager", "--max-model-len=4096", "--kv", "--seed",
]  # fmt: skip
ACCEPTED_ARGS = [
    "torch",
    "debug",
    "--attention-backend",
    "--log-level=debug",
    "--loop",
    "--num-kv-blocks=100",
]


@pytest.mark.parametrize("arg", REFUSED_ARGS)
def test_extra_args_may_not_set_operator_flags(arg):
    assert not evaluate(EXTRA_ARGS_RULE, self=arg)
    assert sets_managed_flag(arg)
    doc = model(engine={"extraArgs": ["--log-level", "info", arg]})
    assert cel_failures(doc) == [crds.EXTRA_ARGS_MESSAGE]
    assert f"extraArgs[2]: {arg!r}: {crds.EXTRA_ARGS_MESSAGE}" in twin_errors(doc)


@pytest.mark.parametrize("arg", ACCEPTED_ARGS)
def test_extra_args_may_set_other_engine_flags(arg):
    assert evaluate(EXTRA_ARGS_RULE, self=arg) and not sets_managed_flag(arg)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="-=tpmodelrsxy4", max_size=10))
def test_the_extra_args_rule_and_its_twin_agree(arg):
    assert evaluate(EXTRA_ARGS_RULE, self=arg) == (not sets_managed_flag(arg))


def _full_model(**memory):
    engine = {"maxModelLen": 4096, "maxNumSeqs": 8, "maxNumBatchedTokens": 64, "seed": 1}
    engine |= {"enablePrefixCaching": False, "enforceEager": True, **(memory or {"kvCacheMemory": "1Gi"})}
    return model_spec_from(model(engine=engine))


def _flags_set_by_operator() -> set[str]:
    """Every flag `manifests.engine_args` writes (with every optional field set, either cache sizing), and
    the ones passed in the environment instead (a command-line argument would win over it)."""
    flags = {"--redis-url", "--admin-token", "--replica-name", "--base-url"}
    for m in (_full_model(), _full_model(gpuMemoryUtilization=0.9)):
        flags |= {a for a in manifests.engine_args(m) if a.startswith("-")}
    return flags


def test_the_rule_covers_every_flag_the_operator_sets_and_nothing_else_of_the_engine():
    server_cli = pytest.importorskip("kvfleet_engine.server.serve_cli")
    parser = server_cli.build_parser()
    set_by_operator = _flags_set_by_operator()
    assert set_by_operator <= set(crds.MANAGED_ENGINE_FLAGS)
    for action in parser._actions:
        owned = set(action.option_strings) & set_by_operator
        for option in action.option_strings:
            if owned:  # every spelling of an owned flag (-tp for --tensor-parallel-size) is owned
                assert option in crds.MANAGED_ENGINE_FLAGS, option
            else:
                assert option not in crds.MANAGED_ENGINE_FLAGS, option
                for arg in (option, f"{option}=1"):
                    assert evaluate(EXTRA_ARGS_RULE, self=arg), (
                        f"{arg} is an engine flag the operator leaves alone"
                    )


def test_no_spelling_argparse_accepts_reaches_an_owned_flag():
    """Every prefix of every engine option, alone, with `=value` or with a value joined: whenever the engine's
    parser, given it after the operator's arguments, changes what an owned flag set, the rule refuses it."""
    server_cli = pytest.importorskip("kvfleet_engine.server.serve_cli")
    parser = server_cli.build_parser()
    base_args = manifests.engine_args(_full_model())
    owned = {a.dest for a in parser._actions if set(a.option_strings) & set(crds.MANAGED_ENGINE_FLAGS)}
    base = vars(parser.parse_args(base_args))
    values = {"3", "0.5", "cpu", "float16", "fcfs", "redis://x"}
    values |= {str(c) for a in parser._actions for c in (a.choices or [])}
    candidates = set()
    for option in {o for a in parser._actions for o in a.option_strings}:
        dashes = 2 if option.startswith("--") else 1
        for end in range(dashes + 1, len(option) + 1):
            candidates |= {option[:end], option[:end] + "=3", option[:end] + "3"}
    reached: list[str] = []
    for candidate in sorted(candidates):
        for extra in [[], *([v] for v in sorted(values))]:
            with contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):
                parsed = vars(parser.parse_known_args([*base_args, candidate, *extra])[0])
                if any(parsed[dest] != base[dest] for dest in owned):
                    reached.append(candidate)
                    break
    assert "--tensor-parallel" in reached and "-t" in reached and "--port=3" in reached  # the sweep works
    allowed = [c for c in reached if evaluate(EXTRA_ARGS_RULE, self=c)]
    assert allowed == [], f"these reach an owned flag but pass the rule: {allowed}"


# ---- Tenant: the key Secret's reference -------------------------------------------------------------------


def tenant(**ref) -> dict:
    return {
        "apiVersion": crds.API_VERSION,
        "kind": crds.TENANT_KIND,
        "metadata": {"name": "t"},
        "spec": {"apiKeySecretRef": {"name": "key", **ref}},
    }


@pytest.mark.parametrize(
    "ref, field",
    [
        ({"namespace": "Team_A"}, "namespace"),
        ({"namespace": "-ns"}, "namespace"),
        ({"namespace": "a" * 64}, "namespace"),
        ({"namespace": ""}, "namespace"),
        ({"namespace": "team.a"}, "namespace"),
        ({"name": "Key"}, "name"),
        ({"name": "a/b"}, "name"),
        ({"key": "api key"}, "key"),
    ],
)
def test_tenant_secret_references_must_be_valid_names(ref, field):
    doc = tenant(**ref)
    errors = schema_errors(apply_defaults(doc, TENANT_SCHEMA), TENANT_SCHEMA)
    assert errors and all(f".spec.apiKeySecretRef.{field}" in e for e in errors), errors
    assert f"apiKeySecretRef.{field}" in twin_errors(doc)


def test_valid_tenant_secret_references():
    for ref in ({}, {"namespace": "kvfleet-system", "name": "team-a.key", "key": "api_key-1.txt"}):
        doc = tenant(**ref)
        assert (
            schema_errors(apply_defaults(doc, TENANT_SCHEMA), TENANT_SCHEMA) == [] and twin_errors(doc) == ""
        )
