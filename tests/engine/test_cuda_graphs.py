"""Decode graphs (worker/cuda_graph.py) on the CPU: bucketing, padding and static buffers.

On the CPU a "captured graph" is the captured function itself, called again on the static buffers
(``eager_capture``), so everything but the CUDA calls runs here: which bucket a step takes, what the
padding rows hold, that nothing an earlier, larger step left in the buffers leaks into a later one,
and that the engine's greedy tokens do not change when decode steps go through the buffers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfleet_engine import LLM, SamplingParams
from kvfleet_engine.forward_context import get_attn_metadata
from kvfleet_engine.worker.cuda_graph import DecodeGraphs, capture_sizes, eager_capture


@pytest.mark.parametrize(
    ("max_num_seqs", "sizes"),
    [
        (1, [1]),
        (5, [1, 2, 4, 5]),
        (20, [1, 2, 4, 8, 16, 20]),
        (64, [1, 2, 4, 8, 16, 32, 48, 64]),
    ],
)
def test_capture_sizes(max_num_seqs, sizes):
    assert capture_sizes(max_num_seqs) == sizes


def test_capture_sizes_cover_every_batch_with_little_padding():
    sizes = capture_sizes(256)
    assert sizes[-1] == 256 and len(sizes) == 20
    for n in range(1, 257):
        bucket = sizes[np.searchsorted(sizes, n)]
        assert n <= bucket and bucket - n < 16


class _Probe(torch.nn.Module):
    """Records what each replay reads from the static buffers; returns the token ids as hidden states."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, list]] = []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        meta = get_attn_metadata()
        self.calls.append(
            {
                "ids": input_ids.tolist(),
                "positions": positions.tolist(),
                "slots": meta.slot_mapping.tolist(),
                "seq_lens": meta.seq_lens.tolist(),
                "first_block": meta.block_tables[:, 0].tolist(),
                "num_decodes": meta.num_decodes,
            }
        )
        return input_ids.float().unsqueeze(1) * 10


def _step(n: int, base: int) -> tuple[np.ndarray, ...]:
    ids = np.arange(base, base + n, dtype=np.int64)
    positions = np.full(n, 20 + base, dtype=np.int64)
    slots = np.arange(100 + base, 100 + base + n, dtype=np.int64)
    seq_lens = positions.astype(np.int32) + 1
    tables = np.full((n, 3), 7 + base, dtype=np.int32)
    return ids, positions, slots, seq_lens, tables


def test_padding_rows_hold_the_null_row_and_nothing_stale():
    probe = _Probe()
    graphs = DecodeGraphs(probe, "triton", 20, 8, 16, torch.device("cpu"), eager_capture)
    assert not graphs.can_run(3, 3)  # nothing captured yet
    graphs.capture()
    assert [len(c["ids"]) for c in probe.calls] == [20, 16, 8, 4, 2, 1]  # largest first
    assert graphs.can_run(3, 3) and graphs.can_run(20, 20)
    assert not graphs.can_run(3, 4)  # a prefill chunk among them: eager
    assert not graphs.can_run(21, 21)  # beyond the largest bucket: eager

    probe.calls.clear()
    hidden = graphs.run(*_step(7, base=1))  # bucket 8
    assert hidden.shape == (7, 1) and hidden[:, 0].tolist() == [10.0 * t for t in range(1, 8)]
    hidden = graphs.run(*_step(3, base=50))  # bucket 4: rows 3..6 of the 7-row step must not leak
    assert hidden[:, 0].tolist() == [500.0, 510.0, 520.0]
    first, second = probe.calls
    assert first["ids"] == [1, 2, 3, 4, 5, 6, 7, 0]
    assert first["slots"][7] == 0 and first["seq_lens"][7] == 1 and first["first_block"][7] == 0
    assert second == {
        "ids": [50, 51, 52, 0],
        "positions": [70, 70, 70, 0],
        "slots": [150, 151, 152, 0],  # the padding row writes into the null block's slot 0
        "seq_lens": [71, 71, 71, 1],
        "first_block": [57, 57, 57, 0],
        "num_decodes": 4,
    }
    graphs.release()
    assert not graphs.captured and not graphs.can_run(3, 3)


def _prompts(n: int) -> list[dict]:
    rng = np.random.default_rng(5)
    shared = rng.integers(3, 4000, 40).tolist()
    out = [{"prompt_token_ids": shared + rng.integers(3, 4000, k).tolist()} for k in (1, 5, 17)]
    out += [{"prompt_token_ids": rng.integers(3, 4000, int(k)).tolist()} for k in rng.integers(2, 90, n - 3)]
    return out


