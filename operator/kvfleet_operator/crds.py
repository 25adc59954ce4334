"""The kvfleet CustomResourceDefinitions, built in Python: the one source for `crds/*.yaml`,
the Helm chart's `crds/` and the operator's own admission-equivalent validation.

`crds/` and `charts/kvfleet/crds/` hold the rendered YAML (`kvfleet operator crds --out DIR` writes it);
a test keeps them identical to what this module builds.

Every CEL rule (`x-kubernetes-validations`) here has a Python twin in `validation.py`, because clusters
evaluate CEL but the test emulator and `jsonschema` do not. The defaults of the engine settings in
``spec.engine`` are the engine's (`engine_fields.engine_default`).
"""

from __future__ import annotations

import re

from kvfleet_operator.crd_autoscaling import (
    AUTOSCALING_ZERO_AFTER_SLEEP_MESSAGE,
    autoscaling_spec_schema,
    autoscaling_status_schema,
)
from kvfleet_operator.engine_fields import engine_default
from kvfleet_operator.openapi_schema import (
    byte_quantity,
    conditions_schema,
    free_object,
    integer,
    quantity,
    resource_schema,
    string,
)

GROUP = "kvfleet.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

MODEL_KIND = "InferenceModel"
MODEL_PLURAL = "inferencemodels"
TENANT_KIND = "Tenant"
TENANT_PLURAL = "tenants"

MAX_ACCELERATORS_PER_POD = 8
MODEL_URI_PATTERN = (
    r"^(pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?|hf://[^/@\s]+/[^/@\s]+(@[^@\s]+)?|file:///.*)$"
)
ROUTING_POLICIES = ("prefix-aware", "least-load", "round-robin")
# Model and tenant names as the Redis contract accepts them (kvfleet_common.redis_keys.check_name).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/@+=-]*$"
# DNS-1123 names, as Kubernetes requires them of namespaces (a label) and Secrets (a subdomain).
DNS_1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
# InferenceModel names: its Service takes the name (a DNS-1035 label), and the pods of its Deployment
# append up to 17 characters of hashes to it.
MAX_MODEL_NAME = 46
DNS_1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
MODEL_NAME_MESSAGE = (
    f"metadata.name must be a DNS-1035 label of at most {MAX_MODEL_NAME} characters (lower-case letters, "
    "digits and '-', starting with a letter): it names the model's Service and Deployment"
)
# Every flag of `kvfleet engine serve` that the operator sets (`manifests.engine_args`, and the environment
# it passes the Redis URL, admin token, replica name and base URL in): spec.engine.extraArgs may not set
# one, nor an abbreviation argparse would expand to one (`--tensor-parallel 4`, `-t 4`).
MANAGED_ENGINE_FLAGS = (
    "--model",
    "--host",
    "--port",
    "--served-model-name",
    "--dtype",
    "--device",
    "--block-size",
    "--tensor-parallel-size",
    "-tp",
    "--pipeline-parallel-size",
    "-pp",
    "--scheduling-policy",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--max-model-len",
    "--kv-cache-memory-bytes",
    "--gpu-memory-utilization",
    "--seed",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--enforce-eager",
    "--shutdown-timeout",
    "--redis-url",
    "--admin-token",
    "--replica-name",
    "--base-url",
)
EXTRA_ARGS_MESSAGE = (
    "extraArgs may not set a flag the operator sets from the spec, nor an abbreviation of one: "
    + ", ".join(MANAGED_ENGINE_FLAGS)
)
DTYPES = ("auto", "float32", "float16", "bfloat16")
ACCELERATORS = ("nvidia", "cpu")
PHASES = ("Pending", "Progressing", "Ready", "Sleeping", "ScaledToZero", "Degraded", "Failed")
CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Sleeping")


def _prefix_regex(words: list[str]) -> str:
    """RE2 matching every non-empty prefix of ``words``: a trie, so shared prefixes are written once."""
    trie: dict = {}
    for word in words:
        assert re.fullmatch(r"[a-z0-9-]+", word), word
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})

    def render(node: dict) -> str:
        # Flags are letters, digits and '-': nothing to escape (and CEL strings take no '\\-').
        alternatives = [ch + (f"({render(child)})?" if child else "") for ch, child in node.items()]
        return alternatives[0] if len(alternatives) == 1 else "(" + "|".join(alternatives) + ")"

    return render(trie)


