"""OpenAPI v3 building blocks of the CRDs' structural schemas: typed scalars, Kubernetes quantities, free-form
Kubernetes objects, the custom-resource envelope and metav1.Condition lists. `crds.py` composes them."""

from __future__ import annotations

from typing import Any

QUANTITY_PATTERN = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
# A positive whole number of bytes (``1073741824``, ``1e9``) or a positive quantity with a unit (``8Gi``,
# ``1.5G``): no sign, no milli unit, no bare fraction, not zero. A fraction of a byte left by a unit
# (``1.3Ki``) rounds up, as Kubernetes rounds quantities. `validation.parse_bytes` reads the same set.
BYTES_PATTERN = (
    r"^(0*[1-9][0-9]*([eE][0-9]+)?"  # a whole number, not 0
    r"|(0*[1-9][0-9]*|[0-9]*[1-9][0-9]*\.[0-9]*|[0-9]*\.[0-9]*[1-9][0-9]*)"  # a number with a nonzero digit
    r"([KMGTPE]i|[kMGTPE]))$"  # ... and a unit
)


def integer(
    minimum: int | None = None, maximum: int | None = None, default: int | None = None, **kw: Any
) -> dict:
    schema: dict[str, Any] = {"type": "integer", **kw}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    if default is not None:
        schema["default"] = default
    return schema


def string(description: str, **kw: Any) -> dict:
    return {"type": "string", "description": description, **kw}


def quantity(description: str) -> dict:
    """A Kubernetes resource.Quantity (int or string), shaped as structural schemas require."""
    return {
        "description": description,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": QUANTITY_PATTERN,
        "x-kubernetes-int-or-string": True,
    }


def byte_quantity(description: str) -> dict:
    """A positive number of bytes as a Kubernetes quantity (``8Gi``) or an integer."""
    return {**quantity(description), "pattern": BYTES_PATTERN, "minimum": 1}


def free_object(description: str) -> dict:
    """An object whose schema belongs to Kubernetes core types (kept as-is, validated by the API server
    when the operator copies it into a pod)."""
    return {"type": "object", "description": description, "x-kubernetes-preserve-unknown-fields": True}


def resource_schema(spec: dict, status: dict, validations: list[dict] | None = None) -> dict:
    """The top-level openAPIV3Schema of a custom resource with a required spec and a status; root
    ``validations`` may read ``self.metadata.name``."""
    schema: dict[str, Any] = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }
    if validations:
        schema["x-kubernetes-validations"] = validations
    return schema


def conditions_schema() -> dict:
    return {
        "type": "array",
        "description": "Latest observations of the object's state (metav1.Condition).",
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
        "maxItems": 16,
        "items": {
            "type": "object",
            "required": ["type", "status"],
            "properties": {
                "type": string("Condition type.", maxLength=64),
                "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                "reason": string("CamelCase machine-readable reason.", maxLength=128),
                "message": string("Human-readable details.", maxLength=4096),
                "lastTransitionTime": {"type": "string", "format": "date-time"},
                "observedGeneration": integer(minimum=0, format="int64"),
            },
        },
    }
