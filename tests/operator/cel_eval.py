"""Kubernetes CEL (CRD `x-kubernetes-validations`, ValidatingAdmissionPolicy expressions) evaluated with
cel-python, so that the rules themselves are exercised, not only their Python twins.

`rule_failures(schema, obj)` walks an OpenAPI schema and an object together as the API server does: every
rule of every schema node present in the object is evaluated with ``self`` bound to that node (each item of
a list, each value of a map), and the messages of the rules that do not hold are returned.
"""

from __future__ import annotations

import functools
from typing import Any

import celpy

_ENV = celpy.Environment()


@functools.cache
def program(expression: str) -> Any:
    """Compile ``expression`` (raises celpy.CELParseError if it does not compile)."""
    return _ENV.program(_ENV.compile(expression))


def evaluate(expression: str, **variables: Any) -> bool:
    result = program(expression).evaluate({k: celpy.json_to_cel(v) for k, v in variables.items()})
    if isinstance(result, celpy.CELEvalError):
        raise result
    assert isinstance(result, celpy.celtypes.BoolType), f"{expression!r} gave {result!r}, not a bool"
    return bool(result)


def rules_of(schema: dict, path: str = "") -> list[tuple[str, dict]]:
    """(schema path, rule) of every CEL rule in ``schema``."""
    found = [(path or ".", rule) for rule in schema.get("x-kubernetes-validations", [])]
    for key, sub in schema.get("properties", {}).items():
        found += rules_of(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        found += rules_of(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        found += rules_of(schema["additionalProperties"], f"{path}.*")
    return found


def rule_failures(schema: dict, obj: Any) -> list[str]:
    failures = [
        rule["message"]
        for rule in schema.get("x-kubernetes-validations", [])
        if not evaluate(rule["rule"], self=obj)
    ]
    if isinstance(obj, dict):
        properties = schema.get("properties", {})
        for key, value in obj.items():
            if key in properties:
                failures += rule_failures(properties[key], value)
            elif isinstance(schema.get("additionalProperties"), dict):
                failures += rule_failures(schema["additionalProperties"], value)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            failures += rule_failures(schema["items"], item)
    return failures
