"""What the API server does to a custom object before the operator sees it — defaulting, OpenAPI schema
validation, CEL rules — done again in Python.

Why twice: a real cluster rejects bad objects at admission, but the operator must not trust that (the CRD may
be older than the operator, CEL may be disabled, the test emulator validates nothing). Every CEL rule in
`crds.py` has a twin here; a test feeds each rule a violating object.
"""

from __future__ import annotations

import copy
import fnmatch
import re
from decimal import ROUND_CEILING, Decimal
from typing import Any

import jsonschema

from kvfleet_operator import crd_autoscaling, crds, openapi_schema
from kvfleet_operator.engine_fields import crd_name


class SpecError(ValueError):
    """A custom object that cannot be reconciled; the message is meant for `kubectl describe`."""


def apply_defaults(obj: Any, schema: dict) -> Any:
    """Return a copy of ``obj`` with the schema's ``default`` values filled in, as the API server does
    (a default applies only where the parent object exists; defaults of a defaulted object apply too)."""
    obj = copy.deepcopy(obj)
    _default_in_place(obj, schema)
    return obj


def _default_in_place(obj: Any, schema: dict) -> None:
    if isinstance(obj, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
            if name in obj:
                _default_in_place(obj[name], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name, value in obj.items():
                if name not in schema.get("properties", {}):
                    _default_in_place(value, extra)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            _default_in_place(item, schema["items"])


def schema_errors(obj: Any, schema: dict) -> list[str]:
    """OpenAPI v3.0 validation errors of ``obj``, as ``path: message`` strings (empty when valid).

    OpenAPI 3.0 schemas are JSON Schema draft 4 in the parts Kubernetes uses (boolean
    ``exclusiveMinimum``); the ``x-kubernetes-*`` extensions are ignored here."""
    validator = jsonschema.Draft4Validator(schema)
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    return [f"{_json_path(e.absolute_path)}: {_short_message(e)}" for e in errors]


def _json_path(path: Any) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out or "."


def _short_message(error: jsonschema.ValidationError) -> str:
    if error.schema.get("x-kubernetes-int-or-string"):
        return f"{error.instance!r} must be an integer or a quantity string such as 8Gi"
    if error.validator == "pattern":
        return f"{error.instance!r} is not of the expected form"
    return error.message


_BINARY_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL_SUFFIXES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_BYTES = re.compile(openapi_schema.BYTES_PATTERN)
_SPLIT = re.compile(r"^([0-9.]+)([eE][0-9]+|[KMGTPE]i|[kMGTPE])?$")


def parse_bytes(quantity: int | str) -> int:
    """A positive number of bytes given as an integer or a Kubernetes quantity (``8Gi``, ``1.5G``, ``1e9``);
    exactly what the CRD's ``kvCacheMemory`` schema admits. A fraction of a byte rounds up, as Kubernetes
    rounds quantities (``1.3Ki`` is 1332 bytes)."""
    if isinstance(quantity, bool) or not isinstance(quantity, int | str):
        raise SpecError(f"{quantity!r} is not a quantity")
    if isinstance(quantity, int):
        if quantity < 1:
            raise SpecError(f"{quantity!r} must be a positive number of bytes")
        return quantity
    if not _BYTES.fullmatch(quantity):
        raise SpecError(
            f"{quantity!r} must be a positive number of bytes (e.g. 1073741824) or a quantity with a unit "
            "(e.g. 8Gi, 500M); no sign, no fraction without a unit"
        )
    match = _SPLIT.match(quantity)
    assert match is not None  # every string BYTES_PATTERN admits splits so
    number, suffix = match.groups()
    value = Decimal(number)
    suffix = suffix or ""
    if suffix in _BINARY_SUFFIXES:
        value *= _BINARY_SUFFIXES[suffix]
    elif suffix in _DECIMAL_SUFFIXES:  # "E" alone is exa
        value *= _DECIMAL_SUFFIXES[suffix]
    else:  # an exponent: e9, E3
        value *= Decimal(10) ** int(suffix[1:])
    return int(value.to_integral_value(rounding=ROUND_CEILING))


MANAGED_ENGINE_FLAGS = frozenset(crds.MANAGED_ENGINE_FLAGS)


def sets_managed_flag(arg: str) -> bool:
    """Whether ``arg`` on the engine's command line would set a flag the operator owns: the twin of the
    CRD's extraArgs rule (`crds.managed_flag_regex`), written out. argparse reads ``--flag=value`` and
    expands any unique prefix of a long flag, and a short flag (``-tp``) may carry its value joined."""
    flag = arg.split("=", 1)[0]
    if flag.startswith("--"):
        name = flag[2:]
        return bool(name) and any(f.startswith("--" + name) for f in MANAGED_ENGINE_FLAGS)
    if flag.startswith("-") and len(flag) > 1:
        shorts = [f for f in MANAGED_ENGINE_FLAGS if not f.startswith("--")]
        return any(f.startswith(flag) for f in shorts) or any(
            arg.startswith(f) and len(arg) > len(f) for f in shorts
        )
    return False


def inference_model_rule_errors(spec: dict) -> list[str]:
    """The CEL rules of InferenceModel plus checks no schema can express, on a defaulted spec."""
    errors: list[str] = []
    engine = spec.get("engine", {})
    kv_memory, gpu_share = crd_name("kv_cache_memory_bytes"), crd_name("gpu_memory_utilization")
    tp_name, pp_name = crd_name("tensor_parallel_size"), crd_name("pipeline_parallel_size")
    seqs_name, tokens_name = crd_name("max_num_seqs"), crd_name("max_num_batched_tokens")
    if kv_memory in engine and gpu_share in engine:
        errors.append(f"spec.engine: {kv_memory} and {gpu_share} are mutually exclusive")
    # The CRD defaults both sizes, so a defaulted spec has them.
    tp, pp = engine.get(tp_name), engine.get(pp_name)
    if isinstance(tp, int) and isinstance(pp, int) and tp * pp > crds.MAX_ACCELERATORS_PER_POD:
        errors.append(
            f"spec.engine: {tp_name} × {pp_name} must be at most "
            f"{crds.MAX_ACCELERATORS_PER_POD} accelerators per pod (got {tp} × {pp} = {tp * pp})"
        )
    seqs, tokens = engine.get(seqs_name), engine.get(tokens_name)
    if isinstance(seqs, int) and isinstance(tokens, int) and tokens < seqs:
        errors.append(f"spec.engine: {tokens_name} must be at least {seqs_name} (got {tokens} < {seqs})")
    if spec.get("accelerator") == "cpu" and gpu_share in engine:
        errors.append(f"spec: {gpu_share} needs accelerator nvidia; size the cache with {kv_memory} on cpu")
    if kv_memory in engine:
        try:
            parse_bytes(engine[kv_memory])
        except SpecError as e:
            errors.append(f"spec.engine.{kv_memory}: {e}")
    for i, arg in enumerate(engine.get("extraArgs", [])):
        if sets_managed_flag(arg):
            errors.append(f"spec.engine.extraArgs[{i}]: {arg!r}: {crds.EXTRA_ARGS_MESSAGE}")
    return errors + autoscaling_rule_errors(spec)


def autoscaling_rule_errors(spec: dict) -> list[str]:
    """The CEL rules on spec.autoscaling (and its spec-level one with spec.sleep), on a defaulted spec."""
    scaling = spec.get("autoscaling")
    if scaling is None:
        return []
    errors: list[str] = []
    low, high = scaling["minReplicas"], scaling["maxReplicas"]
    if low > high:
        errors.append(f"spec.autoscaling: {crd_autoscaling.AUTOSCALING_MIN_MAX_MESSAGE} (got {low} > {high})")
    target = scaling.get("target")
    if scaling["metric"] == "kvCacheUsage" and target is not None and target > 1:
        errors.append(f"spec.autoscaling.target: {crd_autoscaling.AUTOSCALING_KV_TARGET_MESSAGE} (got {target})")
    idle, zero_after = spec["sleep"]["idleSeconds"], scaling["scaleToZeroAfterSeconds"]
    if low == 0 and idle > 0 and zero_after <= idle:
        errors.append(
            f"spec.autoscaling.scaleToZeroAfterSeconds: {crd_autoscaling.AUTOSCALING_ZERO_AFTER_SLEEP_MESSAGE} "
            f"(got {zero_after} <= {idle})"
        )
    return errors


def inference_model_name_errors(name: str) -> list[str]:
    """The CRD's root rule on metadata.name."""
    if len(name) > crds.MAX_MODEL_NAME or not re.match(crds.DNS_1035_LABEL, name):
        return [f"metadata.name {name!r}: {crds.MODEL_NAME_MESSAGE}"]
    return []


def tenant_rule_errors(spec: dict) -> list[str]:
    errors: list[str] = []
    for pattern in spec.get("models", []):
        try:
            re.compile(fnmatch.translate(pattern))
        except re.error as e:  # e.g. an unterminated character class
            errors.append(f"spec.models: {pattern!r} is not a valid glob ({e})")
    return errors


def validated_inference_model(obj: dict) -> dict:
    """The object's spec, defaulted and checked; raises SpecError listing every problem."""
    return _validated(obj, crds.inference_model_schema(), inference_model_rule_errors)


def validated_tenant(obj: dict) -> dict:
    return _validated(obj, crds.tenant_schema(), tenant_rule_errors)


def _validated(obj: dict, schema: dict, rules: Any) -> dict:
    body = {"spec": obj.get("spec")} if obj.get("spec") is not None else {}
    defaulted = apply_defaults(body, schema)
    errors = schema_errors(defaulted, {**schema, "properties": {"spec": schema["properties"]["spec"]}})
    if not errors:
        errors = rules(defaulted["spec"])
    if errors:
        raise SpecError("; ".join(errors))
    return defaulted["spec"]
