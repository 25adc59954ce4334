"""Typed views of the custom objects' specs (after defaulting and validation) and of the operator's own
configuration. Pure: no Kubernetes or Redis here."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from kvfleet_operator.autoscaling import DEFAULT_TARGETS, AutoscalingPolicy
from kvfleet_operator.engine_fields import ENGINE_FIELDS
from kvfleet_operator.validation import (
    SpecError,
    inference_model_name_errors,
    parse_bytes,
    validated_inference_model,
    validated_tenant,
)

ENGINE_PORT = 8000
MODEL_MOUNT = "/models"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a replica finds its weights. Invariant: exactly the fields of ``scheme`` are set."""

    scheme: Literal["pvc", "hf", "file"]
    path: str = ""  # pvc: path inside the claim; file: absolute path in the image/node
    claim: str | None = None
    repo: str | None = None
    revision: str | None = None

    @property
    def model_dir(self) -> str:
        """The directory `kvfleet engine serve --model` gets inside the pod."""
        if self.scheme == "pvc":
            return f"{MODEL_MOUNT}/{self.path}".rstrip("/") if self.path else MODEL_MOUNT
        if self.scheme == "hf":
            return f"{MODEL_MOUNT}/hf"
        return self.path


def parse_model_uri(uri: str) -> ModelSource:
    """``pvc://claim[/path]``, ``hf://org/name[@revision]`` or ``file:///abs/path``; SpecError otherwise."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        raise SpecError(f"spec.model.uri {uri!r} has no scheme; use pvc://, hf:// or file://")
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", claim):
            raise SpecError(f"spec.model.uri {uri!r}: {claim!r} is not a PersistentVolumeClaim name")
        if ".." in path.split("/"):
            raise SpecError(f"spec.model.uri {uri!r}: the path may not contain '..'")
        return ModelSource("pvc", path=path.strip("/"), claim=claim)
    if scheme == "hf":
        repo, _, revision = rest.partition("@")
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
            raise SpecError(f"spec.model.uri {uri!r}: expected hf://org/name[@revision]")
        if "@" in rest and not revision:
            raise SpecError(f"spec.model.uri {uri!r}: empty revision after '@'")
        return ModelSource("hf", repo=repo, revision=revision or None)
    if scheme == "file":
        if not rest.startswith("/") or rest == "/":
            raise SpecError(f"spec.model.uri {uri!r}: expected file:///absolute/path")
        return ModelSource("file", path=rest.rstrip("/"))
    raise SpecError(f"spec.model.uri {uri!r}: unknown scheme {scheme!r}; use pvc://, hf:// or file://")


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """``spec.engine``. ``settings``: EngineArgs field -> value of every engine setting the defaulted spec
    has (`engine_fields.ENGINE_FIELDS` maps the names; kvCacheMemory is in bytes); an absent one is left to
    the engine's default. Invariant: the CRD defaults tensorParallelSize, pipelineParallelSize, dtype and
    blockSize, so those are always there."""

    image: str | None
    image_pull_policy: str | None
    settings: dict[str, Any]
    extra_args: tuple[str, ...]
    env: tuple[dict[str, Any], ...]

    @property
    def accelerators_per_pod(self) -> int:
        return self.settings["tensor_parallel_size"] * self.settings["pipeline_parallel_size"]

    @property
    def block_size(self) -> int:
        return self.settings["block_size"]


def engine_settings(engine: dict[str, Any]) -> dict[str, Any]:
    """EngineArgs field -> value of each engine setting a validated, defaulted ``spec.engine`` has."""
    return {
        f.arg: parse_bytes(engine[f.crd]) if f.bytes_quantity else engine[f.crd]
        for f in ENGINE_FIELDS
        if f.crd in engine
    }


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """An InferenceModel's desired state. Invariant: built only from a validated, defaulted spec."""

    name: str
    namespace: str
    uid: str
    generation: int
    served_name: str
    source: ModelSource
    tokenizer: str | None
    engine: EngineSpec
    replicas: int
    accelerator: Literal["nvidia", "cpu"]
    resources: dict[str, Any]
    node_selector: dict[str, str]
    tolerations: tuple[dict[str, Any], ...]
    affinity: dict[str, Any] | None
    priority_class_name: str | None
    termination_grace_period_seconds: int
    startup_timeout_seconds: int
    sleep_idle_seconds: int
    sleep_level: int
    routing_policy: str
    allowed_tenants: tuple[str, ...] | None
    autoscaling: AutoscalingPolicy | None = None  # None: spec.replicas is fixed


