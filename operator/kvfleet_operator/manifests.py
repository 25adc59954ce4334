"""Pure builders of the Kubernetes objects an InferenceModel owns.

Same ModelSpec and OperatorConfig in, same dicts out: nothing here talks to a server, so every field is
unit-tested and validated against the Kubernetes OpenAPI schemas without a cluster.

Naming: the Deployment, headless Service, ConfigMap, PodDisruptionBudget and (when enabled) NetworkPolicy
take the model's name; the Secret with the engine's credentials is ``<name>-credentials``. All
carry the labels of `labels()` and a controller ownerReference to the InferenceModel, so deleting the model
deletes them.

Engine pods pass the Pod Security Standard "restricted" (non-root, RuntimeDefault seccomp, no privilege
escalation, every capability dropped) with a read-only root filesystem: what the engine writes goes to
emptyDirs (`WRITABLE_DIRS`).

Credentials (docs/SECURITY.md): with the platform's replica key root, a model's Secret holds the Redis URL, the
model's replica key (it signs the engines' heartbeats) and the admin token derived from it, never the platform
admin token, so rotating that token touches no engine. The pod template carries a hash of that Secret's data
(`credentials_hash`): a new root, Redis password or URL rolls the engines onto their new credentials, and an
unchanged Secret leaves the template, so the pods, as they are.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import math
from typing import Any

from kvfleet_common import replica_credentials
from kvfleet_engine.engine_args import EngineArgs
from kvfleet_operator import crds
from kvfleet_operator.spec import ENGINE_PORT, MODEL_MOUNT, ModelSpec, OperatorConfig

MODEL_LABEL = "kvfleet.io/model"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGER = "kvfleet-operator"
CONFIG_HASH_ANNOTATION = "kvfleet.io/config-hash"
CREDENTIALS_REDIS_KEY = "redis-url"
CREDENTIALS_TOKEN_KEY = "admin-token"
CREDENTIALS_REPLICA_KEY = "replica-key"
CREDENTIALS_HASH_ANNOTATION = "kvfleet.io/credentials-hash"
CONFIG_MOUNT = "/etc/kvfleet"
STARTUP_PROBE_PERIOD = 10
HEALTH_PATH = "/health"
SHUTDOWN_MARGIN_S = 10  # of the grace period, kept for the process to exit after draining
ENGINE_UID = 1000  # the engine images' user
# Pods with this label in the operator's namespace (the chart's gateway and operator) may reach engine pods
# through the per-model NetworkPolicy.
ENGINE_CLIENT_LABEL = "kvfleet.io/engine-client"
# The root filesystem is read-only; these emptyDirs are where an engine writes: /tmp (the ZMQ ipc sockets
# between the API server and the engine core, temporary files) and a home directory whose .cache holds the
# compiled CPU kernels (XDG_CACHE_HOME), Triton's kernel cache and the CUDA JIT cache (~/.nv).
ENGINE_HOME = "/home/kvfleet"
WRITABLE_DIRS = {"tmp": "/tmp", "home": ENGINE_HOME}


def selector_labels(model: ModelSpec) -> dict[str, str]:
    """The labels that select a model's engine pods; immutable for the Deployment's life."""
    return {MODEL_LABEL: model.name, COMPONENT_LABEL: "engine"}


def labels(model: ModelSpec) -> dict[str, str]:
    return {
        **selector_labels(model),
        "app.kubernetes.io/name": "kvfleet-engine",
        "app.kubernetes.io/instance": model.name,
        "app.kubernetes.io/part-of": "kvfleet",
        "app.kubernetes.io/managed-by": MANAGER,
    }


def selector_string(model: ModelSpec) -> str:
    """`status.selector` for the /scale subresource (what `kubectl scale` and HPAs read)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(model).items()))


