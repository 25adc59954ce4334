"""The CRD schema of InferenceModel's ``spec.autoscaling`` and ``status.autoscaling`` (with its CEL rules and
their messages, which `validation` mirrors). Kept apart from `crds` so that each module stays one idea."""

from __future__ import annotations

from kvfleet_operator.autoscaling import DEFAULT_TARGETS, METRICS
from kvfleet_operator.openapi_schema import integer

AUTOSCALING_MIN_MAX_MESSAGE = "autoscaling.minReplicas must be at most autoscaling.maxReplicas"
AUTOSCALING_KV_TARGET_MESSAGE = (
    "autoscaling.target is a fraction of one replica's KV cache with metric kvCacheUsage: at most 1"
)
AUTOSCALING_ZERO_AFTER_SLEEP_MESSAGE = (
    "with autoscaling.minReplicas 0 and sleep.idleSeconds > 0, autoscaling.scaleToZeroAfterSeconds must be "
    "greater than sleep.idleSeconds (replicas sleep first, then scale to zero)"
)


def autoscaling_spec_schema() -> dict:
    """spec.autoscaling: the operator's own autoscaler (`autoscaling.decide`) sets the Deployment's replicas."""
    targets = ", ".join(f"{m} {t:g}" for m, t in DEFAULT_TARGETS.items())
    return {
        "type": "object",
        "description": "Scale replicas with load (absent: spec.replicas is fixed). spec.replicas is then "
        "ignored: do not point an HPA or KEDA at a model that has this.",
        "required": ["maxReplicas"],
        "properties": {
            "minReplicas": integer(0, 1024, 1, description="Fewest replicas; 0 allows scale to zero."),
            "maxReplicas": integer(1, 1024, description="Most replicas."),
            "metric": {
                "type": "string",
                "enum": list(METRICS),
                "default": "inFlight",
                "description": "inFlight: requests in flight plus held at gateways; waiting: queued in "
                "engines plus held; kvCacheUsage: the replicas' summed KV-cache usage.",
            },
            "target": {
                "type": "number",
                "description": f"Metric per replica (default: {targets}).",
                "exclusiveMinimum": True,
                "minimum": 0,
            },
            "scaleUpStabilizationSeconds": integer(
                0, 3600, 30, description="Scale up to the lowest recommendation of this window."
            ),
            "scaleDownDelaySeconds": integer(
                0, 86400, 300, description="Scale down to the highest recommendation of this window."
            ),
            "scaleToZeroAfterSeconds": integer(
                0, 604800, 3600, description="With minReplicas 0: no demand for this long scales to zero."
            ),
        },
        "x-kubernetes-validations": [
            {"rule": "self.minReplicas <= self.maxReplicas", "message": AUTOSCALING_MIN_MAX_MESSAGE},
            # double(): a `number` is a double to the API server, but an integer in a JSON document.
            {
                "rule": "self.metric != 'kvCacheUsage' || !has(self.target) || double(self.target) <= 1.0",
                "message": AUTOSCALING_KV_TARGET_MESSAGE,
            },
        ],
    }


def autoscaling_status_schema() -> dict:
    """status.autoscaling: what the autoscaler last decided (handlers.autoscaler.autoscaling_status)."""
    stamp = {"type": "string", "format": "date-time"}
    return {
        "type": "object",
        "properties": {
            "desiredReplicas": integer(0),
            "reason": {"type": "string"},
            "message": {"type": "string"},
            "lastScaleTime": stamp,
            "coldStarts": integer(0, format="int64"),
            "lastColdStart": {
                "type": "object",
                "description": "The last scale-up from zero for a held request, and when its replica was ready.",
                "properties": {"startedAt": stamp, "readyAt": stamp, "seconds": {"type": "number"}},
            },
        },
    }
