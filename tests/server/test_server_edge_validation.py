"""The engine server at its edge: hostile input gets OpenAI's 400, never a 500, and never holds the loop.

The cases a hostile tenant found (integers past int32 / int64, lone surrogates, 100,000 nested ``[``, lax
coercions, max_tokens past the context, a 10 MB prompt), sent to ``kvfleet engine serve`` directly.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from kvfleet_common.server_kit.request_limits import MAX_JSON_DEPTH

CTX = 512  # the module's server runs --max-model-len 512 (tests/server/conftest.py)
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
DONE = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def _raw(text: str) -> bytes:
    return text.encode()


# (name, path, raw JSON body, fragment of the message, param)
CASES = [
    ("token id past int32", "/v1/completions", json.dumps({**DONE, "prompt": [2147483648]}), "outside", "prompt"),
    ("negative token id past int32", "/v1/completions", json.dumps({**DONE, "prompt": [-8466490113]}), "outside",
     "prompt"),
    ("token id past the vocabulary", "/v1/completions", json.dumps({**DONE, "prompt": [70000]}), "vocabulary",
     "prompt"),
    ("a prompt of booleans", "/v1/completions", json.dumps({**DONE, "prompt": [True, False]}), "booleans", "prompt"),
    ("max_tokens 2**64", "/v1/completions", json.dumps({**DONE, "max_tokens": 2**64}), "less than", "max_tokens"),
    ("priority 2**70", "/v1/completions", json.dumps({**DONE, "priority": 2**70}), "less than", "priority"),
    ("seed 2**64", "/v1/completions", json.dumps({**DONE, "seed": 2**64}), "less than", "seed"),
    ("min_tokens 2**64", "/v1/completions", json.dumps({**DONE, "min_tokens": 2**64}), "less than", "min_tokens"),
    ("stop token id 2**40", "/v1/completions", json.dumps({**DONE, "stop_token_ids": [2**40]}), "less than",
     "stop_token_ids.0"),
    ("stream 'yes'", "/v1/completions", json.dumps({**DONE, "stream": "yes"}), "boolean", "stream"),
    ("stream 1", "/v1/chat/completions", json.dumps({**CHAT, "stream": 1}), "boolean", "stream"),
    ("max_tokens a string", "/v1/completions", json.dumps({**DONE, "max_tokens": "16"}), "integer", "max_tokens"),
    ("temperature NaN", "/v1/completions", json.dumps({**DONE, "temperature": float("nan")}), "finite",
     "temperature"),
    ("max_tokens above the context", "/v1/completions", json.dumps({**DONE, "max_tokens": CTX + 1}),
     "maximum context length", "max_tokens"),
    ("prompt + max_tokens above the context", "/v1/completions",
     json.dumps({**DONE, "prompt": [5] * (CTX - 8), "max_tokens": 16}), "maximum context length", "max_tokens"),
    ("chat max_completion_tokens above the context", "/v1/chat/completions",
     json.dumps({**CHAT, "max_completion_tokens": 10**6}), "maximum context length", "max_tokens"),
    ("min_tokens above the context", "/v1/chat/completions",
     json.dumps({**CHAT, "max_tokens": None, "min_tokens": CTX}), "min_tokens", "min_tokens"),
    ("a lone surrogate in a prompt", "/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b"}', "UTF-8",
     "prompt"),
    ("a lone surrogate in a message", "/v1/chat/completions",
     '{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', "UTF-8", "messages.0.content"),
    ("a lone surrogate in a content part", "/v1/chat/completions",
     '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "UTF-8", "messages.0.content"),
    ("a lone surrogate in a stop string", "/v1/completions", '{"model": "tiny", "prompt": "x", "stop": ["\\ud800"]}',
     "UTF-8", "stop"),
    ("100,000 nested [", "/v1/completions", "[" * 100_000, "deeper", None),
    ("100,000 nested [ in a field", "/v1/chat/completions",
     json.dumps(CHAT)[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "deeper", None),
    (f"{MAX_JSON_DEPTH + 1} levels in an ignored field", "/v1/completions",
     json.dumps({**DONE, "x": json.loads("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))}), "deeper", None),
    ("tokenize: a lone surrogate", "/tokenize", '{"prompt": "\\ud800"}', "UTF-8", None),
    ("detokenize: a token id past int32", "/detokenize", json.dumps({"tokens": [2**40]}), "less than", "tokens.0"),
    ("detokenize: nested too deep", "/detokenize", '{"tokens": ' + "[" * 1000 + "]" * 1000 + "}", "deeper", None),
]  # fmt: skip


def assert_openai_400(r: httpx.Response, fragment: str, param: str | None) -> dict:
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
    assert fragment in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(("name", "path", "body", "fragment", "param"), CASES, ids=[c[0] for c in CASES])
def test_hostile_input_is_an_openai_400(server, name, path, body, fragment, param):
    r = httpx.post(f"{server.url}{path}", content=_raw(body), headers={"content-type": "application/json"},
                   timeout=60)  # fmt: skip
    assert_openai_400(r, fragment, param)


def test_what_fits_still_passes(server):
    """The bounds refuse nothing that fits: the last token of the context, a surrogate pair (an emoji),
    the largest token id of the vocabulary, int64's edges, a 20-level nesting in an ignored field."""
    ok = [
        {**DONE, "prompt": [5] * (CTX - 2), "max_tokens": 2},
        {**DONE, "prompt": json.loads('"smile \\ud83d\\ude00"')},
        {**DONE, "prompt": [4095, 1]},
        {**DONE, "seed": 2**63 - 1, "temperature": 0.5},
        {**DONE, "top_k": 2**63 - 1, "temperature": 0.5},
        {**DONE, "x": json.loads("[" * 20 + "]" * 20)},
        {**CHAT, "max_tokens": None, "min_tokens": 2, "ignore_eos": False, "max_completion_tokens": 3},
    ]
    for body in ok:
        r = httpx.post(
            f"{server.url}/v1/{'chat/' if 'messages' in body else ''}completions", json=body, timeout=60
        )
        assert r.status_code == 200, (body, r.text[:300])


