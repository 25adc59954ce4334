"""Gated activations."""

from __future__ import annotations

import torch
from torch import nn

from kvfleet_engine.ops import elementwise_triton


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` of a fused gate/up projection ``[..., 2I]`` (gate first) -> ``[..., I]``.

    CUDA tensors (with triton installed) take one fused Triton kernel (float32 math, one rounding); others
    run the torch expression in place on the gate half of the input. ``use_triton`` (from
    ``KVFLEET_TRITON_ELEMENTWISE`` at construction) forces the kernel on (True) or off (False); None picks
    by device.
    """

    def __init__(self) -> None:
        super().__init__()
        self.use_triton: bool | None = elementwise_triton.mode_from_env()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if elementwise_triton.wanted(self.use_triton, x):
            return elementwise_triton.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return nn.functional.silu(gate, inplace=True).mul_(up)
