"""Sleep / wake of the worker: memory really released, outputs bit-identical after waking.

Driven through ``EngineCore`` (scheduler + executor + worker) on the float32 ``tiny`` model, on the test
device (KVFLEET_TEST_DEVICE). What "released" means depends on the device, by design (worker.py):

- KV cache: freed at both levels, everywhere.
- Weights at level 1: on the CPU they already are host memory and stay put (their oneDNN packs too); on
  CUDA they move to pinned host memory, so none are left on the GPU. At level 2 they are discarded
  everywhere (and the CPU's packs with them), then re-read from the checkpoint on wake.
- ``memory_report`` counts the device's storage: ``weight_packs`` on the CPU, ``torch_allocated`` (the
  caching allocator's total) on CUDA. The allocator total also holds per-step leftovers and the decode
  graphs' pool, so on CUDA it is checked for what sleep must give back, not compared for equality.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.core.engine_core import EngineCore
from kvfleet_engine.engine_args import EngineArgs
from kvfleet_engine.input_processor import InputProcessor
from kvfleet_engine.sampling_params import SamplingParams

MAX_NEW = 12


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 4096) for _ in range(40)]  # shared prefix: cache hits in one batch
    return [shared + [rng.randrange(3, 4096) for _ in range(k)] for k in (1, 9, 30)] + [
        [rng.randrange(3, 4096) for _ in range(70)]
    ]


def _generate(core: EngineCore, prompts: list[list[int]], tag: str) -> list[list[int]]:
    proc = InputProcessor(core.config, tokenizer=None)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        core.add_request(proc.process(rid, p, params))
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while core.has_pending_work():
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[rid] for rid in ids]


def _core(path, device: str, **kw) -> EngineCore:
    # Small chunks: prompts are prefilled over several steps (chunked prefill in the mix).
    cfg = EngineConfig.create(
        EngineArgs(path, device=device, dtype="float32", max_model_len=256, max_num_batched_tokens=48, **kw)
    )
    return EngineCore(cfg, use_tqdm=False)


def _unique_bytes(module: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def module_core(request, demo_model, test_device):
    c = _core(demo_model(arch=request.param), test_device)
    yield c
    c.shutdown()


@pytest.fixture
def core(module_core):
    yield module_core
    # A test that failed between sleep and wake must not hand the next one a sleeping engine.
    module_core.wake_up()
    module_core.executor.wake_up(None)  # also what a test put to sleep behind the core's back


def _device_part(report: dict[str, int]) -> dict[str, int]:
    """What sleep/wake must restore exactly: everything but the CUDA allocator's running total."""
    return {k: v for k, v in report.items() if k != "torch_allocated"}