def owner_reference(model: ModelSpec) -> dict[str, Any]:
    return {
        "apiVersion": crds.API_VERSION,
        "kind": crds.MODEL_KIND,
        "name": model.name,
        "uid": model.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(model: ModelSpec, name: str | None = None) -> dict[str, Any]:
    return {
        "name": name or model.name,
        "namespace": model.namespace,
        "labels": labels(model),
        "ownerReferences": [owner_reference(model)],
    }


def credentials_secret_name(model: ModelSpec) -> str:
    return f"{model.name}-credentials"


def model_key(model: ModelSpec, config: OperatorConfig) -> bytes | None:
    """The model's replica key (for its served name, the model heartbeats carry); None without a root."""
    if not config.replica_key_root:
        return None
    root = replica_credentials.parse_key(config.replica_key_root)
    return replica_credentials.model_key(root, model.served_name)


def engine_image(model: ModelSpec, config: OperatorConfig) -> str:
    if model.engine.image:
        return model.engine.image
    if model.accelerator == "cpu" and config.engine_image_cpu:
        return config.engine_image_cpu
    return config.engine_image


def engine_args(model: ModelSpec) -> list[str]:
    """`kvfleet engine serve` arguments for one replica: the engine settings the spec has (an absent one is
    left to the engine's default), spelled by the engine's own ``EngineArgs``, then the server's flags and
    ``spec.engine.extraArgs``. The Redis URL and admin token travel in the environment (from the credentials
    Secret), never on the command line."""
    settings = {
        "model": model.source.model_dir,
        "device": "cuda" if model.accelerator == "nvidia" else "cpu",
        # tenants' priorities (forwarded by the gateway) only order work under the priority policy
        "scheduling_policy": "priority",
        **model.engine.settings,
    }
    server = ["--host", "0.0.0.0", "--port", str(ENGINE_PORT), "--served-model-name", model.served_name]
    # On SIGTERM the engine lets in-flight requests finish for this long; keep it inside the pod's grace
    # period so the kubelet's SIGKILL never cuts a drain short.
    server += ["--shutdown-timeout", str(shutdown_timeout(model))]
    return [*EngineArgs.cli_args(settings), *server, *model.engine.extra_args]


def shutdown_timeout(model: ModelSpec) -> int:
    grace = model.termination_grace_period_seconds
    return max(1, grace - SHUTDOWN_MARGIN_S) if grace > SHUTDOWN_MARGIN_S else max(1, grace // 2)


def _writable_env(model: ModelSpec, taken: set[str]) -> list[dict[str, Any]]:
    """Where caches go, all inside the pod's emptyDirs (a model's own ``spec.engine.env`` wins, which also
    keeps names unique)."""
    cache = f"{ENGINE_HOME}/.cache"
    env = [
        {"name": "HOME", "value": ENGINE_HOME},
        {"name": "XDG_CACHE_HOME", "value": cache},
        {"name": "TRITON_CACHE_DIR", "value": f"{cache}/triton"},
        # hf:// models download into the model volume; the others may still fetch a tokenizer or config.
        {
            "name": "HF_HOME",
            "value": f"{MODEL_MOUNT}/.hf-home" if model.source.scheme == "hf" else f"{cache}/huggingface",
        },
    ]
    return [e for e in env if e["name"] not in taken]


def _engine_env(model: ModelSpec, config: OperatorConfig) -> list[dict[str, Any]]:
    secret = credentials_secret_name(model)
    own = copy.deepcopy(list(model.engine.env))
    taken = {e.get("name") for e in own}
    replica_key = [
        {
            "name": "KVFLEET_REPLICA_KEY",
            "valueFrom": {"secretKeyRef": {"name": secret, "key": CREDENTIALS_REPLICA_KEY}},
        }
    ]
    return [
        {
            "name": "KVFLEET_REDIS_URL",
            "valueFrom": {"secretKeyRef": {"name": secret, "key": CREDENTIALS_REDIS_KEY}},
        },
        {
            "name": "KVFLEET_ADMIN_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": secret, "key": CREDENTIALS_TOKEN_KEY}},
        },
        *(replica_key if config.replica_key_root else []),
        {"name": "KVFLEET_REPLICA_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "KVFLEET_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # $(VAR) references are expanded by the kubelet from variables defined earlier in the list.
        {"name": "KVFLEET_BASE_URL", "value": f"http://$(KVFLEET_POD_IP):{ENGINE_PORT}"},
        {"name": "KVFLEET_MODEL", "value": model.name},
        {"name": "KVFLEET_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        *_writable_env(model, taken),
        *_otel_env(model, config, taken),
        *own,
    ]


def _otel_env(model: ModelSpec, config: OperatorConfig, taken: set[str]) -> list[dict[str, Any]]:
    """Where the engine exports its spans (``kvfleet_common.server_kit.tracing`` reads the standard ``OTEL_*``
    variables), when the operator was given an OTLP endpoint.

    A variable the model's own ``spec.engine.env`` sets is left to it (a model may export elsewhere), which
    also keeps names unique: server-side apply refuses a container whose env repeats a name. The resource
    attributes name the pod, so a trace in Jaeger shows which replica served it."""
    if not config.otlp_endpoint:
        return []
    attributes = ",".join([
        "k8s.namespace.name=$(KVFLEET_NAMESPACE)",
        "k8s.pod.name=$(KVFLEET_REPLICA_NAME)",
        f"kvfleet.model={model.name}",
    ])  # fmt: skip
    env = [
        {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": config.otlp_endpoint},
        {"name": "OTEL_RESOURCE_ATTRIBUTES", "value": attributes},
    ]
    return [e for e in env if e["name"] not in taken]


def _resources(model: ModelSpec, config: OperatorConfig) -> dict[str, Any]:
    limits = dict(model.resources.get("limits", {}))  # values are scalars: a shallow copy is a full one
    requests = dict(model.resources.get("requests", {}))
    if model.accelerator == "nvidia":
        # Extended resources cannot be overcommitted: request and limit must be equal.
        gpus = model.engine.accelerators_per_pod
        limits[config.gpu_resource] = gpus
        requests[config.gpu_resource] = gpus
    out: dict[str, Any] = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def _probes(model: ModelSpec) -> dict[str, Any]:
    def http() -> dict[str, Any]:  # a fresh dict per probe: no shared (YAML-aliased) objects in the output
        return {"path": HEALTH_PATH, "port": "http"}

    return {
        # Loading a large model can take many minutes; the startup probe holds the other two off until then.
        "startupProbe": {
            "httpGet": http(),
            "periodSeconds": STARTUP_PROBE_PERIOD,
            "timeoutSeconds": 5,
            "failureThreshold": max(1, math.ceil(model.startup_timeout_seconds / STARTUP_PROBE_PERIOD)),
        },
        "readinessProbe": {"httpGet": http(), "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3},
        # Generous: a replica busy with long prefills must not be killed for one slow answer.
        "livenessProbe": {
            "httpGet": http(),
            "periodSeconds": 15,
            "timeoutSeconds": 10,
            "failureThreshold": 6,
        },
    }


def _volumes(model: ModelSpec, config: OperatorConfig) -> tuple[list[dict], list[dict]]:
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": model.name}},
        # Shared memory for the TP/PP worker processes (the default 64 MiB /dev/shm is far too small).
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": config.shm_size}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    for name, path in WRITABLE_DIRS.items():
        volumes.append({"name": name, "emptyDir": {}})
        mounts.append({"name": name, "mountPath": path})
    source = model.source
    if source.scheme == "pvc":
        volumes.append(
            {"name": "model", "persistentVolumeClaim": {"claimName": source.claim, "readOnly": True}}
        )
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    elif source.scheme == "hf":
        volumes.append({"name": "model", "emptyDir": {}})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT})
    return volumes, mounts


def _fetch_container(model: ModelSpec, image: str, env: list[dict], mounts: list[dict]) -> dict[str, Any]:
    """Init container that downloads an hf:// model into the pod's model volume before the engine starts."""
    source = model.source
    command = ["hf", "download", str(source.repo), "--local-dir", source.model_dir]
    if source.revision:
        command += ["--revision", source.revision]
    container: dict[str, Any] = {
        "name": "fetch-model",
        "image": image,
        "command": command,
        "env": copy.deepcopy(env),
        "volumeMounts": [dict(m) for m in mounts if m["name"] == "model" or m["name"] in WRITABLE_DIRS],
        "securityContext": _container_security(),
    }
    if model.engine.image_pull_policy:
        container["imagePullPolicy"] = model.engine.image_pull_policy
    return container


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
    }


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": ENGINE_UID,
        "runAsGroup": ENGINE_UID,
        "fsGroup": ENGINE_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _tolerations(model: ModelSpec, config: OperatorConfig) -> list[dict[str, Any]]:
    tolerations = copy.deepcopy(list(model.tolerations))
    if model.accelerator == "nvidia" and not any(t.get("key") == config.gpu_resource for t in tolerations):
        # GPU node pools are commonly tainted with the resource name.
        tolerations.append({"key": config.gpu_resource, "operator": "Exists", "effect": "NoSchedule"})
    return tolerations


def config_hash(config_map_: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config_map_["data"], sort_keys=True).encode()).hexdigest()[:16]