def test_an_unknown_model_is_echoed_clipped(server):
    name = "m" * (1 << 20)
    r = httpx.post(f"{server.url}/v1/completions", json={**DONE, "model": name}, timeout=60)
    assert r.status_code == 404 and len(r.content) < 1024, r.content[:300]
    assert "(1048576 characters)" in r.json()["error"]["message"]
    assert "m" * 1000 not in server.log()


def test_two_authorization_headers_on_the_admin_endpoints(server):
    headers = [("authorization", f"Bearer {server.admin_token}"), ("authorization", "Bearer other")]
    r = httpx.get(f"{server.url}/is_sleeping", headers=headers, timeout=10)
    assert_openai_400(r, "more than one Authorization", None)


def test_a_10mb_prompt_is_refused_at_once_while_health_stays_fast(server):
    """Refused on its size, before tokenizing: a fast 400, and the loop keeps answering others."""
    latencies: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                assert c.get(f"{server.url}/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        huge = "word " * (2 << 20)  # 10 MiB
        for path, body in [
            ("/v1/completions", {**DONE, "prompt": huge}),
            ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": huge}]}),
            ("/v1/completions", {**DONE, "prompt": ["hi", huge]}),  # refused before "hi" is tokenized
            ("/tokenize", {"prompt": huge}),
        ]:
            t0 = time.perf_counter()
            r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
            took = time.perf_counter() - t0
            err = assert_openai_400(r, "maximum context length", None)
            assert err["code"] == "context_length_exceeded" and took < 10, (path, took, err)
    finally:
        stop.set()
        poller.join()
    latencies.sort()
    assert len(latencies) >= 10 and latencies[int(len(latencies) * 0.99)] < 1.0, latencies[-5:]


def test_nothing_is_left_behind(server):
    stats = server.metrics()
    assert stats['kvfleet_engine_num_requests_running{model_name="tiny"}'] == 0
    assert stats['kvfleet_engine_num_requests_waiting{model_name="tiny"}'] == 0
    assert "Traceback" not in server.log()
    assert httpx.get(f"{server.url}/health").status_code == 200
