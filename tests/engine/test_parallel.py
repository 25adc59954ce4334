"""Tensor and pipeline parallelism: same greedy tokens as one process, and no process outlives a failure.

Each parallel engine is started once per configuration and reused (starting worker processes is
the slow part). The reference is the single-process engine on the same float32 ``tiny`` model.

Everything runs on the test device (KVFLEET_TEST_DEVICE): on the CPU every rank is a process on the
same CPU (gloo); on CUDA every rank takes a GPU (NCCL), and a configuration with more ranks than the
machine has GPUs is skipped, saying so.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kvfleet_engine import LLM, SamplingParams
from kvfleet_engine.config import EngineConfig
from kvfleet_engine.engine_args import EngineArgs
from kvfleet_engine.executor.multiproc import WorkerFailure
from kvfleet_engine.input_processor import InputProcessor
from kvfleet_engine.structured_output.params import StructuredOutputsParams

MAX_NEW = 16
# Small token budget: long prompts are prefilled in chunks, mixed with other requests' decodes. A
# KV cache of 15 usable blocks cannot hold every request at once: some are preempted and recomputed.
ENGINE_ARGS = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=40, num_kv_blocks=16)
REPO = Path(__file__).resolve().parents[2]


def _prompts() -> list[list[int]]:
    rng = random.Random(99)
    shared = [rng.randrange(3, 4096) for _ in range(48)]  # shared prefix: cache hits within a pass
    prompts = [shared + [rng.randrange(3, 4096) for _ in range(k)] for k in (1, 7, 33)]
    prompts += [[rng.randrange(3, 4096) for _ in range(k)] for k in (2, 21, 95)]
    return prompts


def _greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody reaped yet (it holds no resources)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if not _gone(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if not _gone(p)]


@pytest.fixture(scope="module")
def reference(demo_model, test_device):
    cache: dict[str, list[list[int]]] = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in cache:
            llm = LLM(demo_model(arch=arch), device=test_device, use_tqdm=False, **ENGINE_ARGS)
            cache[arch] = _tokens(llm, _prompts())
            llm.shutdown()
        return cache[arch]

    return get


CASES = [
    pytest.param(("llama", 2, 1), id="llama-tp2"),
    pytest.param(("qwen2", 1, 2), id="qwen2-pp2"),
    pytest.param(("mistral", 2, 2), id="mistral-tp2-pp2"),
    pytest.param(("qwen2", 2, 1), id="qwen2-tp2", marks=pytest.mark.slow),
    pytest.param(("mistral", 2, 1), id="mistral-tp2", marks=pytest.mark.slow),
    pytest.param(("llama", 1, 2), id="llama-pp2", marks=pytest.mark.slow),
    pytest.param(("mistral", 1, 2), id="mistral-pp2", marks=pytest.mark.slow),
    pytest.param(("llama", 2, 2), id="llama-tp2-pp2", marks=pytest.mark.slow),
    pytest.param(("qwen2", 2, 2), id="qwen2-tp2-pp2", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module", params=CASES)
def parallel(request, demo_model, test_device, require_gpus):
    arch, tp, pp = request.param
    require_gpus(tp * pp)
    llm = LLM(
        demo_model(arch=arch),
        device=test_device,
        use_tqdm=False,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        **ENGINE_ARGS,
    )
    yield arch, llm
    pids = llm.engine.executor.worker_pids
    llm.shutdown()
    assert _wait_gone(pids, 10) == []


def test_greedy_tokens_equal_single_process_with_prefix_hits_and_chunked_prefill(parallel, reference):
    arch, llm = parallel
    ref = reference(arch)
    assert _tokens(llm, _prompts()) == ref
    kv = llm.engine.scheduler.kv
    hits_before = kv.stats.hit_rate
    # Second pass: every prompt's full blocks are cached now.
    assert _tokens(llm, _prompts()[::-1]) == ref[::-1]
    assert kv.stats.hit_rate > hits_before
    assert llm.engine.scheduler.num_preemptions > 0  # the small cache forced recomputes along the way
    assert llm.engine.executor.collective_rpc("num_request_states") == [0] * llm.engine.executor.world_size
    assert kv.get_num_free_blocks() == kv.block_pool.num_usable_blocks


# Structured outputs: every rank applies the same step bitmask (it travels in the SchedulerOutput).
_SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
    "required": ["id", "ok"],
    "additionalProperties": False,
}


def _structured_texts(llm: LLM) -> list[str]:
    params = SamplingParams(
        max_tokens=48, temperature=0.0,
        structured_outputs=StructuredOutputsParams(json=_SCHEMA, disable_any_whitespace=True),
    )  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def structured_reference(demo_model, test_device):
    cache: dict[str, list[str]] = {}

    def get(arch: str) -> list[str]:
        if arch not in cache:
            llm = LLM(demo_model(arch=arch), device=test_device, use_tqdm=False, **ENGINE_ARGS)
            cache[arch] = _structured_texts(llm)
            llm.shutdown()
        return cache[arch]

    return get


def test_structured_outputs_equal_single_process(request, parallel, structured_reference):
    if request.node.get_closest_marker("slow"):
        # the grammar bitmask reaches every rank the same way in every layout: the three fast cases (TP, PP,
        # TP x PP) cover it, and the suite's time goes to the parity tests of the other six
        pytest.skip("structured outputs are checked on the fast TP/PP layouts")
    arch, llm = parallel
    got = _structured_texts(llm)
    assert got == structured_reference(arch)
    assert all(set(json.loads(t)) == {"id", "ok"} for t in got)


def test_abort_mid_generation_reaches_every_rank(parallel, reference):
    arch, llm = parallel
    core = llm.engine
    proc = InputProcessor(core.config, tokenizer=None)
    prompts = _prompts()
    for i, p in enumerate(prompts):
        core.add_request(proc.process(f"abort-{i}", p, _greedy()))
    # Unseeded random sampling: every rank must still draw the same tokens (same generator state).
    sampled = SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_p=0.9, ignore_eos=True)
    core.add_request(proc.process("abort-random", prompts[2], sampled))
    tokens: dict[str, list[int]] = {f"abort-{i}": [] for i in range(len(prompts))} | {"abort-random": []}
    for _ in range(12):
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
    # Every rank holds the same view of every request (tokens, progress, blocks) mid-generation.
    states = core.executor.collective_rpc("request_states")
    assert states[0] and all(s == states[0] for s in states[1:])
    core.abort_requests(["abort-1", "abort-4"])
    while core.has_pending_work():
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
    ref = reference(arch)
    for i in (0, 2, 3, 5):
        assert tokens[f"abort-{i}"] == ref[i]
    assert len(tokens["abort-random"]) == MAX_NEW
    assert core.executor.collective_rpc("num_request_states") == [0] * core.executor.world_size


def test_sleep_and_wake_on_every_rank(parallel, reference, on_cuda):
    arch, llm = parallel
    core = llm.engine
    if core.config.tensor_parallel_size * core.config.pipeline_parallel_size < 4:
        pytest.skip("exercised on the TP x PP configuration (every rank kind at once)")
    full = core.executor.memory_report()  # summed over the ranks
    assert full["weights"] > 0 and full["kv_cache"] > 0
    if on_cuda:
        assert "weight_packs" not in full and full["torch_allocated"] >= full["weights"] + full["kv_cache"]
    else:
        assert full["weight_packs"] > 0  # every rank packs its own shard (CPU, float32)
    core.sleep(2)
    asleep = core.executor.memory_report()
    if on_cuda:
        assert (asleep["weights"], asleep["kv_cache"]) == (0, 0)
        # The allocators really gave the memory back (no reference left behind anywhere).
        assert full["torch_allocated"] - asleep["torch_allocated"] >= full["weights"] + full["kv_cache"]
    else:
        assert asleep == {"weights": 0, "kv_cache": 0, "weight_packs": 0}
    core.wake_up()
    woke = core.executor.memory_report()
    # torch_allocated also counts per-step leftovers and graph pools: only what sleep released must be back.
    assert {k: woke[k] for k in full if k != "torch_allocated"} == {
        k: v for k, v in full.items() if k != "torch_allocated"
    }
    assert _tokens(llm, _prompts()) == reference(arch)


def test_invalid_parallel_sizes_fail_at_start_up_with_the_reason(demo_model, test_device, on_cuda):
    path = demo_model(arch="llama")  # tiny: 4 heads, 2 KV heads, 4 layers
    # What the model can be split by does not depend on the device: checked on the CPU, where any
    # number of ranks is possible.
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        EngineConfig.create(EngineArgs(path, device="cpu", tensor_parallel_size=3))
    with pytest.raises(ValueError, match="exceeds the model's 4 layers"):
        EngineConfig.create(EngineArgs(path, device="cpu", pipeline_parallel_size=5))
    with pytest.raises(ValueError, match="positive integer"):
        EngineConfig.create(EngineArgs(path, device="cpu", tensor_parallel_size=0))
    with pytest.raises(ValueError, match="need distributed_executor_backend='mp'"):
        EngineConfig.create(
            EngineArgs(path, device="cpu", tensor_parallel_size=2, distributed_executor_backend="uni")
        )
    cfg = EngineConfig.create(
        EngineArgs(path, device="cpu", tensor_parallel_size=4, pipeline_parallel_size=4)
    )
    assert cfg.distributed_executor_backend == "mp"  # 2 KV heads replicated over 4 ranks is fine
    if on_cuda:  # on CUDA every rank needs a GPU of its own
        import torch

        have = torch.cuda.device_count() - int(test_device.partition(":")[2] or 0)
        if have < 16:
            with pytest.raises(ValueError, match="needs 16 GPUs"):
                EngineConfig.create(
                    EngineArgs(path, device=test_device, tensor_parallel_size=4, pipeline_parallel_size=4)
                )


def test_killed_worker_fails_the_engine_fast_and_leaves_no_process(demo_model, test_device, require_gpus):
    require_gpus(2)
    failures: list[str] = []
    llm = LLM(
        demo_model(arch="llama"), device=test_device, use_tqdm=False, tensor_parallel_size=2, **ENGINE_ARGS
    )
    executor = llm.engine.executor
    executor.failure_callback = failures.append
    pids = list(executor.worker_pids)
    killed_at: list[float] = []

    def kill_rank1() -> None:
        killed_at.append(time.monotonic())
        os.kill(pids[1], signal.SIGKILL)

    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    timer = threading.Timer(1.0, kill_rank1)
    timer.start()
    try:
        with pytest.raises(WorkerFailure, match=rf"rank 1 \(pid {pids[1]}"):
            llm.generate(prompts, params, use_tqdm=False)
        reported_after = time.monotonic() - killed_at[0]
    finally:
        timer.cancel()
        llm.shutdown()
    assert reported_after < 10
    assert executor.is_failed and failures and "rank 1" in failures[0]
    assert _wait_gone(pids, 10) == []


_PARENT_SCRIPT = textwrap.dedent(
    """
    import sys
    from kvfleet_engine import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(sys.argv[1], device=sys.argv[2], use_tqdm=False, pipeline_parallel_size=2, dtype="float32",
                  max_model_len=512)
        print("PIDS", *llm.engine.executor.worker_pids, flush=True)
        params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        while True:
            llm.generate(["a prompt"] * 4, params, use_tqdm=False)
    """
)


def test_killed_parent_takes_its_workers_with_it(demo_model, tmp_path, test_device, require_gpus):
    require_gpus(2)
    script = tmp_path / "parent.py"
    script.write_text(_PARENT_SCRIPT)
    parent = subprocess.Popen(
        [sys.executable, str(script), str(demo_model(arch="llama")), test_device],
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        line = parent.stdout.readline()
        assert line.startswith("PIDS"), f"parent did not start its workers: {line!r}"
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
        time.sleep(0.5)  # mid-generation
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert _wait_gone(pids, 10) == []
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.wait()
