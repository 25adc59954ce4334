"""Builds the engine's C kernels (``ops/*.c``) with the system C compiler on first use and loads them
with ctypes (whose foreign calls release the GIL).

A built shared object is cached under a key made of the source, the compiler, the flags and the CPU's
model and feature flags: ``-march=native`` code built on one machine may not run on another (a cache
directory on a shared or copied home), and a change of flags must rebuild. Builds go to a temporary
file renamed into place, so concurrent builders (engine processes starting together) never load a
half-written library.

No compiler, a failed build, or ``KVFLEET_DISABLE_C_KERNELS=1``: ``load`` returns None and callers use
their torch paths (slower, same results).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


def cache_dir() -> Path:
    root = os.environ.get("KVFLEET_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvfleet"
    )
    return Path(root) / "kernels"


@functools.cache
def cpu_fingerprint() -> str:
    """What ``-march=native`` depends on: the machine and its CPU's model and feature flags."""
    parts = [platform.machine()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part") and line not in parts:
                    parts.append(line)
                if key in ("flags", "Features"):
                    break  # the first processor describes them all
    except OSError:
        pass
    return "\n".join(parts)


def cache_key(source: bytes, cc: str) -> str:
    key = b"\0".join([source, cc.encode(), " ".join(CFLAGS).encode(), cpu_fingerprint().encode()])
    return hashlib.sha256(key).hexdigest()[:16]


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The library built from ``ops/<name>.c`` (built now if not cached), or None if unavailable."""
    if os.environ.get("KVFLEET_DISABLE_C_KERNELS") == "1":
        return None
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        logger.warning("no C compiler found: the CPU kernels fall back to (slower) torch code")
        return None
    source = Path(__file__).with_name(f"{name}.c")
    lib_path = cache_dir() / f"{name}-{cache_key(source.read_bytes(), cc)}.so"
    if not lib_path.exists():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
            tmp_out = Path(tmp) / lib_path.name
            cmd = [cc, *CFLAGS, str(source), "-o", str(tmp_out), "-lm"]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                logger.warning(
                    "building the CPU kernel %s failed, using torch code instead:\n%s", name, res.stderr
                )
                return None
            os.replace(tmp_out, lib_path)  # atomic: concurrent builders never see a half-written file
    return ctypes.CDLL(str(lib_path))