_CREDENTIALS_HASH_LABEL = b"kvfleet/credentials-hash\0"


def credentials_hash(secret: dict[str, Any]) -> str:
    """A fingerprint of a credentials Secret's data, for the pod template: it changes iff the data does.

    Safe to publish (the pod template is readable by whoever may read Deployments, who may not read Secrets):
    it hashes the whole data together, and the data always holds a high-entropy secret: the model's 256-bit
    replica key (derived from the root), or, without a root (local development), the platform admin token.
    So the digest can neither be inverted nor used to test guesses of a weaker value next to it, such as a
    chosen Redis password; a guess would have to include the key as well."""
    canonical = json.dumps(secret["data"], sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(_CREDENTIALS_HASH_LABEL + canonical).hexdigest()[:16]


def pod_template(model: ModelSpec, config: OperatorConfig) -> dict[str, Any]:
    image = engine_image(model, config)
    env = _engine_env(model, config)
    volumes, mounts = _volumes(model, config)
    container: dict[str, Any] = {
        "name": "engine",
        "image": image,
        "command": ["kvfleet", "engine", "serve"],
        "args": engine_args(model),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "env": env,
        "resources": _resources(model, config),
        "volumeMounts": mounts,
        **_probes(model),
        "securityContext": _container_security(),
    }
    if model.engine.image_pull_policy:
        container["imagePullPolicy"] = model.engine.image_pull_policy
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": model.termination_grace_period_seconds,
        # The engine never talks to the Kubernetes API.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": _pod_security(),
    }
    if model.source.scheme == "hf":
        pod_spec["initContainers"] = [_fetch_container(model, image, env, mounts)]
    if model.node_selector:
        pod_spec["nodeSelector"] = dict(model.node_selector)
    tolerations = _tolerations(model, config)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if model.affinity:
        pod_spec["affinity"] = copy.deepcopy(model.affinity)
    if model.priority_class_name:
        pod_spec["priorityClassName"] = model.priority_class_name
    # A changed ConfigMap rolls the pods, like a changed spec does; so do changed credentials (a rotated root
    # or Redis password): the engines read them from the Secret only at start, and would otherwise keep
    # signing with the old key (unverified, so without traffic) or be refused by Redis.
    annotations = {
        CONFIG_HASH_ANNOTATION: config_hash(config_map(model, config)),
        CREDENTIALS_HASH_ANNOTATION: credentials_hash(credentials_secret(model, config)),
    }
    return {
        "metadata": {"labels": {**labels(model), **config.extra_pod_labels}, "annotations": annotations},
        "spec": pod_spec,
    }


