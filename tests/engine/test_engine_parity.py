"""Greedy tokens and logprobs of the engine equal HF transformers' on the same weights.

Every configuration that changes *how* the engine computes (prefix-cache hits, chunked prefill,
preemption with recompute, the C decode kernel vs the torch path, Triton vs torch attention) must not
change *what* it computes.

Exact parity is a float32 claim: the engine (``dtype="float32"``) and the HF reference (float32, eager
attention) both run on the test device (KVFLEET_TEST_DEVICE). bfloat16 has its own tolerances
(test_bf16_agreement.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from kvfleet_engine import LLM, SamplingParams

ARCHS = ["llama", "qwen2", "mistral"]
MAX_NEW = 24
# |engine - HF| per logprob, float32 on both sides: the CPU's kernels agree to ~1e-5; on CUDA, cuBLAS
# picks other kernels (reduction orders) for the engine's batched shapes than for HF's batch of one.
LOGPROB_ATOL = {"cpu": 1e-4, "cuda": 1e-3}


def _prompts(tokenizer, vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    texts = [
        "The old lighthouse keeper",
        "Bread rises because yeast",
        "def fibonacci(n):\n    return",
        "Rain fell on the quiet valley while the farmers",
    ]
    prompts = [tokenizer.encode(t) for t in texts]
    shared = [rng.randrange(3, vocab) for _ in range(40)]  # a shared prefix: cache hits on the 2nd pass
    for extra in (1, 9, 37, 90):
        prompts.append(shared + [rng.randrange(3, vocab) for _ in range(extra)])
    prompts.append([rng.randrange(3, vocab) for _ in range(150)])
    return prompts


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, demo_model, hf_float32, test_device):
    from transformers import AutoTokenizer

    path = demo_model(arch=request.param)
    tok = AutoTokenizer.from_pretrained(path)
    hf = hf_float32(path)
    prompts = _prompts(tok, hf.config.vocab_size)
    refs = []
    logits_refs = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(
                torch.tensor([p], device=test_device),
                max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            refs.append(out.sequences[0, len(p) :].tolist())
            logits_refs.append(torch.stack([lg[0] for lg in out.logits]).float().cpu())
    return {"arch": request.param, "path": path, "prompts": prompts, "refs": refs, "logits": logits_refs}


def _llm(case, device: str, **kw) -> LLM:
    """The engine under test: float32 on the test device (attention backend: the device's default)."""
    return LLM(case["path"], device=device, dtype="float32", use_tqdm=False, **kw)


def _greedy(max_tokens=MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def _run(llm: LLM, prompts: list[list[int]], params=None):
    params = params or _greedy()
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _assert_same(outs, refs):
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.outputs[0].token_ids == r, f"prompt {i}: engine {o.outputs[0].token_ids} != HF {r}"


def test_greedy_matches_hf_and_prefix_hits_too(arch_case, test_device):
    llm = _llm(arch_case, test_device)
    free0 = llm.num_free_kv_blocks
    first = _run(llm, arch_case["prompts"])
    _assert_same(first, arch_case["refs"])
    second = _run(llm, arch_case["prompts"])  # every prompt's full blocks are cached now
    _assert_same(second, arch_case["refs"])
    assert all(o.num_cached_tokens > 0 for o in second if len(o.prompt_token_ids) > 16)
    assert sum(o.num_cached_tokens for o in second) > sum(o.num_cached_tokens for o in first)
    assert llm.num_free_kv_blocks == free0


@pytest.mark.parametrize(
    "engine_kw",
    [
        pytest.param({"max_num_batched_tokens": 32}, id="chunked-prefill"),
        pytest.param({"max_num_batched_tokens": 32, "enable_prefix_caching": False}, id="chunked-no-cache"),
        pytest.param({"num_kv_blocks": 24, "max_model_len": 256}, id="preemption"),
        pytest.param({"max_num_seqs": 3, "block_size": 8}, id="few-seqs-block8"),
    ],
)
def test_greedy_matches_hf_under_scheduling_pressure(arch_case, engine_kw, test_device):
    llm = _llm(arch_case, test_device, **engine_kw)
    free0 = llm.num_free_kv_blocks
    for _ in range(2):
        _assert_same(_run(llm, arch_case["prompts"]), arch_case["refs"])
    if "num_kv_blocks" in engine_kw:
        assert llm.engine.scheduler.num_preemptions > 0, "the preemption case did not preempt"
    assert llm.num_free_kv_blocks == free0


def test_the_other_attention_path_matches_hf_too(arch_case, test_device, on_cuda):
    """The path the default does not take: on the CPU the torch decode path instead of the C kernel;
    on CUDA the torch attention backend instead of Triton."""
    if on_cuda:
        llm = _llm(arch_case, test_device, attention_backend="torch")
        assert llm.config.attention_backend == "torch"
    else:
        llm = _llm(arch_case, test_device)
        llm.engine.executor.worker.runner.use_c_decode = False
    _assert_same(_run(llm, arch_case["prompts"]), arch_case["refs"])


def test_logprobs_match_hf_log_softmax(arch_case, test_device):
    llm = _llm(arch_case, test_device)
    atol = LOGPROB_ATOL[torch.device(test_device).type]
    outs = _run(llm, arch_case["prompts"][:5], _greedy(logprobs=5))
    for o, ref_logits in zip(outs, arch_case["logits"]):
        ref = torch.log_softmax(ref_logits, dim=-1)
        c = o.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) == MAX_NEW
        for step, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            assert entry[tok].logprob == pytest.approx(ref[step, tok].item(), abs=atol)
            assert entry[tok].rank == 1  # greedy picks the most likely token
            top = torch.topk(ref[step], 5)
            assert set(entry) == set(top.indices.tolist())
            for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
                assert entry[tid].logprob == pytest.approx(lp, abs=atol)
        assert c.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs))
        )