def model_spec_from(obj: dict) -> ModelSpec:
    """Validate an InferenceModel object (as the API server returns it) and build its ModelSpec.

    Raises SpecError naming every problem found."""
    meta = obj.get("metadata", {})
    name = meta.get("name", "")
    name_errors = inference_model_name_errors(name)
    if name_errors:
        raise SpecError("; ".join(name_errors))
    spec = validated_inference_model(obj)
    model, engine = spec["model"], spec["engine"]
    source = parse_model_uri(model["uri"])
    return ModelSpec(
        name=name,
        namespace=meta.get("namespace", "default"),
        uid=meta.get("uid", ""),
        generation=int(meta.get("generation", 0) or 0),
        served_name=model.get("servedName") or name,
        source=source,
        tokenizer=model.get("tokenizer"),
        engine=EngineSpec(
            image=engine.get("image"),
            image_pull_policy=engine.get("imagePullPolicy"),
            settings=engine_settings(engine),
            extra_args=tuple(engine.get("extraArgs", ())),
            env=tuple(engine.get("env", ())),
        ),
        replicas=spec["replicas"],
        accelerator=spec["accelerator"],
        resources=spec.get("resources", {}),
        node_selector=spec.get("nodeSelector", {}),
        tolerations=tuple(spec.get("tolerations", ())),
        affinity=spec.get("affinity"),
        priority_class_name=spec.get("priorityClassName"),
        termination_grace_period_seconds=spec["terminationGracePeriodSeconds"],
        startup_timeout_seconds=spec["startupTimeoutSeconds"],
        sleep_idle_seconds=spec["sleep"]["idleSeconds"],
        sleep_level=spec["sleep"]["level"],
        routing_policy=spec["routing"]["policy"],
        allowed_tenants=_allowed_tenants(spec),
        autoscaling=autoscaling_policy(spec.get("autoscaling")),
    )


def autoscaling_policy(scaling: dict | None) -> AutoscalingPolicy | None:
    """The policy of a validated, defaulted ``spec.autoscaling``; its target defaults by metric."""
    if scaling is None:
        return None
    metric = scaling["metric"]
    return AutoscalingPolicy(
        min_replicas=scaling["minReplicas"],
        max_replicas=scaling["maxReplicas"],
        metric=metric,
        target=float(scaling.get("target", DEFAULT_TARGETS[metric])),
        scale_up_stabilization_s=float(scaling["scaleUpStabilizationSeconds"]),
        scale_down_delay_s=float(scaling["scaleDownDelaySeconds"]),
        scale_to_zero_after_s=float(scaling["scaleToZeroAfterSeconds"]),
    )


def _allowed_tenants(spec: dict) -> tuple[str, ...] | None:
    tenants = spec.get("access", {}).get("tenants")
    return None if tenants is None else tuple(tenants)


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """A Tenant's desired state; the key itself is read from the Secret by the handler."""

    name: str
    secret_name: str
    secret_namespace: str
    secret_key: str
    models: tuple[str, ...]
    requests_per_minute: int
    tokens_per_minute: int
    max_concurrent: int
    priority: int
    cache_salt: str


def tenant_spec_from(obj: dict, default_secret_namespace: str) -> TenantSpec:
    spec = validated_tenant(obj)
    ref, limits = spec["apiKeySecretRef"], spec["limits"]
    return TenantSpec(
        name=obj.get("metadata", {}).get("name", ""),
        secret_name=ref["name"],
        secret_namespace=ref.get("namespace") or default_secret_namespace,
        secret_key=ref["key"],
        models=tuple(spec["models"]),
        requests_per_minute=limits.get("requestsPerMinute", 0),
        tokens_per_minute=limits.get("tokensPerMinute", 0),
        max_concurrent=limits.get("maxConcurrent", 0),
        priority=spec["priority"],
        cache_salt=spec.get("cacheSalt", ""),
    )


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    """Operator-wide settings (from its command line / the chart)."""

    engine_image: str = "ghcr.io/kvfleet/engine:latest"
    engine_image_cpu: str | None = (
        None  # default image for accelerator=cpu models (falls back to engine_image)
    )
    namespace: str = "kvfleet-system"  # where the operator runs; default namespace of Tenant Secrets
    redis_url: str = "redis://localhost:6379/0"
    admin_token: str = ""  # the platform's: the gateway's admin API; engines get it only without a root
    # The platform's replica key root (hex; kvfleet_common.replica_credentials): each model's engines get only
    # their model's key and derived admin token. Empty: engines get the platform admin token, unsigned
    # heartbeats (local development only).
    replica_key_root: str = ""
    gpu_resource: str = "nvidia.com/gpu"
    shm_size: str = "8Gi"
    extra_pod_labels: dict[str, str] = field(default_factory=dict)
    # OTLP/HTTP endpoint (e.g. http://otel-collector.kvfleet-system.svc:4318) that engine pods export traces
    # to, as OTEL_EXPORTER_OTLP_ENDPOINT. Empty: engines get no exporter (they still propagate traceparent).
    otlp_endpoint: str = ""
    # Give every model a NetworkPolicy: its engine pods accept traffic (port 8000) only from pods labelled
    # kvfleet.io/engine-client=true in the operator's namespace (the chart's gateway and operator) and from
    # engine_ingress_from (core/v1 NetworkPolicyPeer objects, e.g. a Prometheus namespace).
    engine_network_policy: bool = False
    engine_ingress_from: tuple[dict[str, Any], ...] = ()