def managed_flag_regex() -> str:
    """An engine argument that sets a flag of MANAGED_ENGINE_FLAGS, as argparse reads it: the flag or a
    prefix of it (argparse expands unique prefixes), alone or with ``=value``; a short option may also
    carry its value joined (``-tp4``)."""
    long = [f[2:] for f in MANAGED_ENGINE_FLAGS if f.startswith("--")]
    short = [f[1:] for f in MANAGED_ENGINE_FLAGS if not f.startswith("--")]
    return f"^(--{_prefix_regex(long)}(=.*)?|-{_prefix_regex(short)}(=.*)?|-({'|'.join(short)}).+)$"


def _engine_schema() -> dict:
    """spec.engine: its engine settings are EngineArgs fields (`engine_fields` maps the names), and their
    defaults here are the engine's own."""
    return {
        "type": "object",
        "description": "How each replica's `kvfleet engine serve` runs.",
        "default": {},
        "properties": {
            "image": string("Engine container image (defaults to the operator's --engine-image)."),
            "imagePullPolicy": {"type": "string", "enum": ["Always", "IfNotPresent", "Never"]},
            "tensorParallelSize": integer(
                1,
                MAX_ACCELERATORS_PER_POD,
                engine_default("tensorParallelSize"),
                description="TP ranks per replica.",
            ),
            "pipelineParallelSize": integer(
                1,
                MAX_ACCELERATORS_PER_POD,
                engine_default("pipelineParallelSize"),
                description="PP stages per replica.",
            ),
            "dtype": {"type": "string", "enum": list(DTYPES), "default": engine_default("dtype")},
            "maxModelLen": integer(
                1, description="Longest prompt + output in tokens (default: the model's)."
            ),
            "maxNumSeqs": integer(1, 65536, description="Most sequences in one scheduler step."),
            "maxNumBatchedTokens": integer(1, description="Token budget of one scheduler step."),
            "blockSize": integer(
                1,
                256,
                engine_default("blockSize"),
                description="Tokens per KV-cache block (the prefix-cache unit).",
            ),
            "kvCacheMemory": byte_quantity(
                "KV-cache size: a positive quantity (e.g. 8Gi) or a number of bytes; excludes "
                "gpuMemoryUtilization."
            ),
            "gpuMemoryUtilization": {
                "type": "number",
                "description": "Fraction of GPU memory for weights + KV cache; excludes kvCacheMemory.",
                "exclusiveMinimum": True,
                "minimum": 0,
                "maximum": 1,
            },
            "enablePrefixCaching": {"type": "boolean", "default": engine_default("enablePrefixCaching")},
            "enforceEager": {
                "type": "boolean",
                "default": engine_default("enforceEager"),
                "description": "Run every decode step eagerly, without CUDA graphs (slower; for debugging).",
            },
            "seed": integer(0, description="Sampling seed of the engine."),
            "extraArgs": {
                "type": "array",
                "description": "Appended verbatim to the engine's command line; flags the operator sets "
                "from the spec are refused.",
                "maxItems": 64,
                "items": {
                    "type": "string",
                    "maxLength": 1024,
                    "x-kubernetes-validations": [
                        {"rule": f"!self.matches('{managed_flag_regex()}')", "message": EXTRA_ARGS_MESSAGE}
                    ],
                },
            },
            "env": {
                "type": "array",
                "description": "Extra environment variables (core/v1 EnvVar).",
                "maxItems": 64,
                "items": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {"type": "string", "minLength": 1}},
                    "x-kubernetes-preserve-unknown-fields": True,
                },
            },
        },
        "x-kubernetes-validations": [
            {
                "rule": "!(has(self.kvCacheMemory) && has(self.gpuMemoryUtilization))",
                "message": "kvCacheMemory and gpuMemoryUtilization are mutually exclusive",
            },
            {
                "rule": "self.tensorParallelSize * self.pipelineParallelSize <= 8",
                "message": "tensorParallelSize × pipelineParallelSize must be at most 8 accelerators per pod",
            },
            {
                "rule": "!has(self.maxNumBatchedTokens) || !has(self.maxNumSeqs) "
                "|| self.maxNumBatchedTokens >= self.maxNumSeqs",
                "message": "maxNumBatchedTokens must be at least maxNumSeqs",
            },
        ],
    }


