"""Device names: what a user may write (``cpu``, ``cuda``, ``cuda:N``, ``auto``) and what the engine keeps.

The engine keeps one canonical form in ``EngineConfig.device``: ``"cpu"`` or ``"cuda:N"`` with an explicit
index. ``torch.cuda.set_device`` refuses a ``torch.device("cuda")`` without an index (a ValueError on
every torch build), which is how a bare ``"cuda"`` once killed every GPU worker at start; with the index
always present, every layer (worker, per-rank devices, NCCL) reads the same number.

Nothing here initialises CUDA: ``torch.cuda.device_count()`` asks NVML, so the API-server process that
validates the configuration never creates a CUDA context of its own.
"""

from __future__ import annotations

import re

import torch

_CUDA = re.compile(r"cuda(?::(\d+))?")


def canonical_device(device: str, cuda_device_count: int) -> str:
    """``"cpu"`` or ``"cuda:N"`` for a user's device string; ValueError with the reason otherwise.

    ``"auto"`` is CUDA device 0 when one is visible, else the CPU. ``cuda_device_count`` is passed in
    (``torch.cuda.device_count()`` in the engine) so the rule is a pure function.
    """
    if not isinstance(device, str):
        raise ValueError(f"device must be a string such as 'cpu', 'cuda' or 'cuda:1', got {device!r}")
    name = device.strip().lower()
    if name == "auto":
        return "cuda:0" if cuda_device_count > 0 else "cpu"
    if name == "cpu":
        return "cpu"
    m = _CUDA.fullmatch(name)
    if m is None:
        raise ValueError(f"unknown device {device!r}; use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if cuda_device_count == 0:
        raise ValueError(f"device={device!r} was requested but no CUDA device is available")
    index = int(m.group(1) or 0)
    if index >= cuda_device_count:
        raise ValueError(f"device={device!r}: only {cuda_device_count} CUDA device(s) are visible")
    return f"cuda:{index}"


def cuda_index(device: str | torch.device) -> int:
    """The CUDA device index of ``device`` (0 for a bare ``"cuda"``, which older configs may hold)."""
    d = torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"{device!r} is not a CUDA device")
    return 0 if d.index is None else d.index


def rank_device(device: str, rank: int) -> str:
    """The device of tensor/pipeline-parallel ``rank``: the CPU for every rank, or one CUDA device per
    rank counted up from the configured one (``cuda:2`` with 2 ranks -> ``cuda:2``, ``cuda:3``)."""
    if not device.startswith("cuda"):
        return device
    return f"cuda:{cuda_index(device) + rank}"


def bind_device(device: str) -> None:
    """Make ``device`` the current CUDA device of this process (before NCCL or any allocation picks
    one itself); nothing on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(cuda_index(device))