def _greedy(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "engine_kw",
    [
        {},
        # Few KV blocks: requests are preempted and recomputed; a small token budget chunks prefills.
        {"num_kv_blocks": 24, "max_num_batched_tokens": 64},
    ],
    ids=["plain", "preemption-chunked"],
)
def test_engine_tokens_are_the_same_through_the_decode_buffers(demo_model, engine_kw):
    path = demo_model(arch="qwen2")
    kw = {"device": "cpu", "dtype": "float32", "max_model_len": 256, "max_num_seqs": 12, **engine_kw}
    prompts = _prompts(11)  # 11 requests: most decode steps have a batch that is not a bucket size
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    eager = _greedy(LLM(path, use_tqdm=False, **kw).generate(prompts, params, use_tqdm=False))

    llm = LLM(path, use_tqdm=False, attention_backend="torch", **kw)
    runner = llm.engine.executor.worker.runner
    runner.use_decode_graphs(eager_capture)
    assert runner.graphs.captured
    assert _greedy(llm.generate(prompts, params, use_tqdm=False)) == eager
    steps = runner.graph_steps
    assert steps > 0
    # Second pass: prefix-cache hits, and decode steps still replayed.
    assert _greedy(llm.generate(prompts, params, use_tqdm=False)) == eager
    assert runner.graph_steps > steps


def test_sleep_releases_the_graphs_and_wake_captures_them_again(demo_model):
    llm = LLM(demo_model(), use_tqdm=False, device="cpu", dtype="float32", max_model_len=256, max_num_seqs=4)
    runner = llm.engine.executor.worker.runner
    runner.use_decode_graphs(eager_capture)
    prompts = _prompts(4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    before = _greedy(llm.generate(prompts, params, use_tqdm=False))
    llm.sleep(1)
    assert not runner.graphs.captured
    llm.wake_up(["weights"])
    assert not runner.graphs.captured  # the KV cache is still released: nothing to point at
    llm.wake_up(["kv_cache"])
    assert runner.graphs.captured
    steps = runner.graph_steps
    assert _greedy(llm.generate(prompts, params, use_tqdm=False)) == before
    assert runner.graph_steps > steps


@pytest.mark.triton
def test_triton_decode_through_the_buffers_matches_eager(demo_model, triton_device):
    """The GPU's attention kernels (interpreted on CPU) read the static block tables and context lengths."""
    path = demo_model()
    kw = {"device": triton_device, "dtype": "float32", "max_model_len": 64, "max_num_seqs": 4}
    prompts = [{"prompt_token_ids": [5 + i, 9, 33 + 7 * i]} for i in range(3)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eager = _greedy(LLM(path, use_tqdm=False, attention_backend="triton", **kw).generate(prompts, params))
    llm = LLM(path, use_tqdm=False, attention_backend="triton", **kw)
    runner = llm.engine.executor.worker.runner
    runner.use_decode_graphs(eager_capture)
    assert _greedy(llm.generate(prompts, params, use_tqdm=False)) == eager
    assert runner.graph_steps == 3  # every step after the prefill, in bucket 4 with one padding row


def test_captured_cuda_graphs_give_the_eager_tokens(demo_model, test_device):
    """On a GPU (KVFLEET_TEST_DEVICE=cuda): real capture and replay, float32, against ``enforce_eager``."""
    if not test_device.startswith("cuda"):
        pytest.skip("CUDA graphs need a GPU (KVFLEET_TEST_DEVICE=cuda)")
    path = demo_model(arch="qwen2")
    kw = {"device": test_device, "dtype": "float32", "max_model_len": 256, "max_num_seqs": 12}
    prompts = _prompts(11)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    eager_llm = LLM(path, use_tqdm=False, enforce_eager=True, **kw)
    assert eager_llm.engine.executor.worker.runner.graphs is None
    eager = _greedy(eager_llm.generate(prompts, params, use_tqdm=False))
    del eager_llm
    llm = LLM(path, use_tqdm=False, **kw)
    runner = llm.engine.executor.worker.runner
    assert runner.graphs is not None and runner.graphs.captured
    assert _greedy(llm.generate(prompts, params, use_tqdm=False)) == eager
    assert runner.graph_steps > 0
    llm.sleep(1)
    llm.wake_up()
    steps = runner.graph_steps
    assert _greedy(llm.generate(prompts, params, use_tqdm=False)) == eager
    assert runner.graph_steps > steps
