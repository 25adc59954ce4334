"""glibc ``malloc`` settings for a worker that computes on the CPU.

Why: a forward pass allocates and frees large activations every step (a 2048-token prefill's
gate/up output alone is 29 MiB in the ``small`` model). With glibc's defaults these are served by
``mmap`` and returned with ``munmap``, or trimmed off the top of the heap, as soon as they are freed,
so the next step page-faults every one of them back in (and the kernel zeroes each page). Keeping
them in the heap cut the minor page faults of ``bench/engine_throughput.py``'s workload from ~760 k to
~260 k and its wall time by 5-8 % (docs/BENCHMARKS.md). The cost is resident memory: up to
``trim_threshold`` of freed heap is kept for reuse instead of being handed back.

The settings apply to the whole process (``mallopt``), which is why only workers call this, once.
Allocations above ``mmap_threshold`` (weights, the KV cache: long-lived) still get their own mappings.
"""

from __future__ import annotations

import ctypes
import logging
import platform

logger = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

# glibc's documented maximum for M_MMAP_THRESHOLD on 64-bit; the per-step activations stay below it.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20

_tuned = False


def tune_host_allocator(
    mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD, top_pad: int = TOP_PAD
) -> bool:
    """Apply the settings (once per process); False where the C library is not glibc or refuses."""
    global _tuned
    if _tuned:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, mmap_threshold),
            (_M_TRIM_THRESHOLD, trim_threshold),
            (_M_TOP_PAD, top_pad),
        )
    )
    if not ok:
        logger.warning("mallopt refused the CPU worker's allocator settings; keeping glibc's defaults")
        return False
    _tuned = True
    return True