def deployment(model: ModelSpec, config: OperatorConfig) -> dict[str, Any]:
    """One pod per data-parallel replica.

    On GPUs a rollout replaces pods one at a time without surging (a surge pod would wait for a GPU that
    the old pod holds); on CPU it surges one pod so serving capacity never dips."""
    if model.accelerator == "nvidia":
        rolling = {"maxSurge": 0, "maxUnavailable": 1}
    else:
        rolling = {"maxSurge": 1, "maxUnavailable": 0}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(model),
        "spec": {
            "replicas": model.replicas,
            "selector": {"matchLabels": selector_labels(model)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling},
            "revisionHistoryLimit": 3,
            # Progressing turns False (ProgressDeadlineExceeded) only after a replica had its full load time.
            "progressDeadlineSeconds": model.startup_timeout_seconds + 600,
            "template": pod_template(model, config),
        },
    }


def service(model: ModelSpec) -> dict[str, Any]:
    """Headless: gives every replica a DNS name; routing itself goes through the gateway, not the Service."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(model),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(model),
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}],
            "publishNotReadyAddresses": False,
        },
    }


def model_document(model: ModelSpec, config: OperatorConfig) -> dict[str, Any]:
    """The resolved model configuration, as stored in the ConfigMap (``model.json``)."""
    return {
        "name": model.name,
        "namespace": model.namespace,
        "servedName": model.served_name,
        "modelUri": _uri(model),
        "tokenizer": model.tokenizer,
        "routingPolicy": model.routing_policy,
        "allowedTenants": None if model.allowed_tenants is None else list(model.allowed_tenants),
        "sleep": {"idleSeconds": model.sleep_idle_seconds, "level": model.sleep_level},
        "blockSize": model.engine.block_size,
        "accelerator": model.accelerator,
        "acceleratorsPerReplica": model.engine.accelerators_per_pod if model.accelerator == "nvidia" else 0,
        "image": engine_image(model, config),
        "engineArgs": engine_args(model),
        "service": f"{model.name}.{model.namespace}.svc",
        "port": ENGINE_PORT,
    }


def _uri(model: ModelSpec) -> str:
    s = model.source
    if s.scheme == "pvc":
        return f"pvc://{s.claim}/{s.path}".rstrip("/")
    if s.scheme == "hf":
        return f"hf://{s.repo}" + (f"@{s.revision}" if s.revision else "")
    return f"file://{s.path}"


def config_map(model: ModelSpec, config: OperatorConfig) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(model),
        "data": {"model.json": json.dumps(model_document(model, config), indent=2, sort_keys=True) + "\n"},
    }


def credentials_secret(model: ModelSpec, config: OperatorConfig) -> dict[str, Any]:
    """The model's engine credentials, in its namespace (Secrets cannot be referenced across namespaces): the
    Redis URL, and the model's own replica key and admin token; the platform admin token only without a root."""

    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    key = model_key(model, config)
    if key is None:
        own = {CREDENTIALS_TOKEN_KEY: b64(config.admin_token)}
    else:
        own = {
            CREDENTIALS_REPLICA_KEY: b64(key.hex()),
            CREDENTIALS_TOKEN_KEY: b64(replica_credentials.engine_admin_token(key)),
        }
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(model, credentials_secret_name(model)),
        "type": "Opaque",
        "data": {CREDENTIALS_REDIS_KEY: b64(config.redis_url), **own},
    }


