"""oneDNN-prepacked matmul weights (layers/prepack.py) and the CPU worker's allocator settings.

Both are CPU-only behaviour: every worker here is pinned to ``device="cpu"`` whatever the test device.
"""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.engine_args import EngineArgs
from kvfleet_engine.layers import prepack
from kvfleet_engine.layers.embed_head import ParallelLMHead
from kvfleet_engine.layers.linear import LinearBase
from kvfleet_engine.worker import host_allocator
from kvfleet_engine.worker.worker import Worker

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not prepack.prepack_supported(CPU, torch.float32), reason="torch built without oneDNN"
)


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    # A strided input, like the SiLU*up view the down projection gets.
    x = torch.randn(rows, 160, generator=gen)[:, ::2]
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    with torch.inference_mode():
        got = prepack.linear(x, weight, bias, packed)
        want = F.linear(x, weight, bias)
    assert got.shape == want.shape == (rows, 96)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_without_a_pack_it_is_f_linear():
    weight, x = torch.randn(8, 4), torch.randn(3, 4)
    assert torch.equal(prepack.linear(x, weight, None, None), F.linear(x, weight))


def test_prepack_is_for_float32_on_cpu_and_can_be_switched_off(monkeypatch):
    assert not prepack.prepack_supported(CPU, torch.bfloat16)
    assert not prepack.prepack_supported(torch.device("cuda"), torch.float32)
    monkeypatch.setenv(prepack.ENV_SWITCH, "0")
    assert not prepack.prepack_supported(CPU, torch.float32)


def _packable(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, (LinearBase, ParallelLMHead))]


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_worker_packs_every_matmul_weight_and_repacks_after_a_level2_wake(demo_model, arch):
    cfg = EngineConfig.create(
        EngineArgs(demo_model(arch=arch), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=16)
    )
    worker = Worker(cfg, use_tqdm=False)
    worker.initialize_kv_cache(worker.determine_num_kv_blocks())
    model = worker.runner.model
    layers = _packable(model)
    assert layers and all(m.packed_weight is not None for m in layers)
    report = worker.memory_report()
    # qwen2 tiny ties the LM head to the embedding: the pack is an extra copy of the head only.
    weight_bytes = sum(m.weight.numel() * 4 for m in layers)
    assert report["weight_packs"] == weight_bytes

    worker.sleep(2)
    assert all(m.packed_weight is None for m in layers)
    assert worker.memory_report()["weight_packs"] == 0
    worker.wake_up()
    assert all(m.packed_weight is not None for m in layers)
    assert worker.memory_report() == report
    # The packs hold the re-read weights, not stale ones.
    x = torch.randn(5, cfg.model.hidden_size)
    qkv = model.model.layers[0].self_attn.qkv_proj
    with torch.inference_mode():
        torch.testing.assert_close(qkv(x), F.linear(x, qkv.weight, qkv.bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_switched_off_the_worker_packs_nothing(demo_model, monkeypatch):
    monkeypatch.setenv(prepack.ENV_SWITCH, "off")
    cfg = EngineConfig.create(
        EngineArgs(demo_model(), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=16)
    )
    worker = Worker(cfg, use_tqdm=False)
    assert all(m.packed_weight is None for m in _packable(worker.runner.model))
    assert worker.memory_report()["weight_packs"] == 0


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's"
)
def test_cpu_workers_tune_glibc_malloc_once(demo_model, monkeypatch):
    monkeypatch.setattr(host_allocator, "_tuned", False)  # earlier tests' workers tuned this process
    cfg = EngineConfig.create(
        EngineArgs(demo_model(), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=16)
    )
    Worker(cfg, use_tqdm=False)
    assert host_allocator._tuned  # a CPU worker applied the settings
    assert host_allocator.tune_host_allocator()  # and applying them again is a no-op
