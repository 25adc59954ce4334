"""Every engine setting, written once: ``EngineArgs``.

Each field of :class:`EngineArgs` carries its type (the annotation), its default and its help, plus in
its metadata how the command line spells it (aliases such as ``-tp``, choices, a group). From that one
declaration come the flags of ``kvfleet engine serve`` / ``kvfleet generate`` (:meth:`add_cli_args`,
:meth:`from_cli_args`), the keyword arguments of ``LLM(model, **kwargs)``, what ``EngineConfig.create``
checks and resolves (``kvfleet_engine.config``), and the operator's ``spec.engine`` fields
(``kvfleet_operator.engine_fields`` maps them; its defaults are these).

Command-line spelling: a field ``max_num_seqs`` is ``--max-num-seqs``; a bool is a switch that flips its
default (``--enforce-eager`` when it defaults to False, ``--no-enable-prefix-caching`` when it defaults to
True); ``simulation`` is the ``--simulate`` switch with one ``--sim-*`` flag per :class:`SimulationCost`
field. A field whose metadata says ``enabled=False`` has no flag (the reason is in its help).

Invariant: torch-free, importing only the standard library (the operator, which has no torch, imports it).
"""

from __future__ import annotations

import argparse
import functools
import math
import typing
from collections.abc import Mapping
from dataclasses import KW_ONLY, MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any

# KV blocks of a simulated replica when num_kv_blocks is not given (there is no device memory to measure).
DEFAULT_SIMULATED_KV_BLOCKS = 4096
# max_num_batched_tokens when not given: the real engine on the CPU, and a GPU (or a simulated replica,
# which models a GPU one).
DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_GPU_MAX_NUM_BATCHED_TOKENS = 8192


def cli(
    help: str,
    *,
    flags: tuple[str, ...] = (),
    choices: tuple[str, ...] | None = None,
    group: tuple[str, str] | None = None,
    enabled: bool = True,
) -> dict[str, Any]:
    """Field metadata: what a setting's command-line flag needs.

    ``flags`` are aliases after the generated ``--long-name`` (for a switch: its one spelling, replacing the
    generated one); ``group`` is (title, description) of the argparse group the flags go in;
    ``enabled=False``: no flag at all (``help`` says why)."""
    return {"help": help, "flags": flags, "choices": choices, "group": group, "cli": enabled}


@dataclass(slots=True, frozen=True)
class SimulationCost:
    """What one engine step costs on the simulated device, in milliseconds.

    The defaults model a small model on one GPU: prefill at 20k tokens/s (a 2,000-token prompt takes
    ~100 ms) and a 15 ms decode step, plus a little per decoding sequence. All zero gives a replica
    whose steps cost only the engine's own bookkeeping (for measuring the gateway's overhead).
    """

    prefill_ms_per_1k_tokens: float = field(
        default=50.0, metadata=cli(help="cost of 1,000 uncached prompt tokens, in ms")
    )
    decode_ms_per_step: float = field(
        default=15.0, metadata=cli(help="cost of a step in which any sequence decodes, in ms")
    )
    decode_ms_per_seq: float = field(
        default=0.1, metadata=cli(help="extra cost per decoding sequence in a step, in ms")
    )
    step_overhead_ms: float = field(
        default=1.0, metadata=cli(help="fixed cost of every step that computes something, in ms")
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"simulation cost {f.name} must be a finite number >= 0, got {v!r}")


# The --sim-* flags of SimulationCost's fields.
_SIMULATION_FLAG_PREFIX = "--sim-"


