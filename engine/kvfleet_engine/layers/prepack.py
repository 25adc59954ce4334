"""Matmul weights prepacked for oneDNN on the CPU (float32).

Why: at decode batch sizes (tens of rows) MKL's sgemm on ``F.linear``'s ``[out, in]`` weights ran the
``small`` model's projections at ~50-65 % of the machine's matmul peak; oneDNN with the weights
reordered once into its blocked layout ran the same shapes 1.1-1.5x faster (1.7x over the engine's
decode steps), and prefill-sized ones (thousands of rows) as fast as before (docs/BENCHMARKS.md).

The packed copy is derived state. The plain parameter stays the source of truth (the loader, tensor
parallel sharding and sleep/wake all work on it), so packing costs one more copy of the matmul weights
in host memory; layers without a pack (GPU, other dtypes, ``KVFLEET_CPU_PREPACK=0``) use ``F.linear``.
Whoever changes a packed layer's weights must call :func:`prepack` again (the worker does after a
level-2 wake re-reads the checkpoint).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

ENV_SWITCH = "KVFLEET_CPU_PREPACK"


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None):
    """``F.linear(x, weight, bias)``, through the packed weight when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packable(model: nn.Module):
    for module in model.modules():
        if hasattr(module, "packed_weight") and isinstance(getattr(module, "weight", None), torch.Tensor):
            yield module


def prepack(model: nn.Module) -> int:
    """Pack every layer that has a ``packed_weight`` slot; returns how many were packed."""
    count = 0
    packs: dict[int, torch.Tensor] = {}  # a tied weight (embedding = LM head) shares one pack
    for module in _packable(model):
        weight = module.weight
        if weight.numel() == 0:  # released by sleep
            module.packed_weight = None
            continue
        if id(weight) not in packs:
            packs[id(weight)] = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            count += 1
        module.packed_weight = packs[id(weight)]
    return count


def drop_packs(model: nn.Module) -> None:
    for module in _packable(model):
        module.packed_weight = None


def packed_bytes(model: nn.Module) -> int:
    """Host memory the packs hold (a tied weight's pack counted once)."""
    seen: set[int] = set()
    total = 0
    for module in _packable(model):
        pack = module.packed_weight
        if pack is not None and id(pack) not in seen:
            seen.add(id(pack))
            total += pack.numel() * pack.element_size()
    return total
