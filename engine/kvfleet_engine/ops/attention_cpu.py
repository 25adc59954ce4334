"""Loader for the C paged-decode kernel (``paged_decode_cpu.c``): compiled with the system C
compiler on first use, cached by source hash, called through ctypes (which releases the GIL).

If no compiler is available the engine falls back to the torch path: slower, same results.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_decode_cpu.c")
_lib: ctypes.CDLL | None = None
_MIN_PARALLEL_WORK = 1 << 22  # multiply-adds per K (and V) pass below which one thread is used
_tried = False


def _cache_dir() -> Path:
    root = os.environ.get("KVFLEET_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvfleet"
    )
    return Path(root) / "kernels"


def _build() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        logger.warning("no C compiler found: CPU decode attention uses the slower torch path")
        return None
    src = _SOURCE.read_bytes()
    tag = hashlib.sha256(src + cc.encode()).hexdigest()[:16]
    lib_path = _cache_dir() / f"paged_decode_cpu-{tag}.so"
    if not lib_path.exists():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
            tmp_out = Path(tmp) / lib_path.name
            cmd = [
                cc,
                "-O3",
                "-march=native",
                "-fopenmp",
                "-shared",
                "-fPIC",
                str(_SOURCE),
                "-o",
                str(tmp_out),
                "-lm",
            ]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                logger.warning("building the CPU decode kernel failed, using the torch path:\n%s", res.stderr)
                return None
            os.replace(tmp_out, lib_path)  # atomic: concurrent builders never see a half-written file
    lib = ctypes.CDLL(str(lib_path))
    fn = lib.kvf_paged_decode_f32
    fn.restype = ctypes.c_int
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    # (q, k_cache, v_cache, block_tables, bt_stride, seq_lens, out, B, H, KVH, D, block_size, scale,
    #  max_seq_len, num_threads)
    fn.argtypes = [
        ptr,
        ptr,
        ptr,
        ptr,
        ctypes.c_int64,
        ptr,
        ptr,
        i32,
        i32,
        i32,
        i32,
        i32,
        ctypes.c_float,
        i32,
        i32,
    ]
    return lib


def available() -> bool:
    global _lib, _tried
    if not _tried:
        _tried = True
        if os.environ.get("KVFLEET_DISABLE_C_KERNELS") != "1":
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
    if rc != 0:
        raise MemoryError("CPU decode attention could not allocate its scratch buffer")
    return out