def inference_model_schema() -> dict:
    """OpenAPI v3 (structural) schema of InferenceModel."""
    spec = {
        "type": "object",
        "required": ["model"],
        "properties": {
            "model": {
                "type": "object",
                "required": ["uri"],
                "properties": {
                    "uri": string(
                        "Where the weights are: pvc://claim/path, hf://org/name[@revision] or file:///path.",
                        pattern=MODEL_URI_PATTERN,
                        maxLength=1024,
                    ),
                    "servedName": string(
                        "The OpenAI model id clients ask for (default: metadata.name).",
                        minLength=1,
                        maxLength=253,
                        pattern=NAME_PATTERN,
                    ),
                    "tokenizer": string("Tokenizer directory or URI if not the model's.", maxLength=1024),
                },
            },
            "engine": _engine_schema(),
            "replicas": integer(
                0, 1024, 1, description="Data-parallel replicas (one pod each); ignored with autoscaling."
            ),
            "accelerator": {
                "type": "string",
                "enum": list(ACCELERATORS),
                "default": "nvidia",
                "description": "nvidia: each pod requests nvidia.com/gpu = TP×PP; cpu: no GPU.",
            },
            "resources": {
                "type": "object",
                "description": "core/v1 ResourceRequirements of the engine container.",
                "properties": {
                    "limits": {"type": "object", "additionalProperties": quantity("Resource limit.")},
                    "requests": {"type": "object", "additionalProperties": quantity("Resource request.")},
                },
            },
            "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
            "tolerations": {
                "type": "array",
                "items": free_object("core/v1 Toleration."),
            },
            "affinity": free_object("core/v1 Affinity."),
            "priorityClassName": string("PriorityClass of the engine pods.", maxLength=253),
            "terminationGracePeriodSeconds": integer(
                0, 86400, 120, description="How long a stopping replica may finish in-flight requests."
            ),
            "startupTimeoutSeconds": integer(
                60, 86400, 1800, description="How long a replica may take to load its model."
            ),
            "sleep": {
                "type": "object",
                "default": {},
                "properties": {
                    "idleSeconds": integer(
                        0, description="Sleep replicas after this long without requests; 0 never.", default=0
                    ),
                    "level": integer(1, 2, 1, description="1: offload weights to host; 2: discard weights."),
                },
            },
            "autoscaling": autoscaling_spec_schema(),
            "routing": {
                "type": "object",
                "default": {},
                "properties": {
                    "policy": {"type": "string", "enum": list(ROUTING_POLICIES), "default": "prefix-aware"},
                },
            },
            "access": {
                "type": "object",
                "properties": {
                    "tenants": {
                        "type": "array",
                        "description": "Only these tenants may use the model (absent: every tenant whose "
                        "model globs match).",
                        "maxItems": 1024,
                        "items": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": 253,
                            "pattern": NAME_PATTERN,
                        },
                    },
                },
            },
        },
        "x-kubernetes-validations": [
            {
                "rule": "!(self.accelerator == 'cpu' && has(self.engine.gpuMemoryUtilization))",
                "message": "gpuMemoryUtilization needs accelerator nvidia; size the cache with kvCacheMemory on cpu",
            },
            {
                "rule": "!has(self.autoscaling) || self.autoscaling.minReplicas > 0 || self.sleep.idleSeconds == 0 "
                "|| self.autoscaling.scaleToZeroAfterSeconds > self.sleep.idleSeconds",
                "message": AUTOSCALING_ZERO_AFTER_SLEEP_MESSAGE,
            },
        ],
    }
    status = {
        "type": "object",
        "properties": {
            "observedGeneration": integer(0, format="int64"),
            "phase": {"type": "string", "enum": list(PHASES)},
            "servedName": {"type": "string"},
            "selector": {"type": "string", "description": "Label selector of the pods (for /scale)."},
            "replicas": integer(0),
            "readyReplicas": integer(0),
            "awakeReplicas": integer(0),
            "sleepingReplicas": integer(0),
            "lastActivity": {"type": "string", "format": "date-time"},
            "autoscaling": autoscaling_status_schema(),
            "conditions": conditions_schema(),
        },
    }
    name_rule = {
        "rule": f"size(self.metadata.name) <= {MAX_MODEL_NAME} "
        f"&& self.metadata.name.matches('{DNS_1035_LABEL}')",
        "message": MODEL_NAME_MESSAGE,
    }
    return resource_schema(spec, status, [name_rule])


