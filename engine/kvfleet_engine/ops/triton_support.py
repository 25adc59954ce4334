"""What every Triton kernel module of the engine shares: the optional import, interpreter mode, the check.

Kernel modules import without triton (the engine imports them on CUDA; tests import them on CPU, where the
kernels run under ``TRITON_INTERPRET=1``); calling a kernel without triton, or on CPU tensors outside the
interpreter, raises a clear error instead.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "check_triton", "interpreting", "tl", "triton"]


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_triton(t: torch.Tensor, module: str, fallback: str) -> None:
    """Raise if ``module``'s kernels cannot run on ``t``; ``fallback`` says what to use instead."""
    if not HAS_TRITON:
        raise RuntimeError(f"{module} needs triton (pip install 'kvfleet[triton]'); {fallback}")
    if t.device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"{module}'s Triton kernels need CUDA tensors (got device {t.device}); on CPU set "
            "TRITON_INTERPRET=1 before triton is first imported"
        )
