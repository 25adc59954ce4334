from __future__ import annotations

import torch
from torch import nn

from kvfleet_engine.ops import elementwise_cpu, elementwise_triton


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as HF does), with an optional fused residual add.

    CUDA tensors (with triton installed) go through one fused Triton kernel (``ops/elementwise_triton``),
    float32 CPU rows through one fused C pass (``ops/elementwise_cpu``), anything else through torch.
    ``use_triton`` (from ``KVFLEET_TRITON_ELEMENTWISE`` at construction) forces the Triton kernel on
    (True, e.g. on CPU under ``TRITON_INTERPRET=1``) or off (False); None picks by device.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.use_triton: bool | None = elementwise_triton.mode_from_env()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if elementwise_triton.wanted(self.use_triton, x):
            return elementwise_triton.rms_norm(x, self.weight, self.eps, residual)
        fused = elementwise_cpu.rmsnorm(x, self.weight, self.eps, residual)
        if fused is not None:
            return fused[0] if residual is None else fused
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
