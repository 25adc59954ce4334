"""Tensor-parallel group state. Single-process for now: rank 0 of 1, and collectives are no-ops.

The multiprocess executor sets the group when it starts workers; layers ask here instead of taking
ranks through their constructors, so models are written once for any TP size.
"""

from __future__ import annotations

import torch

_tp_rank = 0
_tp_size = 1
_tp_group = None


def set_tensor_parallel_group(rank: int, size: int, group=None) -> None:
    global _tp_rank, _tp_size, _tp_group
    _tp_rank, _tp_size, _tp_group = rank, size, group


def get_tp_rank() -> int:
    return _tp_rank


def get_tp_size() -> int:
    return _tp_size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _tp_size == 1:
        return x
    torch.distributed.all_reduce(x, group=_tp_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp_size)]
    torch.distributed.all_gather(parts, x.contiguous(), group=_tp_group)
    return torch.cat(parts, dim=dim)
