"""No kernel is compiled while the engine serves: the warm-up at start runs every variant a step can need.

Triton compiles a kernel variant on its first launch (about a second each). On the first GPU run of
``bench/gpu_throughput.py`` the offline engine, first on a cold Triton cache, measured 18.6k output tok/s
where the server, started next on the warm cache, measured 29.8k: the offline run had compiled mid-run.
On the CPU the warm-up's seam runs under the interpreter; on a GPU (KVFLEET_TEST_DEVICE=cuda) the last
test counts the compiled variants themselves.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kvfleet_engine import LLM, SamplingParams  # noqa: E402
from kvfleet_engine.ops import attention_triton, elementwise_triton  # noqa: E402

pytestmark = pytest.mark.triton


@pytest.mark.parametrize(
    ("max_context", "counts"),
    [(16, [1]), (511, [1]), (512, [1, 2]), (2048, [1, 2, 4, 8]), (1 << 20, [1, 2, 4, 8, 16, 32])],
)
def test_decode_split_counts(max_context, counts):
    assert attention_triton.decode_split_counts(max_context) == counts


def test_every_split_count_chosen_is_one_the_warm_up_compiles():
    for sms in (66, 114, 132):
        for kv_heads in (1, 2, 8):
            for max_context in (64, 300, 2048, 4096, 32768):
                warmed = set(attention_triton.decode_split_counts(max_context))
                for num_seqs in range(1, 300):
                    n = attention_triton.split_count(sms, num_seqs, kv_heads, max_context, 64)
                    assert n in warmed, (sms, kv_heads, max_context, num_seqs, n)


def test_warm_up_runs_a_mixed_step_and_every_split_count_and_writes_only_the_null_block(
    demo_model, monkeypatch, triton_device
):
    path = demo_model(arch="llama", preset="tiny")
    llm = LLM(
        path, dtype="float32", device=triton_device, attention_backend="triton", max_model_len=600,
        use_tqdm=False,
    )  # fmt: skip
    runner = llm.engine.executor.worker.runner
    splits, prefills = [], []
    decode, prefill = attention_triton.decode_attention, attention_triton.prefill_attention

    def spy_decode(*a, **kw):
        splits.append(kw.get("num_splits"))
        return decode(*a, **kw)

    def spy_prefill(*a, **kw):
        prefills.append(a[0].shape[0])
        return prefill(*a, **kw)

    monkeypatch.setattr(attention_triton, "decode_attention", spy_decode)
    monkeypatch.setattr(attention_triton, "prefill_attention", spy_prefill)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 99, 230, 41], [7, 7, 300, 12])]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    llm.reset_prefix_cache()
    for k, v in runner.kv_caches:
        k.zero_()
        v.zero_()
    splits.clear()
    prefills.clear()

    if triton_device == "cpu":
        runner.warm_up()  # a CPU engine does not warm up ...
        assert splits == [] and prefills == []
        runner.warm_up(force=True)  # ... unless told to (the interpreter runs the kernels here)
    else:
        runner.warm_up()  # what the worker ran before capturing the decode graphs, once more

    layers = len(runner.attn_layers)
    # The mixed step: per layer, its decode row (split count chosen) and its two prefills (5 query rows).
    assert prefills == [5] * layers
    assert splits.count(None) == layers
    max_context = runner.max_blocks_per_req * runner.block_size
    assert [s for s in splits if s is not None] == attention_triton.decode_split_counts(max_context)
    assert len(attention_triton.decode_split_counts(max_context)) > 1  # 600 tokens: 1 and 2 splits
    for k, v in runner.kv_caches:
        assert k[0].abs().sum() > 0  # the mixed step wrote its K/V into the null block ...
        assert not k[1:].any() and not v[1:].any()  # ... and nowhere else
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert after == before and [len(t) for t in after] == [6, 6]
    assert llm.num_free_kv_blocks == llm.engine.num_kv_blocks - 1  # every block back but the null one
    llm.shutdown()


def _compiled_variants() -> dict[str, int]:
    """Compiled variants of every engine kernel, from the JIT functions' per-device caches."""
    counts = {}
    for module in (attention_triton, elementwise_triton):
        for name in dir(module):
            fn = getattr(module, name)
            caches = getattr(fn, "device_caches", None)
            if name.endswith("_kernel") and caches is not None:
                counts[f"{module.__name__.rsplit('.', 1)[-1]}.{name}"] = sum(
                    len(c[0]) for c in caches.values()
                )
    return counts


def test_serving_compiles_nothing_after_the_warm_up(demo_model, test_device):
    """Mixed steps with every kind of misalignment, short and long contexts, batch sizes from 1 up."""
    if not test_device.startswith("cuda"):
        pytest.skip("compiled Triton kernels run on a GPU only (KVFLEET_TEST_DEVICE=cuda)")
    path = demo_model(arch="qwen2", preset="tiny")
    llm = LLM(path, dtype="bfloat16", device=test_device, max_model_len=4096, max_num_seqs=64, use_tqdm=False)
    start = _compiled_variants()
    assert start and all(n > 0 for n in start.values()), start
    # Prompt lengths around block and 16-token boundaries, arriving in an order that mixes decodes and
    # prefills in one step with the prefill rows starting at every offset; outputs long enough to decode.
    lengths = [1, 3, 15, 16, 17, 31, 33, 100, 255, 257, 700, 1500, 3000]
    prompts = [
        {"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(n)]} for i, n in enumerate(lengths * 3)
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=1 + (i * 37) % 90, ignore_eos=True)
        for i in range(len(prompts))
    ]
    llm.generate(prompts, params, use_tqdm=False)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert _compiled_variants() == start
    llm.shutdown()
