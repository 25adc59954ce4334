"""Rotary position embedding (the "rotate half" layout Llama-family checkpoints use)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvfleet_engine.ops import elementwise_cpu, elementwise_triton


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        low_wavelen, high_wavelen = old_len / low, old_len / high
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """RoPE shared by all layers of a model.

    CUDA inputs (with triton installed) are rotated in place by one Triton kernel that gathers cos/sin by
    position on the device: that path keeps no per-step cache, since under CUDA graphs the positions tensor
    is a static buffer whose contents change every replay. ``use_triton`` (from
    ``KVFLEET_TRITON_ELEMENTWISE`` at construction) forces that kernel on (True, e.g. on CPU under
    ``TRITON_INTERPRET=1``) or off (False); None picks by device. Float32 CPU inputs go to the C kernel,
    anything else to torch.
    """

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv = _inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

        self._positions: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        self._checked_positions: torch.Tensor | None = None
        self._c_ok = False
        self.use_triton: bool | None = elementwise_triton.mode_from_env()

    def clear_cache(self) -> None:
        """Forget the per-step gathered tables (e.g. before the worker sleeps)."""
        self._positions = self._cos_sin = self._checked_positions = None

    def _c_ready(self, positions: torch.Tensor) -> bool:
        """Whether this step's positions can go to the C kernel, which indexes the tables unchecked
        (checked once per step: every layer sees the same positions tensor)."""
        if positions is not self._checked_positions:
            self._checked_positions = positions
            self._c_ok = (
                positions.device.type == "cpu"
                and positions.dtype == torch.int64
                and positions.dim() == 1
                and (
                    positions.numel() == 0
                    or (int(positions.min()) >= 0 and int(positions.max()) < len(self.cos))
                )
            )
        return self._c_ok

    def _forward_c(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Rotate q and k in place with the C kernel; False if it does not apply (nothing changed)."""
        if q.dtype != torch.float32 or k.dtype != torch.float32 or q.dim() != 3 or k.dim() != 3:
            return False
        if not elementwise_cpu.available() or not self._c_ready(positions):
            return False
        (t, h, d), kvh = q.shape, k.shape[1]
        if q.stride()[1:] != (d, 1) or k.stride()[1:] != (d, 1) or d != self.cos.shape[1]:
            return False
        if k.stride(0) == q.stride(0) and k.data_ptr() == q.data_ptr() + h * d * q.element_size():
            # q and k heads are adjacent in each row (the fused qkv projection's output): one call.
            rows = torch.as_strided(q, (t, (h + kvh) * d), (q.stride(0), 1))
            return elementwise_cpu.rotary_(rows, h + kvh, positions, self.cos, self.sin)
        qr = torch.as_strided(q, (t, h * d), (q.stride(0), 1))
        kr = torch.as_strided(k, (t, kvh * d), (k.stride(0), 1))
        return elementwise_cpu.rotary_(qr, h, positions, self.cos, self.sin) and elementwise_cpu.rotary_(
            kr, kvh, positions, self.cos, self.sin
        )

    def _lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Every layer shares this module and sees the same positions tensor within a step: gather once.
        if positions is not self._positions or self._cos_sin is None or self._cos_sin[0].dtype != dtype:
            self._positions = positions
            self._cos_sin = (
                self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype),
            )
        return self._cos_sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KVH, D]; positions: [T]. Triton-path and float32 CPU inputs are rotated in
        place and returned; others get new tensors."""
        if elementwise_triton.wanted(self.use_triton, q):
            return elementwise_triton.rotary_(q, k, positions, self.cos, self.sin)
        if self._forward_c(positions, q, k):
            return q, k
        cos, sin = self._lookup(positions, q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