@dataclass(slots=True, frozen=True)
class EngineArgs:
    """What the user asks of the engine, unchecked; ``EngineConfig.create(args)`` checks it against the
    model directory and resolves the ``None``s and ``auto``s.

    The field order is the order of the flags in ``--help``. Every field but ``model`` is keyword-only."""

    model: str | Path = field(metadata=cli(help="HF model directory"))
    _: KW_ONLY
    dtype: str = field(
        default="auto",
        metadata=cli(
            help="weights and activations: auto (float32 on the CPU; on a GPU the checkpoint's, bfloat16 for a "
            "float32 one), float32, bfloat16 or float16 (aliases: float, fp32, bf16, half, fp16)",
        ),
    )
    device: str = field(
        default="auto", metadata=cli(help="auto, cpu, cuda or cuda:N (auto: cuda when there is a GPU)")
    )
    block_size: int = field(
        default=16, metadata=cli(help="tokens per KV-cache block, a power of two (the prefix-cache unit)")
    )
    max_num_seqs: int = field(default=256, metadata=cli(help="most sequences in one scheduler step"))
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata=cli(
            help=f"token budget of one scheduler step (default: {DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS} on the CPU, "
            f"{DEFAULT_GPU_MAX_NUM_BATCHED_TOKENS} on a GPU or with --simulate)",
        ),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=cli(help="longest prompt + output in tokens (default: the model's position limit)"),
    )
    num_kv_blocks: int | None = field(
        default=None,
        metadata=cli(
            help=f"KV cache size in blocks (default: from memory; {DEFAULT_SIMULATED_KV_BLOCKS} with --simulate)",
        ),
    )
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata=cli(
            help="KV cache size in bytes (default: from --gpu-memory-utilization on a GPU; a fixed budget "
            "on the CPU)",
        ),
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata=cli(help="reuse the KV blocks of the prompt prefixes requests share"),
    )
    seed: int = field(
        default=0, metadata=cli(help="seed of the engine's random generators (a request may bring its own)")
    )
    scheduling_policy: str = field(
        default="fcfs",
        metadata=cli(
            choices=("fcfs", "priority"),
            help="the order waiting requests start in: first come first served, or by request priority",
        ),
    )
    attention_backend: str = field(
        default="auto",
        metadata=cli(
            choices=("auto", "torch", "triton"), help="attention kernels (auto: triton on CUDA, else torch)"
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata=cli(help="fraction of GPU memory for weights + KV cache")
    )
    tensor_parallel_size: int = field(
        default=1, metadata=cli(flags=("-tp",), help="tensor-parallel ranks (GPUs) per replica")
    )
    pipeline_parallel_size: int = field(
        default=1, metadata=cli(flags=("-pp",), help="pipeline stages (GPUs) per replica")
    )
    enforce_eager: bool = field(
        default=False,
        metadata=cli(help="never replay decode steps from captured CUDA graphs (slower; for debugging)"),
    )
    async_scheduling: bool = field(
        default=False,
        metadata=cli(
            help="schedule step n+1 while step n runs on the device, feeding its sampled tokens on the device "
            "(vLLM's async scheduling); requests with penalties, min_tokens or a grammar still go step by step"
        ),
    )
    distributed_executor_backend: str | None = field(
        default=None,
        metadata=cli(
            enabled=False,
            help="'uni' (the worker in the engine's process) or 'mp' (one process per rank). No flag: the "
            "default (uni for one rank, mp for more) is what a server wants; the Python API may run one rank "
            "in its own process (benchmarks compare the two)",
        ),
    )
    simulation: SimulationCost | dict[str, float] | None = field(
        default=None,
        metadata=cli(
            flags=("--simulate",),
            group=(
                "simulation",
                "--simulate: the real engine with a timing model instead of the model (no weights loaded)",
            ),
            help="replace the forward pass by a timing model emitting deterministic tokens",
        ),
    )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per field (``--simulate`` and ``--sim-*`` for ``simulation``) to ``parser``."""
        groups: dict[str, Any] = {}
        for f, annotation in _cli_fields():
            meta = f.metadata
            target: Any = parser
            if meta["group"]:
                title, description = meta["group"]
                if title not in groups:
                    groups[title] = parser.add_argument_group(title, description)
                target = groups[title]
            if annotation is SimulationCost:
                target.add_argument(_switch(f), dest=f.name, action="store_true", help=meta["help"])
                for sub, sub_type in _typed_fields(SimulationCost):
                    target.add_argument(
                        _SIMULATION_FLAG_PREFIX + _kebab(sub.name),
                        dest=_simulation_dest(sub),
                        type=sub_type,
                        default=sub.default,
                        help=f"{sub.metadata['help']} (default: {sub.default})",
                    )
            elif annotation is bool:
                action, text = "store_true", meta["help"]
                if f.default:
                    action, text = "store_false", f"{text} (on by default; this flag turns it off)"
                target.add_argument(_switch(f), dest=f.name, action=action, help=text)
            else:
                kwargs: dict[str, Any] = {"dest": f.name, "type": annotation, "help": meta["help"]}
                if f.default is MISSING:
                    kwargs["required"] = True
                else:
                    kwargs["default"] = f.default
                    if f.default is not None:
                        kwargs["help"] += " (default: %(default)s)"
                if meta["choices"]:
                    kwargs["choices"] = list(meta["choices"])
                target.add_argument(_long_flag(f), *meta["flags"], **kwargs)

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> EngineArgs:
        """The settings a parser filled by :meth:`add_cli_args` read (other attributes are ignored)."""
        values: dict[str, Any] = {}
        for f, annotation in _cli_fields():
            if annotation is SimulationCost:
                if getattr(namespace, f.name):
                    subs = {
                        sub.name: getattr(namespace, _simulation_dest(sub)) for sub in fields(SimulationCost)
                    }
                    values[f.name] = SimulationCost(**subs)
            else:
                values[f.name] = getattr(namespace, f.name)
        return cls(**values)

    @classmethod
    def cli_args(cls, values: Mapping[str, Any]) -> list[str]:
        """The command line that sets these fields (by name; the others keep their defaults), in field
        order: ``from_cli_args`` of it parsed gives ``values`` back. A bool is written only where it differs
        from the default; a value the flags cannot express raises ValueError."""
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"not engine settings: {', '.join(sorted(unknown))}")
        flagless = {f.name for f in fields(cls) if not f.metadata["cli"]} & set(values)
        if flagless:
            raise ValueError(f"no command-line flag for: {', '.join(sorted(flagless))}")
        out: list[str] = []
        for f, annotation in _cli_fields():
            if f.name not in values:
                continue
            value = values[f.name]
            if annotation is SimulationCost:
                if value is not None:
                    cost = value if isinstance(value, SimulationCost) else SimulationCost(**value)
                    out.append(_switch(f))
                    for sub in fields(SimulationCost):
                        out += [_SIMULATION_FLAG_PREFIX + _kebab(sub.name), str(getattr(cost, sub.name))]
            elif annotation is bool:
                if value is not f.default:
                    if not isinstance(value, bool):
                        raise ValueError(f"{f.name} must be a bool, got {value!r}")
                    out.append(_switch(f))
            elif value is None:
                if f.default is not None:
                    raise ValueError(f"{f.name}=None has no command-line spelling")
            else:
                out += [_long_flag(f), str(value)]
        return out

    @classmethod
    def default_of(cls, name: str) -> Any:
        """The default of field ``name`` (KeyError for a field without one, such as ``model``)."""
        f = _field(cls, name)
        if f.default is MISSING:
            raise KeyError(f"{name} has no default")
        return f.default

    @classmethod
    def option_strings(cls, name: str) -> tuple[str, ...]:
        """Every flag that sets field ``name`` (empty for a field without one)."""
        f = _field(cls, name)
        if not f.metadata["cli"]:
            return ()
        annotation = _typed_fields_by_name(cls)[name]
        if annotation is SimulationCost:
            return (_switch(f), *(_SIMULATION_FLAG_PREFIX + _kebab(s.name) for s in fields(SimulationCost)))
        if annotation is bool:
            return (_switch(f),)
        return (_long_flag(f), *f.metadata["flags"])


def _field(cls: type, name: str) -> Field:
    for f in fields(cls):
        if f.name == name:
            return f
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def _kebab(name: str) -> str:
    return name.replace("_", "-")


def _long_flag(f: Field) -> str:
    return "--" + _kebab(f.name)


def _switch(f: Field) -> str:
    """The one flag of a switch: the field's own spelling if it has one (``--simulate``), else the one that
    flips the bool's default."""
    if f.metadata["flags"]:
        return f.metadata["flags"][0]
    return f"--no-{_kebab(f.name)}" if f.default else _long_flag(f)


def _simulation_dest(sub: Field) -> str:
    return "sim_" + sub.name


def _command_line_type(annotation: Any) -> Any:
    """The type a flag's value converts to: the annotation without ``None`` (``int | None`` -> int), and the
    first alternative of a union (``str | Path`` -> str: argparse hands over strings)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


@functools.cache
def _typed_fields(cls: type) -> list[tuple[Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, _command_line_type(hints[f.name])) for f in fields(cls)]


def _typed_fields_by_name(cls: type) -> dict[str, Any]:
    return {f.name: t for f, t in _typed_fields(cls)}


def _cli_fields() -> list[tuple[Field, Any]]:
    """EngineArgs' fields that have flags, with their command-line types, in field order."""
    return [(f, t) for f, t in _typed_fields(EngineArgs) if f.metadata["cli"]]