def pod_disruption_budget(model: ModelSpec) -> dict[str, Any]:
    """At most one replica voluntarily evicted at a time; crash-looping pods never block a node drain."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(model),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(model)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def network_policy(model: ModelSpec, config: OperatorConfig) -> dict[str, Any]:
    """The engine pods accept connections (inference and the admin endpoints: sleep, wake_up) only from
    engine clients in the operator's namespace and the configured extra peers. Wherever the model lives:
    NetworkPolicies are namespaced, so a policy in the platform's namespace would not cover it."""
    peers: list[dict[str, Any]] = [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": config.namespace}},
            "podSelector": {"matchLabels": {ENGINE_CLIENT_LABEL: "true"}},
        },
        *copy.deepcopy(list(config.engine_ingress_from)),
    ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(model),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(model)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": ENGINE_PORT}]}],
        },
    }


def children(model: ModelSpec, config: OperatorConfig) -> list[dict[str, Any]]:
    """Everything the model owns, in apply order (what the pods reference, and the NetworkPolicy that
    guards them, come before the Deployment)."""
    return [
        credentials_secret(model, config),
        config_map(model, config),
        service(model),
        pod_disruption_budget(model),
        *([network_policy(model, config)] if config.engine_network_policy else []),
        deployment(model, config),
    ]