def test_memory_report_counts_each_storage_once(core, on_cuda):
    worker = core.executor.worker
    report = core.executor.memory_report()
    assert report["weights"] == _unique_bytes(worker.runner.model)
    assert report["kv_cache"] == core.num_kv_blocks * core.config.kv_bytes_per_block
    if on_cuda:  # the allocator's total holds at least the weights and the KV cache
        assert "weight_packs" not in report
        assert report["torch_allocated"] >= report["weights"] + report["kv_cache"]
    else:  # host memory: the oneDNN packs are counted apart, and there is no CUDA allocator
        assert "weight_packs" in report and "torch_allocated" not in report
    if core.config.model.tie_word_embeddings:  # qwen2 tiny: the LM head is the embedding
        model = worker.runner.model
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_memory_and_wake_gives_identical_greedy_outputs(core, level, on_cuda):
    prompts = _prompts()
    before = _generate(core, prompts, f"before{level}")
    full = core.executor.memory_report()
    assert full["kv_cache"] > 0 and full["weights"] > 0
    worker = core.executor.worker

    core.sleep(level)
    asleep = core.executor.memory_report()
    assert asleep["kv_cache"] == 0
    if on_cuda:
        # Level 1 moved the weights to pinned host memory, level 2 discarded them: none left on the GPU.
        assert asleep["weights"] == 0
        # And the allocator got it all back: no reference anywhere kept a weight or KV tensor alive.
        assert full["torch_allocated"] - asleep["torch_allocated"] >= full["weights"] + full["kv_cache"]
        if level == 1:  # every byte of the weights waits in page-locked host memory
            host = list(worker._host_weights.values())
            assert host and all(t.device.type == "cpu" and t.is_pinned() for t in host)
            assert sum(t.untyped_storage().nbytes() for t in host) == full["weights"]
    elif level == 1:  # CPU: the weights already are host memory, so level 1 keeps them (and their packs)
        assert _device_part(asleep) == {**full, "kv_cache": 0}
    else:
        assert asleep["weights"] == asleep["weight_packs"] == 0
    # The prefix cache went with the KV memory: every usable block is free and nothing is cached.
    kv = core.scheduler.kv
    assert kv.get_num_free_blocks() == kv.block_pool.num_usable_blocks

    core.wake_up()
    woke = core.executor.memory_report()
    assert _device_part(woke) == _device_part(full)
    if on_cuda:
        assert woke["torch_allocated"] - asleep["torch_allocated"] >= full["weights"] + full["kv_cache"]
    else:
        assert woke == full
    after = _generate(core, prompts, f"after{level}")
    assert after == before


def test_sleep_twice_wake_twice_and_wake_by_parts(core):
    prompts = _prompts()[:2]
    ref = _generate(core, prompts, "ref")
    core.sleep(2)
    core.sleep(2)  # no-op while asleep
    core.executor.sleep(1)  # the executor too: nothing left to release
    assert core.executor.memory_report()["weights"] == 0

    core.wake_up(["kv_cache"])
    report = core.executor.memory_report()
    assert report["kv_cache"] == core.num_kv_blocks * core.config.kv_bytes_per_block
    assert report["weights"] == 0
    core.wake_up(["kv_cache"])  # already awake: no-op
    core.wake_up(["weights"])
    core.wake_up()
    core.executor.wake_up(None)
    assert core.executor.memory_report()["weights"] == _unique_bytes(core.executor.worker.runner.model)
    assert _generate(core, prompts, "again") == ref


def test_worker_refuses_to_run_while_asleep_and_bad_arguments_are_clear(core):
    worker = core.executor.worker
    with pytest.raises(ValueError, match="sleep level"):
        worker.sleep(3)
    with pytest.raises(ValueError, match="unknown wake_up tags"):
        worker.wake_up(["weights", "gpu"])
    worker.sleep(1)
    try:
        with pytest.raises(RuntimeError, match="asleep"):
            worker.execute_model(core.scheduler.schedule())
    finally:
        worker.wake_up()
    assert not worker.asleep and worker.sleep_level == 0


def test_wake_after_level2_rereads_weights_that_match_the_checkpoint(demo_model, test_device):
    from safetensors.torch import load_file

    path = demo_model(arch="mistral")
    core = _core(path, test_device)
    try:
        core.sleep(2)
        core.wake_up(["weights"])
        model = core.executor.worker.runner.model
        ckpt = {}
        for f in sorted(path.glob("*.safetensors")):
            ckpt.update(load_file(str(f)))
        layer = model.model.layers[0]
        assert layer.self_attn.qkv_proj.weight.device == torch.device(core.config.device)
        q = ckpt["model.layers.0.self_attn.q_proj.weight"]  # the checkpoint is read on the CPU
        assert torch.equal(layer.self_attn.qkv_proj.weight[: q.shape[0]].cpu(), q)
        assert torch.equal(layer.mlp.down_proj.weight.cpu(), ckpt["model.layers.0.mlp.down_proj.weight"])
        core.wake_up(["kv_cache"])
        assert not core.is_sleeping
    finally:
        core.shutdown()
