"""The gateway at its edge: what a hostile tenant sends gets OpenAI's 400 from the gateway itself, never a 500
(nor a retry on the next replica), and never holds the event loop the other tenants share."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from kvfleet_common.server_kit.request_limits import LARGE_TEXT_CHARS, TextBound, encode, encode_off_loop
from tests.gateway.gateway_harness import MODEL, run_gateway
from tests.server.test_server_edge_validation import (
    CASES,
    assert_openai_400,
)  # the engine server's cases, via the gateway

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def key(fleet):
    return fleet.gateway.create_tenant("hostile")


@pytest.fixture(scope="module")
def fastapi_gateway(fleet):
    """A second gateway that serves the proxied endpoints through FastAPI (``--no-fast-path``)."""
    with run_gateway(fleet.redis.url, fleet.log_dir, "--no-fast-path") as g:
        yield g


def _post(url: str, path: str, content: bytes, key: str, **headers: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json", **headers}
    return httpx.post(f"{url}{path}", content=content, timeout=60, headers=headers)


V1_CASES = [c for c in CASES if c[1].startswith("/v1/")]


@pytest.mark.parametrize("path_kind", ["fast path", "FastAPI"])
def test_hostile_input_is_an_openai_400_on_both_paths(fleet, key, fastapi_gateway, path_kind):
    g = fleet.gateway if path_kind == "fast path" else fastapi_gateway
    errors_before = g.metric("kvfleet_gateway_upstream_errors_total")
    for name, path, body, fragment, param in V1_CASES:
        r = _post(g.url, path, body.replace('"tiny"', json.dumps(MODEL)).encode(), key)
        try:
            assert_openai_400(r, fragment, param)
        except AssertionError as e:
            raise AssertionError(f"{path_kind}: {name}: {e}") from None
    assert (
        g.metric("kvfleet_gateway_upstream_errors_total") == errors_before
    )  # nothing failed, nothing retried
    assert "Traceback" not in g.log()


def test_the_gateway_answers_before_the_replica(fleet, key):
    """Context and size errors are the gateway's own (no replica chosen): the same message as the engine's."""
    for body in [
        {**CHAT, "max_tokens": 600},
        {**CHAT, "messages": [{"role": "user", "content": "x" * (1 << 20)}]},
    ]:
        r = _post(fleet.gateway.url, "/v1/chat/completions", json.dumps(body).encode(), key)
        err = assert_openai_400(r, "maximum context length", None)
        assert err["code"] == "context_length_exceeded" and "x-kvfleet-replica" not in r.headers, err


def test_a_10mb_prompt_gets_a_fast_400_while_another_tenant_keeps_a_p99_under_a_second(fleet, key):
    """Two tenants share the gateway: one sends 10 MB prompts (a completion, a chat, chat content parts) and a
    prompt of 128k token ids, the other small completions, model lists and health checks meanwhile. The
    prompts are refused on their size before they are tokenized (the token ids before they are hashed)."""
    other = fleet.gateway.create_tenant("bystander")
    g = fleet.gateway
    auth = {"Authorization": f"Bearer {other}"}
    small = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    for k in (key, other):  # warm: the gateway's tokenizer is loaded by the first request
        assert _post(g.url, "/v1/completions", json.dumps(small).encode(), k).status_code == 200
    huge = "word " * (2 << 20)  # 10 MiB
    parts = [{"type": "text", "text": huge}]
    bodies = [
        ("/v1/completions", {"model": MODEL, "prompt": huge}),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": huge}]}),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": parts}]}),
        ("/v1/completions", {"model": MODEL, "prompt": [7] * (1 << 17)}),
    ]  # fmt: skip
    raw_bodies = [(path, json.dumps(body).encode()) for path, body in bodies]  # not on the bystander's clock
    latencies: list[float] = []
    stop = threading.Event()

    def bystander() -> None:
        with httpx.Client(timeout=60, headers=auth) as c:
            while not stop.is_set():
                calls = (lambda: c.post(f"{g.url}/v1/completions", json=small),
                         lambda: c.get(f"{g.url}/v1/models"), lambda: c.get(f"{g.url}/health"))  # fmt: skip
                for call in calls:
                    t0 = time.perf_counter()
                    assert call().status_code == 200
                    latencies.append(time.perf_counter() - t0)

    thread = threading.Thread(target=bystander)
    thread.start()
    try:
        time.sleep(0.5)
        for path, raw in raw_bodies * 2:
            t0 = time.perf_counter()
            r = _post(g.url, path, raw, key)
            took = time.perf_counter() - t0
            err = assert_openai_400(r, "maximum context length", None)
            assert took < 10, (path, took, err)
        time.sleep(0.5)
    finally:
        stop.set()
        thread.join()
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99)]
    assert len(latencies) >= 30 and p99 < 1.0, (p99, len(latencies), latencies[-5:])


def test_long_texts_are_tokenized_off_the_event_loop(demo_model):
    """What fits is tokenized anyway; when long, in a thread that releases the GIL: the event loop keeps
    running meanwhile (tokenized on the loop, it would not tick once until the end). And ``TextBound`` is
    an upper bound: no token of the demo vocabulary decodes to more text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model("llama", "tiny")), local_files_only=True)
    text = "The history of computing, from the abacus to the present day. " * 40_000  # 2.5 MB
    assert len(text) > LARGE_TEXT_CHARS

    async def measure() -> tuple[list[int], int, float, float]:
        ticks, worst, done = 0, 0.0, False

        async def tick() -> None:
            nonlocal ticks, worst
            last = time.perf_counter()
            while not done:
                await asyncio.sleep(0.002)
                now = time.perf_counter()
                ticks, worst, last = ticks + 1, max(worst, now - last), now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.02)
        ticks, worst = 0, 0.0
        t0 = time.perf_counter()
        ids = await encode_off_loop(tok, text, True)
        took = time.perf_counter() - t0
        done = True
        await ticker
        return ids, ticks, worst, took

    ids, ticks, worst, took = asyncio.run(measure())
    assert ids == tok.encode(text, add_special_tokens=True) == encode(tok, text, True)
    # a functional bound, not a benchmark (the machine may be busy): the loop ran all along
    assert ticks >= 10 and worst < took / 2, f"{ticks} ticks, stalled {worst:.3f}s of {took:.3f}s"
    bound = TextBound.of(tok)
    assert len(text) <= len(ids) * bound.chars_per_token
    assert all(len(tok.decode([i])) <= bound.chars_per_token for i in range(len(tok)))


