"""Loader for the C paged-decode kernel (``paged_decode_cpu.c``, built and cached by ``cbuild``).

If it cannot be built the engine falls back to the torch path: slower, same results.
"""

from __future__ import annotations

import ctypes

import torch

from kvfleet_engine.ops import cbuild

_lib: ctypes.CDLL | None = None
_MIN_PARALLEL_WORK = 1 << 22  # multiply-adds per K (and V) pass below which one thread is used
_tried = False


def _build() -> ctypes.CDLL | None:
    lib = cbuild.load("paged_decode_cpu")
    if lib is None:
        return None
    fn = lib.kvf_paged_decode_f32
    fn.restype = ctypes.c_int
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    # (q, k_cache, v_cache, block_tables, bt_stride, seq_lens, out, B, H, KVH, D, block_size, scale,
    #  max_seq_len, num_threads)
    fn.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_int64, ptr, ptr, i32, i32, i32, i32, i32, ctypes.c_float, i32, i32]  # fmt: skip
    return lib


def available() -> bool:
    global _lib, _tried
    if not _tried:
        _tried = True
        _lib = _build()
    return _lib is not None


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """q, out: [B, H, D] float32 contiguous; block_tables [B, M] int32; seq_lens [B] int32 (CPU)."""
    assert _lib is not None and q.dtype == torch.float32 and q.is_contiguous() and out.is_contiguous()
    b, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32 and block_tables.stride(1) == 1
    # A parallel region costs a barrier; for little work (short contexts, few sequences) one thread
    # finishes sooner, and it cannot be stalled by a descheduled sibling on a busy machine.
    work = int(seq_lens.sum()) * h * d
    threads = 1 if work < _MIN_PARALLEL_WORK else max(1, min(torch.get_num_threads(), b * kvh))
    rc = _lib.kvf_paged_decode_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
        seq_lens.data_ptr(), out.data_ptr(), b, h, kvh, d, bs, scale, max_seq_len, threads,
    )  # fmt: skip
    if rc == -2:
        raise ValueError(f"CPU decode attention needs a power-of-two block size, got {bs}")
    if rc != 0:
        raise MemoryError("CPU decode attention could not allocate its scratch buffer")
    return out
