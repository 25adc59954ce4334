"""The one table between an InferenceModel's engine settings (``spec.engine.<camelCase>``) and the engine's
own settings (the fields of ``kvfleet_engine.engine_args.EngineArgs``, which hold the defaults and the
command-line spelling).

`spec.py` parses ``spec.engine`` through it, `manifests.py` renders the engine's command line from what it
parsed (with ``EngineArgs.cli_args``), `validation.py` names the fields in the CEL rules' twins with it and
`crds.py` takes the CRD's defaults from the engine through it. Every EngineArgs field is in the table, in
`SET_BY_OPERATOR` or in `NOT_IN_CRD`, each with its reason; every other property of ``spec.engine`` is in
`NOT_ENGINE_SETTINGS`. A test (tests/operator/test_operator_engine_fields.py) checks all of it against the
CRD and the engine's parser, so a new engine flag cannot silently miss the CRD.

``kvfleet_engine.engine_args`` imports no torch: the operator's image has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfleet_engine.engine_args import EngineArgs


@dataclass(frozen=True, slots=True)
class EngineField:
    crd: str  # the property of spec.engine
    arg: str  # the EngineArgs field it sets
    # The CRD takes a Kubernetes quantity ("8Gi", or an integer), EngineArgs a number of bytes.
    bytes_quantity: bool = False


ENGINE_FIELDS = (
    EngineField("tensorParallelSize", "tensor_parallel_size"),
    EngineField("pipelineParallelSize", "pipeline_parallel_size"),
    EngineField("dtype", "dtype"),
    EngineField("maxModelLen", "max_model_len"),
    EngineField("maxNumSeqs", "max_num_seqs"),
    EngineField("maxNumBatchedTokens", "max_num_batched_tokens"),
    EngineField("blockSize", "block_size"),
    EngineField("kvCacheMemory", "kv_cache_memory_bytes", bytes_quantity=True),
    EngineField("gpuMemoryUtilization", "gpu_memory_utilization"),
    EngineField("enablePrefixCaching", "enable_prefix_caching"),
    EngineField("enforceEager", "enforce_eager"),
    EngineField("seed", "seed"),
)
BY_CRD = {f.crd: f for f in ENGINE_FIELDS}
BY_ARG = {f.arg: f for f in ENGINE_FIELDS}

# EngineArgs fields the operator sets on every replica from the rest of the spec.
SET_BY_OPERATOR = {
    "model": "the directory spec.model.uri is mounted or downloaded at (ModelSource.model_dir)",
    "device": "from spec.accelerator: cuda for nvidia, cpu for cpu",
    "scheduling_policy": "always priority: the tenants' priorities the gateway forwards order work only so",
}
# EngineArgs fields no InferenceModel field sets (spec.engine.extraArgs still may, where there is a flag).
NOT_IN_CRD = {
    "num_kv_blocks": "the cache is sized in bytes (kvCacheMemory) or by gpuMemoryUtilization; a block "
    "count depends on the model's shape",
    "attention_backend": "auto picks the kernels for the device (extraArgs may override it)",
    "distributed_executor_backend": "no flag: the engine picks uni or mp from TP x PP",
    "simulation": "a simulated replica is for benchmarks and gateway tests, not for serving a model",
    "async_scheduling": "off until measured on a GPU, and one-rank only: extraArgs ['--async-scheduling'] "
    "turns it on for a model",
}
# Properties of spec.engine that are not engine settings.
NOT_ENGINE_SETTINGS = {
    "image": "the container image",
    "imagePullPolicy": "the container's image pull policy",
    "extraArgs": "appended verbatim to the engine's command line",
    "env": "the container's extra environment variables",
}


def crd_name(arg: str) -> str:
    """The spec.engine property that sets EngineArgs field ``arg``."""
    return BY_ARG[arg].crd


def engine_default(crd: str) -> Any:
    """What the engine does when spec.engine.<crd> is absent: the CRD's default for it, where it has one."""
    return EngineArgs.default_of(BY_CRD[crd].arg)