def test_two_authorization_headers_are_refused(fleet, key):
    headers = [("authorization", f"Bearer {key}"), ("authorization", "Bearer kvf-someone-else")]
    for method, path in [("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/admin/tenants")]:
        r = httpx.request(method, f"{fleet.gateway.url}{path}", headers=headers, json=CHAT, timeout=30)
        assert_openai_400(r, "more than one Authorization", None)


def test_percent_encoded_paths_cannot_reach_another_route(fleet, key):
    g = fleet.gateway
    for path in [
        "/%61dmin/tenants",
        "/admin%2Ftenants",
        "/v1/%63hat/completions",
        "/v1/models%2F",
        "/%2561dmin",
    ]:
        for headers in ({"Authorization": f"Bearer {g.admin_token}"}, {"Authorization": f"Bearer {key}"}):
            r = httpx.request(
                "POST" if "chat" in path else "GET", f"{g.url}{path}", headers=headers, json=CHAT
            )
            assert_openai_400(r, "percent-encodes", None)
    # escapes of characters that need one are routed as before (here: to no route at all)
    r = httpx.get(f"{g.url}/v1/models%20x", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 404
    assert (
        httpx.get(f"{g.url}/admin/tenants", headers={"Authorization": f"Bearer {g.admin_token}"}).status_code
        == 200
    )


def test_the_routing_debug_header_is_for_the_admin_token_only(fleet, key):
    g = fleet.gateway
    for value in ["1", "true", key, g.admin_token + "x"]:
        r = _post(g.url, "/v1/chat/completions", json.dumps(CHAT).encode(), key, **{"x-kvfleet-debug": value})
        assert r.status_code == 200 and "x-kvfleet-route" not in r.headers, value
    r = _post(
        g.url, "/v1/chat/completions", json.dumps(CHAT).encode(), key, **{"x-kvfleet-debug": g.admin_token}
    )
    assert r.status_code == 200 and json.loads(r.headers["x-kvfleet-route"])["candidates"]
