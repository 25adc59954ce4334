"""Streaming safetensors writer with Hugging Face-style sharding.

Tensors are produced one at a time by a callback and written straight to disk, so building the 0.36 B
parameter ``bench`` preset needs memory for one tensor, not the whole model. The byte layout is fully
determined by the tensor names, shapes and dtype (header keys sorted, ``{"format": "pt"}`` metadata, header
padded with spaces to a multiple of 8 as the safetensors library does), so equal inputs give equal files.

Sharding follows ``huggingface_hub.split_state_dict_into_shards_factory``: tensors are taken in state-dict
order and a new shard starts when the next tensor would push the current one past ``shard_size``; a tensor
bigger than ``shard_size`` gets a shard of its own. Files are ``model-00001-of-0000N.safetensors`` plus
``model.safetensors.index.json`` (``metadata.total_size``/``total_parameters`` and ``weight_map``); a
model that fits in one shard is written as plain ``model.safetensors`` with no index, like HF.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str | int) -> int:
    """``"50MB"`` -> 50_000_000, ``"64MiB"`` -> 67_108_864, ``"1000"`` -> 1000 (HF's decimal/binary units)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"cannot parse size {text!r} (examples: 50MB, 64MiB, 1GB, 1000000)")
    value = float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()]
    if value < 1:
        raise ValueError(f"size must be at least 1 byte, got {text!r}")
    return int(value)


def to_dtype_bytes(values: np.ndarray, dtype: str) -> bytes:
    """Little-endian bytes of float32 ``values`` cast to ``dtype`` with round-to-nearest-even (as torch does)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "float32":
        return values.astype("<f4", copy=False).tobytes()
    if dtype == "float16":
        return values.astype("<f2").tobytes()
    if dtype == "bfloat16":
        if not np.isfinite(values).all():
            raise ValueError("non-finite weight")
        bits = values.view(np.uint32)
        rounding = ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
        return ((bits + rounding) >> np.uint32(16)).astype("<u2").tobytes()
    raise ValueError(f"unsupported dtype {dtype!r}")


def plan_shards(sizes: dict[str, int], shard_size: int | None) -> list[list[str]]:
    """Group tensor names (in ``sizes`` order) into shards of at most ``shard_size`` bytes, HF's way."""
    if shard_size is None:
        return [list(sizes)]
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, size in sizes.items():
        if size > shard_size:
            shards.append([name])
            continue
        if current and current_size + size > shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    return shards


def _header(shapes: dict[str, tuple[int, ...]], names: list[str], dtype: str) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(names):
        nbytes = math.prod(shapes[name]) * DTYPE_BYTES[dtype]
        header[name] = {
            "data_offsets": [offset, offset + nbytes],
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shapes[name]),
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _atomic_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_safetensors(
    path: Path,
    shapes: dict[str, tuple[int, ...]],
    names: list[str],
    dtype: str,
    make: Callable[[str], np.ndarray],
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """Write tensors ``names`` to one safetensors file, calling ``make(name)`` for each one's float32 values."""
    tmp = _atomic_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(_header(shapes, names, dtype))
            for name in sorted(names):
                values = make(name)
                if tuple(values.shape) != tuple(shapes[name]):
                    raise AssertionError(f"{name}: made shape {values.shape}, expected {shapes[name]}")
                data = to_dtype_bytes(values, dtype)
                f.write(data)
                if on_bytes is not None:
                    on_bytes(len(data))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_stale_weights(out_dir: Path) -> None:
    """Delete weight files a previous build left in ``out_dir`` (a different shard count would mix in)."""
    for path in out_dir.iterdir():
        if path.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.match(path.name):
            path.unlink()


def write_checkpoint(
    out_dir: Path,
    shapes: dict[str, tuple[int, ...]],
    dtype: str,
    make: Callable[[str], np.ndarray],
    shard_size: int | None = None,
    num_parameters: int | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> list[Path]:
    """Write all tensors of ``shapes`` (state-dict order) as one file or as HF shards + index; return the files."""
    sizes = {name: math.prod(shape) * DTYPE_BYTES[dtype] for name, shape in shapes.items()}
    shards = plan_shards(sizes, shard_size)
    remove_stale_weights(out_dir)
    if len(shards) == 1:
        path = out_dir / SINGLE_FILE
        write_safetensors(path, shapes, shards[0], dtype, make, on_bytes)
        return [path]
    written: list[Path] = []
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards, start=1):
        path = out_dir / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(path, shapes, names, dtype, make, on_bytes)
        weight_map.update(dict.fromkeys(names, path.name))
        written.append(path)
    metadata: dict[str, int] = {"total_size": sum(sizes.values())}
    if num_parameters is not None:
        metadata["total_parameters"] = num_parameters
    index = {"metadata": metadata, "weight_map": weight_map}
    index_path = out_dir / INDEX_FILE
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    written.append(index_path)
    return written


def iter_shard_files(out_dir: Path) -> Iterable[Path]:
    """The safetensors files of a checkpoint directory (single file or shards, in order)."""
    single = out_dir / SINGLE_FILE
    if single.exists():
        return [single]
    return sorted(p for p in out_dir.iterdir() if _SHARD_RE.match(p.name))
