"""Fused CPU kernels for the per-token elementwise work (``elementwise_cpu.c``): RMSNorm with the
residual add, and rotary embedding applied in place.

Each function takes torch tensors, checks that the C path applies (float32 CPU tensors with unit
stride along the last dimension; the C library built) and returns False when it does not, so the
caller runs its torch expression instead. Results equal the torch expressions' up to float32 rounding.
"""

from __future__ import annotations

import ctypes

import torch

from kvfleet_engine.ops import cbuild

_lib: ctypes.CDLL | None = None
_tried = False


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        _tried = True
        lib = cbuild.load("elementwise_cpu")
        if lib is not None:
            ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
            lib.kvf_rmsnorm_f32.restype = None
            # (x, x_stride, res, res_stride, w, eps, T, n, out, res_out, num_threads)
            lib.kvf_rmsnorm_f32.argtypes = [ptr, i64, ptr, i64, ptr, ctypes.c_float, i64, i32, ptr, ptr, i32]
            lib.kvf_rotary_f32.restype = None
            # (x, row_stride, T, num_heads, D, positions, cos, sin, num_threads)
            lib.kvf_rotary_f32.argtypes = [ptr, i64, i64, i32, i32, ptr, ptr, ptr, i32]
        _lib = lib
    return _lib


def _rows_ok(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 2 and t.stride(1) == 1


def available() -> bool:
    return _load() is not None


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight * norm(h), h)`` with ``h = x + residual`` (``(…, None)`` without a residual), in one pass;
    None when the C path does not apply. x, residual: [T, n]; new tensors are returned, inputs unchanged."""
    lib = _load()
    if (
        lib is None
        or not _rows_ok(x)
        or not (weight.dtype == torch.float32 and weight.is_contiguous() and weight.shape[0] == x.shape[1])
        or (residual is not None and (not _rows_ok(residual) or residual.shape != x.shape))
    ):
        return None
    t, n = x.shape
    out = torch.empty((t, n), dtype=x.dtype)
    res_out = torch.empty((t, n), dtype=x.dtype) if residual is not None else None
    lib.kvf_rmsnorm_f32(
        x.data_ptr(), x.stride(0), 0 if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0), weight.data_ptr(), eps, t, n, out.data_ptr(),
        0 if res_out is None else res_out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out, res_out


def rotary_(
    x: torch.Tensor, num_heads: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> bool:
    """Rotate, in place, the first ``num_heads`` heads of every row of ``x`` ([T, >= num_heads * D], unit
    stride along a row) at ``positions`` ([T] int64, already checked to be inside the tables). cos, sin:
    [max_position, D] tables. Returns False (nothing done) when the C path does not apply."""
    lib = _load()
    d = cos.shape[1]
    if (
        lib is None
        or not _rows_ok(x)
        or x.shape[1] < num_heads * d
        or positions.dtype != torch.int64
        or not positions.is_contiguous()
        or positions.shape[0] != x.shape[0]
        or not (cos.is_contiguous() and sin.is_contiguous() and cos.dtype == sin.dtype == torch.float32)
    ):
        return False
    lib.kvf_rotary_f32(
        x.data_ptr(), x.stride(0), x.shape[0], num_heads, d, positions.data_ptr(), cos.data_ptr(),
        sin.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return True
