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

# The one source of the engine tests' device: KVFLEET_TEST_DEVICE, "cpu" unless a GPU run asks for "cuda"
# (or "cuda:N"; scripts/test-gpu.sh sets it). Tests read it through the ``test_device`` fixture and pass it
# to ``LLM(device=...)`` explicitly: left to itself, ``device="auto"`` means CUDA (and bfloat16) on any GPU
# machine. Tests of CPU-only code (oneDNN weight packs, the C kernels) pin "cpu" whatever it says.
TEST_DEVICE_ENV = "KVFLEET_TEST_DEVICE"
TEST_DEVICE = os.environ.get(TEST_DEVICE_ENV, "").strip().lower() or "cpu"

# Tests never reach the Hugging Face Hub: models come from `demo_model` below.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config: pytest.Config) -> None:
    """A test device this machine cannot give is a usage error, not a run of skips or failures."""
    name = TEST_DEVICE
    if name == "cpu":
        return
    if name != "cuda" and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise pytest.UsageError(f"{TEST_DEVICE_ENV}={name!r}: use 'cpu', 'cuda' or 'cuda:N'")
    count = torch.cuda.device_count() if _has_cuda else 0
    index = int(name[5:]) if name.startswith("cuda:") else 0
    if index >= count:
        raise pytest.UsageError(
            f"{TEST_DEVICE_ENV}={name!r} but torch sees {count} CUDA device(s)"
            + ("" if _has_cuda else " (a CPU-only torch, or no driver)")
        )


@pytest.fixture(scope="session")
def test_device() -> str:
    """The device engine tests run on: ``"cpu"`` (default) or ``"cuda"``/``"cuda:N"`` from KVFLEET_TEST_DEVICE."""
    return TEST_DEVICE


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
    from kvfleet_devkit.redis_server import RedisServer

    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.close()
