"""Prompt logprobs equal HF transformers' ``log_softmax`` over the prompt, on the same weights (float32).

However the engine computes the prompt (whole, in chunks, after a preemption, or with the prompt already
in the prefix cache, which such a request must not read), each prompt token's logprob, rank and the
top-k are the reference's; through HTTP, ``echo`` + ``logprobs`` and vLLM's ``prompt_logprobs`` too.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvfleet_engine import LLM, SamplingParams
from tests.server.server_harness import openai_client, run_server

ATOL = {"cpu": 1e-4, "cuda": 1e-3}
TOP = 3
TEXT = "The old lighthouse keeper climbed the stairs every night to light the lamp"


@pytest.fixture(scope="module")
def case(demo_model, hf_float32, test_device):
    from transformers import AutoTokenizer

    path = demo_model("llama", "tiny")
    tok = AutoTokenizer.from_pretrained(path)
    hf = hf_float32(path)
    rng = random.Random(7)
    vocab = hf.config.vocab_size
    prompts = [tok.encode(TEXT)] + [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 2, 37, 70, 90)]
    refs = []
    with torch.inference_mode():
        for p in prompts:
            logits = hf(torch.tensor([p], device=test_device)).logits[0].float()
            refs.append(torch.log_softmax(logits, dim=-1).cpu())
    return {"path": path, "prompts": prompts, "refs": refs, "tok": tok}


def check_position(entry: dict, token: int, ref: torch.Tensor, atol: float, k: int = TOP) -> None:
    """One prompt position: the token's logprob and rank, and the top-k, as the reference has them."""
    lp = entry[token]
    assert abs(lp.logprob - ref[token].item()) <= atol
    assert (
        lp.rank == int((ref > ref[token]).sum()) + 1
        or abs(ref.sort(descending=True).values[lp.rank - 1] - ref[token]) < atol
    )
    top_vals, _ = ref.topk(k)
    others = sorted((v for v in entry.values() if v.rank is not None and v.rank <= k), key=lambda v: v.rank)
    assert len(others) == k
    for got, want in zip(others, top_vals.tolist()):
        assert abs(got.logprob - want) <= atol


def check_output(out, prompt: list[int], ref: torch.Tensor, atol: float) -> None:
    pl = out.prompt_logprobs
    assert pl is not None and len(pl) == len(prompt) and pl[0] is None
    for t in range(1, len(prompt)):
        check_position(pl[t], prompt[t], ref[t - 1], atol)


@pytest.mark.parametrize(
    "engine_kw",
    [
        pytest.param({}, id="plain"),
        pytest.param({"max_num_batched_tokens": 16}, id="chunked-prefill"),
        pytest.param({"num_kv_blocks": 20, "max_model_len": 256}, id="preemption"),
    ],
)
def test_prompt_logprobs_match_hf(case, engine_kw, test_device):
    llm = LLM(case["path"], device=test_device, dtype="float32", use_tqdm=False, **engine_kw)
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
        prompts = [{"prompt_token_ids": p} for p in case["prompts"]]
        for _ in range(2):  # the second round finds every prompt's full blocks in the prefix cache
            outs = llm.generate(prompts, params, use_tqdm=False)
            for out, p, ref in zip(outs, case["prompts"], case["refs"]):
                check_output(out, p, ref, ATOL[test_device.split(":")[0]])
        if "num_kv_blocks" in engine_kw:
            assert llm.engine.scheduler.num_preemptions > 0, "the preemption case did not preempt"
        # a request that does not ask still reads the cache the others filled
        [plain] = llm.generate(prompts[-1], SamplingParams(max_tokens=1), use_tqdm=False)
        assert plain.prompt_logprobs is None
        if "num_kv_blocks" not in engine_kw:
            assert plain.num_cached_tokens > 0
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def server(case, tmp_path_factory, test_device):
    # float32 on the test device, as the reference (on a GPU the server's own default is bfloat16)
    flags = ("--max-model-len", "512", "--device", test_device, "--dtype", "float32")
    with run_server(case["path"], tmp_path_factory.mktemp("logs"), *flags) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_echo_with_logprobs_over_http(case, client, server, test_device):
    prompt, ref, tok = case["prompts"][0], case["refs"][0], case["tok"]
    atol = ATOL[test_device.split(":")[0]]
    resp = client.completions.create(
        model=server.model, prompt=TEXT, max_tokens=4, temperature=0, echo=True, logprobs=2
    )
    choice = resp.choices[0]
    lp = choice.logprobs
    n = len(prompt)
    assert choice.text.startswith(TEXT)
    assert len(lp.tokens) == n + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for t in range(1, n):
        assert abs(lp.token_logprobs[t] - ref[t - 1, prompt[t]].item()) <= atol
        assert len(lp.top_logprobs[t]) >= 2
    assert lp.tokens[:n] == [tok.decode([t]) for t in prompt]
    for token, offset in zip(lp.tokens, lp.text_offset):  # ASCII text: offsets point at each token
        assert choice.text[offset : offset + len(token)] == token
    assert "".join(lp.tokens) == choice.text

    # streamed: the prompt's part comes with the first chunk, the whole equals the non-streamed answer
    chunks = [c for c in client.completions.create(
        model=server.model, prompt=TEXT, max_tokens=4, temperature=0, echo=True, logprobs=2, stream=True
    ) if c.choices]  # fmt: skip
    assert len(chunks[0].choices[0].logprobs.tokens) >= n
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset
    streamed = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)


def test_vllm_prompt_logprobs_field_over_http(case, client, server, test_device):
    prompt, ref = case["prompts"][3], case["refs"][3]
    atol = ATOL[test_device.split(":")[0]]
    resp = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    pl = resp.choices[0].model_extra["prompt_logprobs"]
    assert len(pl) == len(prompt) and pl[0] is None
    for t in range(1, len(prompt)):
        entry = pl[t][str(prompt[t])]
        assert abs(entry["logprob"] - ref[t - 1, prompt[t]].item()) <= atol
        assert entry["rank"] >= 1 and isinstance(entry["decoded_token"], str)
        assert len(pl[t]) in (2, 3)  # the prompt token and the top 2 (it may be one of them)

    chat = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    cpl = chat.model_extra["prompt_logprobs"]
    assert cpl[0] is None and all(len(p) == 1 for p in cpl[1:])
    assert len(cpl) == chat.usage.prompt_tokens

    import httpx

    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": server.model, "prompt": "hi", "prompt_logprobs": 2, "stream": True}, timeout=30,
    )  # fmt: skip
    assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"]
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": server.model, "prompt": "hi", "prompt_logprobs": 21},
        timeout=30,
    )
    assert r.status_code == 400
