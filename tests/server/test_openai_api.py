"""The engine server driven with the official openai SDK: outputs, streaming, n, logprobs, stop, usage.

Greedy outputs are compared with the offline ``LLM`` on the same model, so the server path (ZMQ,
core process, incremental detokenization, SSE) is checked for exactness, not just shape.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
from urllib.parse import urlsplit

import httpx
import pytest

from kvfleet_engine import LLM, SamplingParams

PROMPTS = ["The history of computing", "A recipe for bread starts with", "In the mountains, the weather"]


@pytest.fixture(scope="module")
def offline(demo_model):
    llm = LLM(demo_model("llama", "tiny"), max_model_len=512, use_tqdm=False)
    yield llm
    llm.shutdown()


def greedy(offline, prompt, max_tokens, **kw):
    [out] = offline.generate(
        prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **kw), use_tqdm=False
    )
    return out.outputs[0]


def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]


def test_completion_matches_offline_greedy(client, server, offline):
    for prompt in PROMPTS:
        resp = client.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0)
        expected = greedy(offline, prompt, 12)
        assert resp.choices[0].text == expected.text
        assert resp.choices[0].finish_reason == expected.finish_reason
        assert resp.usage.completion_tokens == len(expected.token_ids)
        assert resp.usage.prompt_tokens == len(offline.get_tokenizer().encode(prompt))
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completion_stream_equals_non_stream(client, server):
    kw = dict(model=server.model, prompt=PROMPTS[1], max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # without include_usage no chunk carries usage
    plain = list(client.completions.create(stream=True, **kw))
    assert all(getattr(c, "usage", None) is None for c in plain)


def test_prompt_list_token_ids_and_n(client, server, offline):
    tok = offline.get_tokenizer()
    ids = tok.encode(PROMPTS[2])
    resp = client.completions.create(
        model=server.model, prompt=[PROMPTS[0], PROMPTS[2]], max_tokens=6, n=2, temperature=0.9, seed=7
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    assert resp.usage.completion_tokens == 4 * 6
    # token-id prompts are the same request as the text they encode
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model=server.model, prompt=PROMPTS[2], max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    # seeded sampling is reproducible
    again = client.completions.create(
        model=server.model, prompt=[PROMPTS[0], PROMPTS[2]], max_tokens=6, n=2, temperature=0.9, seed=7
    )
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == [
        c.text for c in sorted(resp.choices, key=lambda c: c.index)
    ]


def test_completion_logprobs_and_echo(client, server):
    resp = client.completions.create(
        model=server.model, prompt=PROMPTS[0], max_tokens=5, logprobs=3, temperature=0
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == resp.choices[0].text
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert sampled <= 0 and len(top) >= 3
        assert math.isclose(max(top.values()), sampled, rel_tol=1e-5)  # greedy: the sampled one is the best
    echo = client.completions.create(
        model=server.model, prompt=PROMPTS[0], max_tokens=5, echo=True, temperature=0
    )
    assert echo.choices[0].text == PROMPTS[0] + resp.choices[0].text


def test_stop_string(client, server, offline):
    full = greedy(offline, PROMPTS[0], 20).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    resp = client.completions.create(
        model=server.model, prompt=PROMPTS[0], max_tokens=20, stop=[stop], temperature=0
    )
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].text == full[: full.index(stop)]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=server.model, prompt=PROMPTS[0], max_tokens=20, stop=[stop], temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == resp.choices[0].text


def test_chat(client, server, offline):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Tell me about bread."},
        {"role": "assistant", "content": "It is baked."},
        {"role": "user", "content": "More."},
    ]
    tok = offline.get_tokenizer()
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = greedy(offline, {"prompt_token_ids": tok.encode(prompt, add_special_tokens=False)}, 10)
    resp = client.chat.completions.create(
        model=server.model, messages=messages, max_completion_tokens=10, temperature=0
    )
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    assert resp.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))

    # max_tokens (the older name) works too; streaming gives the same text and the usage at the end
    chunks = list(
        client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def _http_chunks(url: str, path: str, body: dict) -> list[bytes]:
    """The chunked-encoding chunks of a response, as the server wrote them (one per part it sent)."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
        sock.sendall(
            b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (path.encode(), len(payload), payload)
        )
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    chunks = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return chunks
        chunks.append(rest[:size])
        rest = rest[size + 2 :]


