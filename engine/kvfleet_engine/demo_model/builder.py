"""``build_demo_model``: write a complete Hugging Face model directory with random weights."""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet_engine.demo_model import checkpoint, presets, tokenizer, weights


@dataclass(frozen=True)
class BuildResult:
    path: Path
    config: dict[str, Any]
    num_parameters: int
    files: tuple[Path, ...]

    def summary(self) -> str:
        c = self.config
        size = sum(f.stat().st_size for f in self.files)
        return (
            f"{c['architectures'][0]} {self.num_parameters:,} params "
            f"(hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
            f"{c['num_attention_heads']}/{c['num_key_value_heads']} heads, vocab {c['vocab_size']}, "
            f"{'tied' if c['tie_word_embeddings'] else 'untied'}, {c['dtype']}) -> {self.path} "
            f"[{', '.join(f.name for f in self.files)}; {size / 1e6:.1f} MB]"
        )


def build_demo_model(
    out_dir: str | os.PathLike[str],
    arch: str = "llama",
    preset: str = "tiny",
    seed: int = 0,
    shard_size: int | str | None = None,
    dtype: str = "float32",
    *,
    logit_std: float = weights.DEFAULT_LOGIT_STD,
    progress: bool | None = None,
) -> Path:
    """Write a random-weight ``arch`` model of size ``preset`` into ``out_dir`` and return its path.

    The directory gets ``config.json``, ``generation_config.json``, ``model.safetensors`` (or, when
    ``shard_size`` bytes is given and the weights exceed it, ``model-0000i-of-0000N.safetensors`` shards and
    ``model.safetensors.index.json``), ``tokenizer.json``, ``tokenizer_config.json`` (ChatML template
    inside) and ``special_tokens_map.json``. Every file is a pure function of the arguments: the same
    arguments give byte-identical files. Weights are drawn in float32 and rounded to ``dtype``.
    ``logit_std`` sets the spread of the logits (see ``kvfleet_engine.demo_model.weights``); ``progress``
    shows a tqdm bar (default: for presets other than ``tiny``).
    """
    return build(out_dir, arch, preset, seed, shard_size, dtype, logit_std=logit_std, progress=progress).path


def build(
    out_dir: str | os.PathLike[str],
    arch: str = "llama",
    preset: str = "tiny",
    seed: int = 0,
    shard_size: int | str | None = None,
    dtype: str = "float32",
    *,
    logit_std: float = weights.DEFAULT_LOGIT_STD,
    progress: bool | None = None,
) -> BuildResult:
    """``build_demo_model`` returning a ``BuildResult`` (path, config, parameter count, files written)."""
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if not logit_std > 0:
        raise ValueError(f"logit_std must be positive, got {logit_std!r}")
    shard_bytes = None if shard_size is None else checkpoint.parse_size(shard_size)
    config = presets.make_config(arch, preset, dtype, vocab_size=tokenizer.VOCAB_SIZE)
    shapes = presets.tensor_shapes(config)
    num_params = presets.count_parameters(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    files = [
        _write_json(out / "config.json", config),
        _write_json(out / "generation_config.json", presets.generation_config()),
        *tokenizer.write_tokenizer_files(out, model_max_length=config["max_position_embeddings"]),
    ]

    def make(name: str):
        return weights.make_tensor(
            name, shapes[name], config, seed=seed, arch=arch, preset=preset, logit_std=logit_std
        )

    show = (preset != "tiny") if progress is None else progress
    bar = None
    if show:
        from tqdm.auto import tqdm

        total = sum(math.prod(s) for s in shapes.values()) * checkpoint.DTYPE_BYTES[dtype]
        bar = tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc=f"demo-model {arch}/{preset}",
            file=sys.stderr,
        )
    try:
        files += checkpoint.write_checkpoint(
            out,
            shapes,
            dtype,
            make,
            shard_size=shard_bytes,
            num_parameters=num_params,
            on_bytes=bar.update if bar is not None else None,
        )
    finally:
        if bar is not None:
            bar.close()
    return BuildResult(out, config, num_params, tuple(files))


def _write_json(path: Path, obj: Any) -> Path:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path
