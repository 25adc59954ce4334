"""logit_bias: added to a row's logits before anything else (greedy rows included), offline and over HTTP."""

from __future__ import annotations

import httpx
import pytest

from kvfleet_engine import LLM, SamplingParams

PROMPT = "The old lighthouse keeper"


@pytest.fixture(scope="module")
def llm(demo_model, test_device):
    engine = LLM(demo_model("llama", "tiny"), device=test_device, dtype="float32", use_tqdm=False)
    yield engine
    engine.shutdown()


def greedy(llm, **kw) -> list[int]:
    [out] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, **kw), use_tqdm=False)
    return out.outputs[0].token_ids


def test_bias_moves_greedy_choice_in_a_mixed_batch(llm):
    plain = greedy(llm)
    forced = greedy(llm, logit_bias={42: 100.0})
    assert forced == [42] * 4
    banned = greedy(llm, logit_bias={plain[0]: -100.0})
    assert banned[0] != plain[0]
    # one batch: a biased row, an unbiased greedy row and a sampled row; the bias stays on its row
    outs = llm.generate(
        [PROMPT] * 3,
        [
            SamplingParams(temperature=0, max_tokens=4, logit_bias={42: 100.0}),
            SamplingParams(temperature=0, max_tokens=4),
            SamplingParams(temperature=1.0, seed=3, max_tokens=4, logit_bias={7: 100.0}),
        ],
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == [[42] * 4, plain, [7] * 4]


def test_bias_outside_the_vocabulary_is_refused(llm):
    vocab = llm.config.model.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        greedy(llm, logit_bias={vocab: 1.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"model": server.model, **body}, timeout=60)


def test_logit_bias_over_http(server, llm):
    r = post(server, {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logit_bias": {"42": 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == llm.get_tokenizer().decode([42] * 3)
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
              "temperature": 0, "logit_bias": {"42": 100}},
        timeout=60,
    )  # fmt: skip
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("bias", "fragment"),
    [
        ({"x": 1}, "logit_bias"),
        ({"-1": 1}, "logit_bias"),
        ({"1.5": 1}, "logit_bias"),
        ({"99999999999999": 1}, "logit_bias"),
        ({"1": 100.5}, "logit_bias"),
        ({"1": -101}, "logit_bias"),
        ({"1": "high"}, "logit_bias"),
        ({"1000000": 1}, "vocabulary"),
    ],
)
def test_bad_logit_bias_is_a_400(server, bias, fragment):
    r = post(server, {"prompt": PROMPT, "max_tokens": 2, "logit_bias": bias})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and fragment in err["message"] + str(err["param"])
