"""What every Triton kernel module of the engine shares: the optional import, interpreter mode, the check.

Kernel modules import without triton (the engine imports them on CUDA; tests import them on CPU, where the
kernels run under ``TRITON_INTERPRET=1``); calling a kernel without triton, or on CPU tensors outside the
interpreter, raises a clear error instead.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "check_triton", "interpreting", "jit_steady", "tl", "triton"]


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


def jit_steady(*, values: Iterable[str] = (), alignments: Iterable[str] = ()):
    """``triton.jit`` that compiles one variant however these arguments change from step to step.

    Triton specialises a kernel on each integer argument (equal to 1, divisible by 16) and on each pointer's
    16-byte alignment, compiling a new variant (about a second, on the engine's thread) the first time a
    combination appears. Arguments that vary with the batch (a block table's row stride, a pointer into
    the middle of a tensor such as ``seq_lens[num_decodes:]``) would otherwise stall a step in the middle of
    serving. ``values`` are such integers; ``alignments`` such pointers (only read as scalars, so the
    alignment buys nothing). A Triton without ``do_not_specialize_on_alignment`` ignores ``alignments``.
    """
    kwargs = {"do_not_specialize": list(values)}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        kwargs["do_not_specialize_on_alignment"] = list(alignments)
    return triton.jit(**kwargs)
