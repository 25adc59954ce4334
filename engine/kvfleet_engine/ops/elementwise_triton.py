"""Fused Triton kernels for the per-token elementwise work of a decoder layer (the engine's GPU path).

Each kernel replaces a chain of small torch ops with one launch:

* ``rms_norm``: optional residual add + RMSNorm + weight, one program per row. Rounding follows the torch
  path in ``layers/norm.py``: the sum ``x + residual`` is rounded to its dtype, the statistics are float32,
  the normalised row is rounded to that dtype before the weight multiplies it.
* ``rotary_``: "rotate half" RoPE on q and k in place, gathering cos/sin by position inside the kernel.
* ``silu_and_mul``: ``silu(gate) * up`` of a ``[T, 2I]`` gate/up projection, in float32.

All three are CUDA-graph capturable: they launch with grids that depend only on shapes, never read tensor
values on the host and keep no state between calls, so a replay with new values in the same buffers is
correct. Arithmetic is float32; results are cast to the output dtype once.

Dispatch policy (used by the layers): ``KVFLEET_TRITON_ELEMENTWISE`` = ``1`` forces these kernels (on CPU
they then need ``TRITON_INTERPRET=1``), ``0`` disables them, unset or ``auto`` uses them for CUDA tensors
when triton is installed. Layers read it once, at construction, into their ``use_triton`` attribute.

The module imports without triton; calling a kernel without it raises a clear error.
"""

from __future__ import annotations

import os

import torch

from kvfleet_engine.ops.triton_support import HAS_TRITON, check_triton, tl, triton

__all__ = ["ENV_VAR", "HAS_TRITON", "mode_from_env", "rms_norm", "rotary_", "silu_and_mul", "wanted"]

ENV_VAR = "KVFLEET_TRITON_ELEMENTWISE"


def mode_from_env() -> bool | None:
    """``KVFLEET_TRITON_ELEMENTWISE`` as a layer's ``use_triton``: True (force), False (never), None (auto)."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{ENV_VAR} must be 1, 0 or auto, got {value!r}")


def wanted(use_triton: bool | None, t: torch.Tensor) -> bool:
    """Whether a layer with this ``use_triton`` setting runs the Triton kernel on ``t``."""
    return use_triton if use_triton is not None else (HAS_TRITON and t.is_cuda)


def _check_triton(t: torch.Tensor) -> None:
    check_triton(t, "kvfleet_engine.ops.elementwise_triton", f"unset {ENV_VAR} to use the torch path")


if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
        stride_x, stride_res, stride_out, stride_res_out,
        n, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
            # Round the sum to the residual stream's dtype, as torch's `x + residual` does.
            h = (h.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * stride_res_out + cols, h, mask=mask)
        hf = h.to(tl.float32)
        # Masked lanes load 0, so they add nothing to the sum of squares.
        rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / n + eps)
        normed = (hf * rstd).to(h.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotate_heads(
        base_ptr, stride_h, stride_d, head0, num_heads, cos, sin,
        HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ):  # fmt: skip
        """Rotate heads ``head0 .. head0 + BLOCK_H`` (masked to ``num_heads``) of one token in place."""
        heads = head0 + tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_HALF)
        mask = (heads[:, None] < num_heads) & (dims[None, :] < HALF)
        lo = base_ptr + heads[:, None] * stride_h + dims[None, :] * stride_d
        hi = lo + HALF * stride_d
        x1 = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(hi, mask=mask, other=0.0).to(tl.float32)
        # rotate_half(x) = [-x2, x1], and both halves of the cos/sin rows are equal.
        tl.store(lo, (x1 * cos - x2 * sin).to(base_ptr.dtype.element_ty), mask=mask)
        tl.store(hi, (x2 * cos + x1 * sin).to(base_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(
        q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
        stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
        stride_pos, stride_cos, stride_sin,
        num_heads, num_kv_heads, max_pos,
        HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        num_q_blocks = tl.cdiv(num_heads, BLOCK_H)
        pos = tl.load(pos_ptr + t * stride_pos).to(tl.int64)
        # Positions are in range by construction; clamping keeps a bad one from faulting the device.
        pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)
        dims = tl.arange(0, BLOCK_HALF)
        dmask = dims < HALF
        cos = tl.load(cos_ptr + pos * stride_cos + dims, mask=dmask, other=0.0)[None, :]
        sin = tl.load(sin_ptr + pos * stride_sin + dims, mask=dmask, other=0.0)[None, :]
        if blk < num_q_blocks:
            _rotate_heads(
                q_ptr + t * stride_qt, stride_qh, stride_qd, blk * BLOCK_H, num_heads, cos, sin,
                HALF, BLOCK_H, BLOCK_HALF,
            )  # fmt: skip
        else:
            _rotate_heads(
                k_ptr + t * stride_kt, stride_kh, stride_kd, (blk - num_q_blocks) * BLOCK_KVH, num_kv_heads,
                cos, sin, HALF, BLOCK_KVH, BLOCK_HALF,
            )  # fmt: skip

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last]`` with unit stride along a row (a view whenever possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 256))


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * norm(h)`` with ``h = x`` or ``h = x + residual`` (then returns ``(out, h)``).

    x, residual: ``[..., n]``; weight: ``[n]``. Inputs are unchanged; outputs are new tensors with torch's
    promoted dtypes (``h``: x with residual; out: h with weight).
    """
    _check_triton(x)
    n = x.shape[-1]
    if weight.shape != (n,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(
            f"rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)}, residual shape mismatch"
        )
    h_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    x2 = _rows(x)
    rows = x2.shape[0]
    out = torch.empty((rows, n), dtype=torch.promote_types(h_dtype, weight.dtype), device=x.device)
    res2 = _rows(residual) if residual is not None else x2
    res_out = torch.empty((rows, n), dtype=h_dtype, device=x.device) if residual is not None else out
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](
            x2, res2, weight.contiguous(), out, res_out,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0),
            n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block),
        )  # fmt: skip
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))


