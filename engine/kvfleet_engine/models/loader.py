"""Load safetensors checkpoints (single file or sharded with an index) into a model.

Each parameter's own ``weight_loader`` decides what slice it keeps (tensor parallelism) and the
copy converts dtype. Loaders receive a :class:`LazySlice`: only the rows/columns a rank keeps are read
from the file, and tensors of layers another pipeline stage owns are never read at all. Every
parameter of this rank's model must be filled: a missing tensor is an error naming it.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm
from tqdm.std import tqdm as tqdm_base

logger = logging.getLogger(__name__)

# Tensors some checkpoints carry that the engine recomputes or does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def use_a_thread_lock_for_progress_bars() -> None:
    """For the engine's own processes (core, workers), which each draw their own bars. tqdm's first bar, even
    a disabled one, otherwise creates a multiprocessing lock: a named semaphore in /dev/shm that, in a process
    started with "spawn", only Python's resource tracker removes. A process group killed at once (``kill -9``
    of a replica) left one behind per process."""
    tqdm_base.set_lock(threading.RLock())


class LazySlice:
    """A checkpoint tensor not read yet; ``narrow``/``full`` read just what they return."""

    __slots__ = ("_slice", "shape")

    def __init__(self, safetensors_slice) -> None:
        self._slice = safetensors_slice
        self.shape = tuple(safetensors_slice.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def full(self) -> torch.Tensor:
        return self._slice[tuple(slice(None) for _ in self.shape)]


def full_tensor(loaded: torch.Tensor | LazySlice) -> torch.Tensor:
    return loaded.full() if isinstance(loaded, LazySlice) else loaded


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights found in {model_dir}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"checkpoint shards listed in the index are missing: {', '.join(missing)}")
    return files


def load_weights(model: nn.Module, model_dir: str | Path, use_tqdm: bool = True) -> None:
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    params = dict(model.named_parameters(remove_duplicate=False))
    packed: dict[str, tuple[str, object]] = getattr(model, "packed_modules_mapping", {})
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    # Fused parameters are complete only once every part has been loaded.
    expected: dict[str, int] = {}
    for name in params:
        parts = [k for k, (fused, _) in packed.items() if f".{fused}." in name]
        expected[name] = len(parts) or 1
    loaded: dict[str, int] = dict.fromkeys(params, 0)
    tied_head_only = tied and "lm_head.weight" in params and "model.embed_tokens.weight" not in params

    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not use_tqdm, leave=False) as bar:
        for handle in handles:
            for ckpt_name in handle.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                bar.update(1)
                if ckpt_name.endswith(_IGNORED_SUFFIXES) or (tied and ckpt_name == "lm_head.weight"):
                    continue
                name, shard_id = ckpt_name, None
                for part, (fused, sid) in packed.items():
                    if f".{part}." in ckpt_name:
                        name, shard_id = ckpt_name.replace(f".{part}.", f".{fused}."), sid
                        break
                param = params.get(name)
                if param is None and tied_head_only and name == "model.embed_tokens.weight":
                    # A last pipeline stage without the embedding still needs it as its LM head.
                    name, param = "lm_head.weight", params["lm_head.weight"]
                if param is None:
                    logger.debug("ignoring checkpoint tensor %s (no such parameter)", ckpt_name)
                    continue
                tensor = LazySlice(handle.get_slice(ckpt_name))
                loader = getattr(param, "weight_loader", None)
                with torch.no_grad():
                    if loader is None:
                        param.data.copy_(tensor.full())
                    elif shard_id is None:
                        loader(param, tensor)
                    else:
                        loader(param, tensor, shard_id)
                loaded[name] += 1
    if tied and "lm_head.weight" in params and not tied_head_only:
        loaded["lm_head.weight"] = expected.get("lm_head.weight", 1)
    missing = sorted(n for n, c in loaded.items() if c < expected[n])
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint in {model_dir} is missing tensors for: {shown}")
