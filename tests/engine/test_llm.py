"""Offline API behaviour: sampling reproducibility, n, stop conditions, bad input, no leaks.

On the test device, in float32: reproducibility claims (same seed, same tokens whatever the batch or
the chunking) are about the engine's bookkeeping, not about bfloat16 rounding across batch shapes.
"""

from __future__ import annotations

import pytest

from kvfleet_engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(demo_model, test_device):
    return LLM(
        demo_model(arch="llama"), device=test_device, dtype="float32", use_tqdm=False, max_model_len=512
    )


def _no_leaks(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert (
        llm.engine.scheduler.kv.block_pool.get_num_free_blocks()
        == llm.engine.scheduler.kv.block_pool.num_usable_blocks
    )
    assert not llm.engine.scheduler.kv.req_to_blocks
    assert not llm.output_processor.requests
    assert not llm.engine.executor.worker.runner.requests


PROMPTS = ["Once upon a time", "The river", "Numbers like 42 and 7 are", "A quiet morning in the city"]


def test_same_seed_same_text_whatever_the_batch(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0]
    others = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)
    in_batch = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others, sp, others], use_tqdm=False)[
        1
    ].outputs[0]
    reversed_batch = llm.generate([PROMPTS[3], PROMPTS[2], PROMPTS[0]], [others, others, sp], use_tqdm=False)[
        2
    ]
    assert alone.token_ids == in_batch.token_ids == reversed_batch.outputs[0].token_ids
    assert alone.text == in_batch.text
    other_seed = llm.generate(
        PROMPTS[0],
        SamplingParams(temperature=1.0, top_p=0.9, seed=8, max_tokens=20, ignore_eos=True),
        use_tqdm=False,
    )
    assert other_seed[0].outputs[0].token_ids != alone.token_ids
    _no_leaks(llm)


def test_seeded_sampling_survives_chunked_prefill(demo_model, test_device):
    path = demo_model(arch="llama")
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(5, 105))}
    kw = {"device": test_device, "dtype": "float32", "use_tqdm": False}
    a = LLM(path, **kw).generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    b = (
        LLM(path, max_num_batched_tokens=16, **kw)
        .generate(prompt, sp, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    assert a == b


def test_n_returns_distinct_reproducible_samples(llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    out = llm.generate(PROMPTS[1], sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    again = llm.generate(PROMPTS[1], sp, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    _no_leaks(llm)


def test_stop_string_truncates_and_stops(llm):
    full = llm.generate(
        PROMPTS[2], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )[0]
    text = full.outputs[0].text
    assert len(text) > 12
    stop = text[8:12]
    first = text.find(stop)
    out = llm.generate(
        PROMPTS[2], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:first]
    assert len(out.token_ids) < len(full.outputs[0].token_ids)
    kept = llm.generate(
        PROMPTS[2],
        SamplingParams(
            temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: first + len(stop)]
    _no_leaks(llm)


def test_stop_token_ids_and_length(llm):
    full = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    stop_id = full.token_ids[5]
    out = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    held = llm.generate(
        PROMPTS[0],
        SamplingParams(
            temperature=0, max_tokens=20, stop_token_ids=[stop_id], min_tokens=15, ignore_eos=True
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(held.token_ids) >= 15
    _no_leaks(llm)


def test_max_model_len_caps_generation(llm):
    prompt = {"prompt_token_ids": [7] * 500}
    out = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(max_tokens=-3), "max_tokens"),
        (lambda: SamplingParams(temperature=-0.1), "temperature"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
        (lambda: SamplingParams(top_k=-5), "top_k"),
        (lambda: SamplingParams(n=0), "n must"),
        (lambda: SamplingParams(min_tokens=5, max_tokens=2), "min_tokens"),
        (lambda: SamplingParams(presence_penalty=3.0), "presence_penalty"),
        (lambda: SamplingParams(stop=[""]), "stop strings"),
    ],
)
def test_invalid_sampling_params_raise_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ({"prompt_token_ids": [1] * 600}, SamplingParams(), "maximum context length"),
        ({"prompt_token_ids": [1] * 512}, SamplingParams(), "maximum context length"),
        ("", SamplingParams(), "empty"),
        ({"prompt_token_ids": []}, SamplingParams(), "empty"),
        ({"prompt_token_ids": [10**9]}, SamplingParams(), "out of vocabulary"),
        ({"prompt_token_ids": [-1]}, SamplingParams(), "out of vocabulary"),
        ("hello", SamplingParams(stop_token_ids=[10**7]), "stop_token_ids"),
        ("hello", SamplingParams(logprobs=50), "logprobs"),
        (12345, SamplingParams(), "prompt must be"),
    ],
)
def test_bad_requests_raise_and_leak_nothing(llm, prompt, params, match):
    # The bad prompt sits between good ones: nothing of the batch may stay behind.
    with pytest.raises(ValueError, match=match):
        llm.generate(["good prompt one", prompt, "good prompt two"], params, use_tqdm=False)
    _no_leaks(llm)
    assert llm.generate("still works", SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids


def test_engine_config_errors(demo_model, tmp_path, test_device):
    path = demo_model(arch="llama")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(path, device=test_device, max_model_len=10**7, use_tqdm=False)
    with pytest.raises(ValueError, match="block_size"):
        LLM(path, device=test_device, block_size=12, use_tqdm=False)
    with pytest.raises(ValueError, match=r"config\.json"):
        LLM(tmp_path, device=test_device, use_tqdm=False)
    (tmp_path / "config.json").write_text(
        '{"architectures": ["GPT2LMHeadModel"], "vocab_size": 10, '
        '"hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, '
        '"num_attention_heads": 1}'
    )
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(tmp_path, device=test_device, use_tqdm=False)


def test_missing_tensor_is_named(demo_model, tmp_path, test_device):
    import shutil

    from safetensors.torch import load_file, save_file

    src = demo_model(arch="llama")
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model"):
            shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        LLM(tmp_path, device=test_device, use_tqdm=False)


def test_cache_smaller_than_max_model_len_is_rejected_at_start(demo_model, test_device):
    with pytest.raises(ValueError, match="less than max_model_len=200"):
        LLM(demo_model(arch="llama"), device=test_device, num_kv_blocks=4, max_model_len=200, use_tqdm=False)