def rotary_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[T, H, D]`` and k ``[T, KVH, D]`` in place ("rotate half" layout) and return them.

    Any strides are accepted (q and k are usually views of the fused qkv output). positions: ``[T]``
    integer, each in ``[0, max_position)`` (clamped on the device, never checked on the host). cos, sin:
    ``[max_position, D]`` tables (float32 in the engine; read as float32) whose two halves are equal, as
    ``RotaryEmbedding`` builds them: only the first half is read.
    """
    _check_triton(q)
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"rotary_: q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, heads, D]")
    t, h, d = q.shape
    kvh = k.shape[1]
    if positions.shape != (t,) or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != d or d % 2:
        raise ValueError(
            f"rotary_: positions {tuple(positions.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)} "
            f"do not fit q {tuple(q.shape)}"
        )
    if t == 0:
        return q, k
    half = d // 2
    block_half = triton.next_power_of_2(half)
    # A program rotates up to ~2K elements per half: all heads of a token for usual shapes, so q and k
    # together take one or two programs per token.
    cap = max(1, 2048 // block_half)
    block_h = min(triton.next_power_of_2(h), cap)
    block_kvh = min(triton.next_power_of_2(kvh), cap)
    grid = (t, triton.cdiv(h, block_h) + triton.cdiv(kvh, block_kvh))
    _rotary_kernel[grid](
        q, k, positions, cos, sin,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        positions.stride(0), cos.stride(0), sin.stride(0),
        h, kvh, cos.shape[0],
        HALF=half, BLOCK_H=block_h, BLOCK_KVH=block_kvh, BLOCK_HALF=block_half,
        num_warps=_num_warps(block_h * block_half),
    )  # fmt: skip
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for x ``[..., 2I]``, in float32, as a new ``[..., I]`` tensor."""
    _check_triton(x)
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dimension must be even, got {tuple(x.shape)}")
    n = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0] and n:
        block = min(triton.next_power_of_2(n), 1024)
        grid = (x2.shape[0], triton.cdiv(n, block))
        _silu_and_mul_kernel[grid](x2, out, x2.stride(0), out.stride(0), n, BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], n)
