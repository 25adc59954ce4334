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
from decimal import Decimal, InvalidOperation
from typing import Any

import jsonschema

from kvfleet_operator import crds


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
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$")


def parse_bytes(quantity: int | str) -> int:
    """A Kubernetes quantity (``8Gi``, ``500M``, ``1073741824``) as a whole number of bytes."""
    if isinstance(quantity, bool):
        raise SpecError(f"{quantity!r} is not a quantity")
    if isinstance(quantity, int):
        value = Decimal(quantity)
    else:
        match = _QUANTITY.match(quantity.strip())
        if match is None:
            raise SpecError(f"{quantity!r} is not a quantity (e.g. 8Gi, 500M, 1073741824)")
        number, suffix = match.groups()
        try:
            value = Decimal(number)
        except InvalidOperation:
            raise SpecError(f"{quantity!r} is not a quantity") from None
        suffix = suffix or ""
        if suffix == "m":
            value /= 1000
        elif suffix[:1] in "eE" and suffix:
            value *= Decimal(10) ** int(suffix[1:])
        elif suffix in _BINARY_SUFFIXES:
            value *= _BINARY_SUFFIXES[suffix]
        else:
            value *= _DECIMAL_SUFFIXES[suffix]
    if value != value.to_integral_value() or value <= 0:
        raise SpecError(f"{quantity!r} must be a positive whole number of bytes")
    return int(value)


# Flags the operator owns: setting them through extraArgs would break routing, auth or probes.
MANAGED_ENGINE_FLAGS = frozenset(
    {
        "--model",
        "--host",
        "--port",
        "--served-model-name",
        "--redis-url",
        "--admin-token",
        "--device",
        "--tensor-parallel-size",
        "--pipeline-parallel-size",
        "--shutdown-timeout",
        "--replica-name",
        "--base-url",
    }
)


def inference_model_rule_errors(spec: dict) -> list[str]:
    """The CEL rules of InferenceModel plus checks no schema can express, on a defaulted spec."""
    errors: list[str] = []
    engine = spec.get("engine", {})
    if "kvCacheMemory" in engine and "gpuMemoryUtilization" in engine:
        errors.append("spec.engine: kvCacheMemory and gpuMemoryUtilization are mutually exclusive")
    tp, pp = engine.get("tensorParallelSize", 1), engine.get("pipelineParallelSize", 1)
    if isinstance(tp, int) and isinstance(pp, int) and tp * pp > crds.MAX_ACCELERATORS_PER_POD:
        errors.append(
            f"spec.engine: tensorParallelSize × pipelineParallelSize must be at most "
            f"{crds.MAX_ACCELERATORS_PER_POD} accelerators per pod (got {tp} × {pp} = {tp * pp})"
        )
    seqs, tokens = engine.get("maxNumSeqs"), engine.get("maxNumBatchedTokens")
    if isinstance(seqs, int) and isinstance(tokens, int) and tokens < seqs:
        errors.append(f"spec.engine: maxNumBatchedTokens must be at least maxNumSeqs (got {tokens} < {seqs})")
    if spec.get("accelerator") == "cpu" and "gpuMemoryUtilization" in engine:
        errors.append(
            "spec: gpuMemoryUtilization needs accelerator nvidia; size the cache with kvCacheMemory on cpu"
        )
    if "kvCacheMemory" in engine:
        try:
            parse_bytes(engine["kvCacheMemory"])
        except SpecError as e:
            errors.append(f"spec.engine.kvCacheMemory: {e}")
    for arg in engine.get("extraArgs", []):
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_ENGINE_FLAGS:
            errors.append(f"spec.engine.extraArgs: {flag} is set by the operator from the spec; remove it")
    return errors


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
