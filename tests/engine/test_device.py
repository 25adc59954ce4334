"""Device names: ``cuda``, ``cuda:N`` and per-rank devices reach ``torch.cuda.set_device`` with an index.

These run on a CPU-only torch: the lowest CUDA call (``torch._C._cuda_setDevice``) is replaced by a
recorder, so ``torch.cuda.set_device``'s own argument check still runs. A bare ``torch.device("cuda")``
fails that check on every torch build, which is how every GPU worker once died at start.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.device import bind_device, canonical_device, cuda_index, rank_device
from kvfleet_engine.engine_args import EngineArgs


@pytest.fixture
def set_device_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(torch._C, "_cuda_setDevice", calls.append, raising=False)
    return calls


@pytest.fixture
def two_gpus(monkeypatch) -> None:
    """``torch.cuda.device_count()`` says 2 (EngineConfig validates devices against it)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.mark.parametrize(
    ("name", "count", "expected"),
    [
        ("auto", 0, "cpu"),
        ("auto", 2, "cuda:0"),
        ("cpu", 2, "cpu"),
        ("CPU", 0, "cpu"),
        ("cuda", 1, "cuda:0"),
        ("cuda:1", 2, "cuda:1"),
        (" cuda:0 ", 1, "cuda:0"),
    ],
)
def test_canonical_device_always_names_an_index(name, count, expected):
    assert canonical_device(name, count) == expected


@pytest.mark.parametrize(
    ("name", "count", "message"),
    [
        ("cuda", 0, "no CUDA device is available"),
        ("cuda:2", 2, "only 2 CUDA device"),
        ("cuda:-1", 2, "unknown device"),
        ("cuda:x", 2, "unknown device"),
        ("tpu", 2, "unknown device"),
        ("", 2, "unknown device"),
    ],
)
def test_canonical_device_rejects_what_cannot_run(name, count, message):
    with pytest.raises(ValueError, match=message):
        canonical_device(name, count)


def test_bind_device_gives_set_device_an_index(set_device_calls):
    bind_device("cuda")
    bind_device("cuda:1")
    bind_device("cpu")  # nothing to bind
    assert set_device_calls == [0, 1]
    assert cuda_index("cuda") == 0 and cuda_index(torch.device("cuda", 3)) == 3


def test_rank_devices_count_up_from_the_configured_one():
    assert [rank_device("cuda:0", r) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [rank_device("cuda:2", r) for r in range(2)] == ["cuda:2", "cuda:3"]
    assert rank_device("cuda", 1) == "cuda:1"
    assert rank_device("cpu", 3) == "cpu"


@pytest.mark.parametrize(("asked", "kept"), [("cuda", "cuda:0"), ("cuda:1", "cuda:1"), ("auto", "cuda:0")])
def test_engine_config_keeps_the_canonical_device(demo_model, two_gpus, asked, kept):
    cfg = EngineConfig.create(EngineArgs(demo_model(), device=asked))
    assert cfg.device == kept
    assert cfg.dtype == torch.bfloat16  # dtype "auto" on a GPU: the checkpoint's float32 becomes bf16
    assert cfg.attention_backend == "triton"


def test_engine_config_checks_tensor_parallel_ranks_fit_from_the_first_device(demo_model, two_gpus):
    assert (
        EngineConfig.create(EngineArgs(demo_model(), device="cuda:0", tensor_parallel_size=2)).device
        == "cuda:0"
    )
    with pytest.raises(ValueError, match="needs 2 GPUs from cuda:1, found 1"):
        EngineConfig.create(EngineArgs(demo_model(), device="cuda:1", tensor_parallel_size=2))


def test_worker_binds_the_configured_cuda_device_before_building_the_runner(
    demo_model, two_gpus, set_device_calls, monkeypatch
):
    """The worker's first CUDA call, for a config made from ``device="cuda"`` (as ``kvfleet engine serve
    --device cuda`` makes it) and for an older config still holding a bare ``"cuda"``."""
    from kvfleet_engine.worker import worker as worker_module

    class RunnerReached(Exception):
        pass

    def runner(*args, **kwargs):
        raise RunnerReached

    # The runner would allocate on the GPU; stopping there shows the device was bound first.
    monkeypatch.setattr(worker_module, "ModelRunner", runner)
    cfg = EngineConfig.create(EngineArgs(demo_model(), device="cuda"))
    for device in ("cuda", cfg.device, "cuda:1"):
        with pytest.raises(RunnerReached):
            worker_module.Worker(dataclasses.replace(cfg, device=device), use_tqdm=False)
    assert set_device_calls == [0, 0, 1]
