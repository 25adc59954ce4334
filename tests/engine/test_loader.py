"""Weight loading: sharded checkpoints, dtype conversion, tied embeddings, the Triton path.

Engines run on the test device (KVFLEET_TEST_DEVICE) with the dtype each test is about spelled out.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvfleet_engine import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": [5, 9, 300, 17] * 5}]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_sharded_checkpoint_loads_identically(demo_model, test_device):
    single = demo_model(arch="mistral")
    sharded = demo_model(arch="mistral", shard_size=100_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    kw = {"device": test_device, "dtype": "float32", "use_tqdm": False}
    assert _tokens(LLM(sharded, **kw)) == _tokens(LLM(single, **kw))


def test_tied_embeddings_share_one_tensor(demo_model, test_device):
    llm = LLM(demo_model(arch="qwen2"), device=test_device, use_tqdm=False)
    model = llm.engine.executor.worker.runner.model
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None  # Qwen2's q/k/v biases


def test_bfloat16_checkpoint_upcast_matches_hf(demo_model, test_device, hf_float32):
    path = demo_model(arch="llama", dtype="bfloat16")
    ours = _tokens(LLM(path, device=test_device, dtype="float32", use_tqdm=False))
    hf = hf_float32(path)  # the bfloat16 checkpoint upcast, on the same device
    assert hf.dtype == torch.float32
    for p, toks in zip(PROMPTS, ours):
        ids = torch.tensor([p["prompt_token_ids"]], device=test_device)
        ref = hf.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
        assert toks == ref[0, ids.shape[1] :].tolist()


def test_bfloat16_compute_agrees_where_float32_is_confident(demo_model, test_device):
    path = demo_model(arch="llama")
    prompts = [{"prompt_token_ids": [3 + (i * 37 + j * 11) % 4000 for j in range(12 + i)]} for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=2)
    fp32 = LLM(path, device=test_device, dtype="float32", use_tqdm=False).generate(
        prompts, params, use_tqdm=False
    )
    bf16 = LLM(path, device=test_device, dtype="bfloat16", use_tqdm=False).generate(
        prompts, params, use_tqdm=False
    )
    confident = 0
    for a, b in zip(fp32, bf16):
        entry = a.outputs[0].logprobs[0]
        top1, top2 = sorted((lp.logprob for lp in entry.values()), reverse=True)[:2]
        # bf16 arithmetic moves logits by ~1e-2 relative: only clear winners must survive it.
        if top1 - top2 > 1.0:
            confident += 1
            assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert confident >= 4


@pytest.mark.triton
def test_triton_attention_backend_matches_torch(demo_model, triton_device):
    """Float32: the two backends' bfloat16 roundings may legitimately split a near-tie differently.
    On the CPU the Triton kernels run under TRITON_INTERPRET=1 (tests/engine/conftest.py)."""
    path = demo_model(arch="llama")
    prompts = [{"prompt_token_ids": list(range(3, 23))}, {"prompt_token_ids": list(range(50, 59))}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    kw = {"device": triton_device, "dtype": "float32", "use_tqdm": False}
    ref = _tokens(LLM(path, attention_backend="torch", **kw), prompts, params)
    llm = LLM(path, attention_backend="triton", max_num_batched_tokens=16, **kw)
    assert _tokens(llm, prompts, params) == ref
    assert _tokens(llm, prompts, params) == ref  # prefix-cache hits through the Triton prefill kernel
