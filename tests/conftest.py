import os
from collections.abc import Callable
from pathlib import Path

import pytest

# Triton kernels run on CPU only in interpreter mode; this must be set before triton is imported.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # the gateway/operator-only installs have no torch
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests never reach the Hugging Face Hub: models come from `demo_model` below.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> Callable[..., Path]:
    """demo_model(arch="llama", preset="tiny", seed=0, **kw) -> Path of a built model dir, memoised per session.

    ``kw`` goes to ``kvfleet_engine.demo_model.build_demo_model`` (``shard_size``, ``dtype``, ``logit_std``).
    Each distinct argument set is built once, into its own directory; treat the directory as read-only.
    """
    root = tmp_path_factory.mktemp("demo_models")
    built: dict[tuple, Path] = {}

    def get(arch: str = "llama", preset: str = "tiny", seed: int = 0, **kw) -> Path:
        key = (arch, preset, seed, tuple(sorted(kw.items())))
        if key not in built:
            from kvfleet_engine.demo_model import build_demo_model

            name = "-".join([arch, preset, f"seed{seed}", *(f"{k}{v}" for k, v in sorted(kw.items()))])
            built[key] = build_demo_model(root / name, arch=arch, preset=preset, seed=seed, **kw)
        return built[key]

    return get


@pytest.fixture
def redis_server():
    """A fresh real redis-server on a free port (no persistence): ``.url``, ``.restart()``, ``.stop()``, ``.start()``."""
    from redis_server import RedisServer  # tests/redis_server.py

    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.close()
