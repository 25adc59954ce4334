"""Engine configuration: what the user asked for (``EngineArgs``), checked against what the model directory
holds, with every ``None`` and ``auto`` resolved."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvfleet_engine.device import canonical_device, cuda_index
from kvfleet_engine.engine_args import (
    DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_GPU_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_SIMULATED_KV_BLOCKS,
    EngineArgs,
    SimulationCost,
)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, model_dtype: str | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # CPU matmuls are fastest and exact in float32; on GPU follow the checkpoint (fp32 -> bf16).
        if device == "cpu":
            return torch.float32
        d = _DTYPES.get(model_dtype or "bfloat16", torch.bfloat16)
        return torch.bfloat16 if d == torch.float32 else d
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


@dataclass(slots=True)
class ModelConfig:
    """The fields of a Llama-family ``config.json`` the engine uses (read without transformers)."""

    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    torch_dtype: str | None
    eos_token_ids: frozenset[int]
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"{path} is not a model directory: no config.json")
        raw = json.loads(cfg_file.read_text())
        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError(f"{cfg_file}: 'architectures' is missing")
        heads = raw["num_attention_heads"]
        # transformers 5 nests rope settings in rope_parameters; older configs use rope_theta/rope_scaling.
        rope = raw.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_scaling = raw.get("rope_scaling") or (
            {k: v for k, v in rope.items() if k != "rope_theta"} or None
        )
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        model_type = raw.get("model_type", "")
        attention_bias = bool(raw.get("attention_bias", model_type == "qwen2"))
        sliding = raw.get("sliding_window")
        if model_type == "qwen2" and not raw.get("use_sliding_window", False):
            sliding = None
        return cls(
            path=path,
            architecture=archs[0],
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            sliding_window=sliding,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_ids=_eos_ids(path, raw),
            raw=raw,
        )


def _eos_ids(path: Path, raw: dict[str, Any]) -> frozenset[int]:
    ids: set[int] = set()
    for source in (raw, _read_json(path / "generation_config.json")):
        eos = source.get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return frozenset(ids)


def _read_json(p: Path) -> dict[str, Any]:
    return json.loads(p.read_text()) if p.is_file() else {}


def _check_parallel(mc: ModelConfig, device: str, tp: int, pp: int, backend: str | None) -> str:
    """Reject TP/PP sizes the model cannot be split by, with the reason; returns the executor backend."""
    for name, size in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{name} must be a positive integer, got {size!r}")
    if mc.num_attention_heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide the model's {mc.num_attention_heads} attention heads"
        )
    kv = mc.num_key_value_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise ValueError(
            f"tensor_parallel_size={tp} and the model's {kv} KV heads must divide one another "
            "(KV heads are split across ranks, or replicated when there are fewer than ranks)"
        )
    if mc.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the MLP size {mc.intermediate_size}")
    if pp > mc.num_hidden_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp} exceeds the model's {mc.num_hidden_layers} layers "
            "(every stage needs at least one)"
        )
    world = tp * pp
    if device.startswith("cuda"):
        available = torch.cuda.device_count()
        first = cuda_index(device)
        if first + world > available:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size = {world} needs {world} GPUs from {device}, "
                f"found {available - first}"
            )
    if backend is None:
        backend = "uni" if world == 1 else "mp"
    if backend not in ("uni", "mp"):
        raise ValueError(f"distributed_executor_backend must be 'uni' or 'mp', got {backend!r}")
    if backend == "uni" and world > 1:
        raise ValueError(f"{world} ranks (TP x PP) need distributed_executor_backend='mp'")
    return backend


def _check_simulation(
    simulation: SimulationCost | dict[str, float],
    device: str,
    num_kv_blocks: int | None,
    kv_cache_memory_bytes: int | None,
    tp: int,
    pp: int,
    backend: str | None,
) -> tuple[SimulationCost, str, int]:
    """A simulated replica is one process on the CPU with a given number of KV blocks."""
    if isinstance(simulation, dict):
        try:
            simulation = SimulationCost(**simulation)
        except TypeError as e:
            raise ValueError(f"bad simulation costs: {e}") from None
    if not isinstance(simulation, SimulationCost):
        raise ValueError(f"simulation must be a SimulationCost or a dict of its fields, got {simulation!r}")
    if device not in ("auto", "cpu"):
        raise ValueError(f"a simulated replica runs on the CPU (device='cpu'), got device={device!r}")
    if tp != 1 or pp != 1 or backend not in (None, "uni"):
        raise ValueError("a simulated replica is one process: no tensor/pipeline parallelism")
    if kv_cache_memory_bytes is not None:
        raise ValueError("a simulated replica has no KV memory to size: give num_kv_blocks instead")
    return simulation, "cpu", DEFAULT_SIMULATED_KV_BLOCKS if num_kv_blocks is None else num_kv_blocks


@dataclass(slots=True)
class EngineConfig:
    """The engine's settings, checked and resolved (no ``None`` or ``auto`` left where the engine needs a
    value). Invariant: built by :meth:`create` from an ``EngineArgs``, which holds the defaults."""

    model: ModelConfig
    dtype: torch.dtype
    device: str
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_kv_blocks: int | None
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    scheduling_policy: str
    seed: int
    attention_backend: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    # "uni": the worker runs in the engine's process; "mp": one process per TP x PP rank.
    distributed_executor_backend: str
    # Decode steps on CUDA replay captured graphs (worker/cuda_graph.py) unless this is set.
    enforce_eager: bool
    # Set: a simulated replica (executor/simulated.py): real scheduler and KV cache, no model, a timing model.
    simulation: SimulationCost | None
    # Schedule step n+1 while step n runs (EngineCore._step_async); one rank, in-process worker only.
    async_scheduling: bool = False

    @classmethod
    def create(cls, args: EngineArgs) -> EngineConfig:
        """Check ``args`` against the model directory; raises ValueError with a message fit for a user.

        ``args.simulation`` (a ``SimulationCost`` or its fields as a dict) makes a simulated replica: the
        model directory still gives the tokenizer, vocabulary and chat template, but no weights are
        loaded. It runs on "cpu" in one process, takes ``num_kv_blocks`` (default
        ``DEFAULT_SIMULATED_KV_BLOCKS``) instead of measuring memory, has a GPU replica's default
        ``max_num_batched_tokens``, and may use a ``max_model_len`` beyond the model's position limit,
        since no positions are ever computed.
        """
        mc = ModelConfig.from_dir(args.model)
        simulation, device, num_kv_blocks = args.simulation, args.device, args.num_kv_blocks
        attention_backend = args.attention_backend
        if simulation is not None:
            simulation, device, num_kv_blocks = _check_simulation(
                simulation, device, num_kv_blocks, args.kv_cache_memory_bytes,
                args.tensor_parallel_size, args.pipeline_parallel_size, args.distributed_executor_backend,
            )  # fmt: skip
            attention_backend = "torch"
        device = canonical_device(device, torch.cuda.device_count())
        block_size, max_num_seqs = args.block_size, args.max_num_seqs
        if block_size <= 0 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {block_size}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        limit = mc.max_position_embeddings
        if mc.sliding_window is not None:
            limit = min(limit, mc.sliding_window)  # no sliding-window attention: stay inside the window
        max_model_len = args.max_model_len
        if max_model_len is None:
            max_model_len = limit
        elif max_model_len > limit and simulation is None:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds what the model supports ({limit}"
                f"{', its sliding window' if mc.sliding_window is not None else ''})"
            )
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        max_num_batched_tokens = args.max_num_batched_tokens
        if max_num_batched_tokens is None:
            # A simulated replica models a GPU one, so it gets the GPU's budget.
            on_cpu = device == "cpu" and simulation is None
            max_num_batched_tokens = (
                DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS if on_cpu else DEFAULT_GPU_MAX_NUM_BATCHED_TOKENS
            )
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if num_kv_blocks is not None and args.kv_cache_memory_bytes is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory_bytes, not both")
        if num_kv_blocks is not None and num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {num_kv_blocks}")
        if attention_backend == "auto":
            attention_backend = "triton" if device.startswith("cuda") else "torch"
        if attention_backend not in ("torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {attention_backend!r}")
        tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
        distributed_executor_backend = _check_parallel(mc, device, tp, pp, args.distributed_executor_backend)
        if args.async_scheduling and distributed_executor_backend != "uni":
            raise ValueError(
                "async_scheduling needs one rank with the worker in the engine's process "
                "(no tensor/pipeline parallelism, no 'mp' executor)"
            )
        return cls(
            model=mc,
            dtype=resolve_dtype(args.dtype, mc.torch_dtype, device),
            device=device,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
            scheduling_policy=args.scheduling_policy,
            seed=args.seed,
            attention_backend=attention_backend,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            distributed_executor_backend=distributed_executor_backend,
            enforce_eager=bool(args.enforce_eager),
            simulation=simulation,
            async_scheduling=bool(args.async_scheduling),
        )

    @property
    def kv_bytes_per_block(self) -> int:
        m = self.model
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * m.num_hidden_layers * self.block_size * m.num_key_value_heads * m.head_dim * elem