def test_a_stream_sends_one_part_per_engine_step(server):
    """The role event goes out with the first token, and the last token with the usage and [DONE]: one
    write each (a proxy relays every part as a write of its own, and a client wakes once per part)."""
    body = {"model": server.model, "messages": [{"role": "user", "content": "Tell me about bread."}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = _http_chunks(server.url, "/v1/chat/completions", body)
    events = [[json.loads(e[len(b"data: ") :]) if e != b"data: [DONE]" else "[DONE]"
               for e in chunk.split(b"\n\n") if e] for chunk in chunks]  # fmt: skip
    assert events[0][0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[0][1]["choices"][0]["delta"]["content"]  # the first token, in the same part
    assert events[-1][-1] == "[DONE]" and events[-1][-2]["usage"]["completion_tokens"] == 6
    assert events[-1][-3]["choices"][0]["finish_reason"] == "length"  # the last token, in the same part
    assert len(chunks) <= 6  # a part per step at most (a step whose text is still incomplete sends none)


def test_chat_logprobs_n_and_stop(client, server):
    resp = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2, n=3,
    )  # fmt: skip
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    texts = {c.message.content for c in resp.choices}
    assert len(texts) == 1  # greedy: every sample is the same
    content = resp.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, rel_tol=1e-5)
    stop_text = resp.choices[0].message.content[1:3]
    if stop_text.strip():
        stopped = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0,
            stop=stop_text,
        )  # fmt: skip
        assert stopped.choices[0].finish_reason == "stop"
        assert stop_text not in stopped.choices[0].message.content


def test_cached_tokens_on_repeated_prefix(client, server):
    system = "You are a helpful assistant who knows about " + "bread, rivers and mountains. " * 12
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "first question"}]
    first = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=2, temperature=0)
    msgs[-1]["content"] = "second question"
    second = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 64
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 64 and cached % 16 == 0 and cached < second.usage.prompt_tokens
    assert server.metric("kvfleet_engine_prefix_cache_hits_tokens") >= cached


def test_requests_sharing_an_x_request_id_both_complete(server, offline):
    """Two live requests with the same X-Request-Id (two tenants behind a gateway, a client reusing ids):
    neither fails nor disturbs the other, and each answers under the id its client sent."""

    async def stream(http: httpx.AsyncClient, prompt: str) -> tuple[str, str, set[str]]:
        body = {"model": server.model, "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}
        async with http.stream(
            "POST", "/v1/completions", json=body, headers={"x-request-id": "shared-7"}
        ) as r:
            assert r.status_code == 200
            text, ids = [], set()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: ") :])
                    assert "error" not in chunk, chunk
                    ids.add(chunk["id"])
                    text += [c["text"] for c in chunk["choices"]]
            return r.headers["x-request-id"], "".join(text), ids

    async def both():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            return await asyncio.gather(stream(http, PROMPTS[0]), stream(http, PROMPTS[2]))

    for (header, text, ids), prompt in zip(asyncio.run(both()), (PROMPTS[0], PROMPTS[2])):
        assert header == "shared-7" and ids == {"shared-7"}
        assert text == greedy(offline, prompt, 24).text


def test_an_unusable_x_request_id_is_replaced_by_the_servers_own(server):
    body = {"model": server.model, "prompt": PROMPTS[0], "max_tokens": 1}
    for bad in ("x" * 201, "two words"):
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"x-request-id": bad})
        assert r.status_code == 200 and r.headers["x-request-id"].startswith("cmpl-")
        assert r.json()["id"] == r.headers["x-request-id"]
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"x-request-id": "x" * 200})
    assert r.status_code == 200 and r.headers["x-request-id"] == "x" * 200 == r.json()["id"]


def test_tokenize_detokenize_roundtrip(server, offline):
    r = httpx.post(f"{server.url}/tokenize", json={"model": server.model, "prompt": PROMPTS[0]}).json()
    assert r["tokens"] == offline.get_tokenizer().encode(PROMPTS[0])
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == PROMPTS[0]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"][0] == offline.get_tokenizer().convert_tokens_to_ids("<|im_start|>")


def test_health_version_metrics(server, client):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "state": "awake"}
    assert httpx.get(f"{server.url}/version").json()["version"]
    client.completions.create(model=server.model, prompt="hi", max_tokens=2)
    m = server.metrics()
    assert server.metric("kvfleet_engine_requests_total", endpoint="completions", status="200") >= 1
    assert server.metric("kvfleet_engine_time_to_first_token_seconds_count") >= 1
    assert server.metric("kvfleet_engine_generation_tokens_total") >= 2
    assert server.metric("kvfleet_engine_healthy") == 1
    assert server.metric("kvfleet_engine_sleep_level") == 0
    assert server.metric("kvfleet_engine_device_memory_bytes", kind="weights") > 0
    assert any(k.startswith("kvfleet_engine_kv_cache_usage_ratio") for k in m)
    assert m["process_resident_memory_bytes"] > 0
    assert any(k.startswith("python_gc_collections_total") for k in m)
    assert m["kvfleet_engine_event_loop_lag_seconds_count"] >= 1
    # the API server and the core process froze their start-up heaps (kvfleet_common.server_kit.gc_heap)
    log = server.log()
    assert "out of garbage collection (engine server started" in log and "(engine core ready" in log