def tenant_schema() -> dict:
    """OpenAPI v3 (structural) schema of Tenant."""
    spec = {
        "type": "object",
        "required": ["apiKeySecretRef"],
        "properties": {
            "apiKeySecretRef": {
                "type": "object",
                "required": ["name"],
                "description": "The Secret holding the tenant's API key; only its SHA-256 reaches Redis.",
                "properties": {
                    "name": string("Secret name.", minLength=1, maxLength=253, pattern=DNS_1123_SUBDOMAIN),
                    "namespace": string(
                        "Secret namespace (default: the operator's namespace); the operator must be allowed "
                        "to read Secrets there (the Helm chart: the release namespace and "
                        "operator.tenantSecretNamespaces).",
                        minLength=1,
                        maxLength=63,
                        pattern=DNS_1123_LABEL,
                    ),
                    "key": string(
                        "Key inside the Secret.",
                        default="apiKey",
                        minLength=1,
                        maxLength=253,
                        pattern=SECRET_KEY_PATTERN,
                    ),
                },
            },
            "models": {
                "type": "array",
                "description": "Glob patterns of the served model names this tenant may use.",
                "default": ["*"],
                "maxItems": 256,
                "items": {"type": "string", "minLength": 1, "maxLength": 256, "pattern": r"^\S+$"},
            },
            "limits": {
                "type": "object",
                "default": {},
                "description": "0 or absent: unlimited.",
                "properties": {
                    "requestsPerMinute": integer(0),
                    "tokensPerMinute": integer(0),
                    "maxConcurrent": integer(0),
                },
            },
            "priority": integer(0, 1000, 0, description="Higher is served first under contention."),
            "cacheSalt": string(
                "Isolates this tenant's prefix cache (empty: shared with every unsalted tenant).",
                maxLength=256,
            ),
        },
    }
    status = {
        "type": "object",
        "properties": {
            "observedGeneration": integer(0, format="int64"),
            "phase": {"type": "string", "enum": ["Active", "Failed"]},
            "conditions": conditions_schema(),
        },
    }
    return resource_schema(spec, status)


def _crd(
    *,
    kind: str,
    plural: str,
    singular: str,
    scope: str,
    short_names: list[str],
    schema: dict,
    columns: list[dict],
    subresources: dict,
) -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{GROUP}",
            "labels": {"app.kubernetes.io/part-of": "kvfleet"},
        },
        "spec": {
            "group": GROUP,
            "scope": scope,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": singular,
                "shortNames": short_names,
                "categories": ["kvfleet"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": subresources,
                    "additionalPrinterColumns": columns,
                }
            ],
        },
    }


def inference_model_crd() -> dict:
    return _crd(
        kind=MODEL_KIND,
        plural=MODEL_PLURAL,
        singular="inferencemodel",
        scope="Namespaced",
        short_names=["im"],
        schema=inference_model_schema(),
        columns=[
            {"name": "Model", "type": "string", "jsonPath": ".status.servedName"},
            {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
            # with spec.autoscaling, spec.replicas is ignored: this is what the autoscaler asks for
            {"name": "Autoscaled", "type": "integer", "jsonPath": ".status.autoscaling.desiredReplicas"},
            {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
            {"name": "Awake", "type": "integer", "jsonPath": ".status.awakeReplicas"},
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
        subresources={
            "status": {},
            "scale": {
                "specReplicasPath": ".spec.replicas",
                "statusReplicasPath": ".status.replicas",
                "labelSelectorPath": ".status.selector",
            },
        },
    )


def tenant_crd() -> dict:
    return _crd(
        kind=TENANT_KIND,
        plural=TENANT_PLURAL,
        singular="tenant",
        scope="Cluster",
        short_names=["kvt"],
        schema=tenant_schema(),
        columns=[
            {"name": "Priority", "type": "integer", "jsonPath": ".spec.priority"},
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
        subresources={"status": {}},
    )


def _kopf_peering_crd(kind: str, plural: str, scope: str) -> dict:
    """kopf's peering resource: operator replicas announce themselves in its status; only the
    highest-priority live one acts. The schema keeps whatever kopf writes."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.kopf.dev", "labels": {"app.kubernetes.io/part-of": "kvfleet"}},
        "spec": {
            "group": "kopf.dev",
            "scope": scope,
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                            },
                        }
                    },
                }
            ],
        },
    }


def all_crds() -> dict[str, dict]:
    """File name -> CRD, in the order they are written."""
    return {
        "inferencemodels.yaml": inference_model_crd(),
        "tenants.yaml": tenant_crd(),
        "kopf-clusterkopfpeerings.yaml": _kopf_peering_crd(
            "ClusterKopfPeering", "clusterkopfpeerings", "Cluster"
        ),
        "kopf-kopfpeerings.yaml": _kopf_peering_crd("KopfPeering", "kopfpeerings", "Namespaced"),
    }
