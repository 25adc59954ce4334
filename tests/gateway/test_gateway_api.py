"""The gateway with real Redis, two real tiny engine replicas and the official openai SDK."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest

from kvfleet_common.hashing import hash_blocks
from kvfleet_common.openai_protocol import ChatCompletionRequest, CompletionRequest
from kvfleet_gateway.tokenization import load_tokenizer_files, prompt_token_ids
from tests.gateway.gateway_harness import MODEL, run_gateway, wait_until

SYSTEM = ("You are kvfleet's test assistant. Answer briefly, precisely and politely; never invent facts; "
          "prefer short sentences; cite nothing. ") * 3  # fmt: skip


def sdk(fleet, key: str, gateway=None) -> openai.OpenAI:
    g = gateway or fleet.gateway
    return openai.OpenAI(base_url=f"{g.url}/v1", api_key=key, max_retries=0, timeout=60)


def chat_raw(fleet, key: str, messages, gateway=None, **kw) -> httpx.Response:
    g = gateway or fleet.gateway
    return httpx.post(f"{g.url}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key}", "x-kvfleet-debug": g.admin_token},
                      json={"model": MODEL, "messages": messages, "max_tokens": 4, **kw})  # fmt: skip


@pytest.fixture(scope="module")
def key(fleet):
    return fleet.gateway.create_tenant("acme")


# ---- auth, models, errors --------------------------------------------------------------------------


def test_auth_errors_are_openai_shaped(fleet, key):
    with pytest.raises(openai.AuthenticationError) as e:
        sdk(fleet, "kvf-not-a-key").models.list()
    assert e.value.body["code"] == "invalid_api_key"
    r = httpx.post(f"{fleet.gateway.url}/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{fleet.gateway.url}/admin/tenants").status_code == 401
    r = httpx.get(f"{fleet.gateway.url}/admin/tenants", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 401  # a tenant key is not an admin token


def test_models_are_filtered_by_the_tenants_globs(fleet, key):
    assert [m.id for m in sdk(fleet, key).models.list().data] == [MODEL]
    other = fleet.gateway.create_tenant("only-llama", models=["llama-*"])
    assert sdk(fleet, other).models.list().data == []
    with pytest.raises(openai.PermissionDeniedError) as e:
        sdk(fleet, other).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_allowed"
    with pytest.raises(openai.NotFoundError) as e:
        sdk(fleet, key).chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    assert e.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        (b"{not json", 400, "not valid JSON"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": -1}).encode(),
         400, "temperature"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 0}).encode(), 400, "n"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * 2000}]}).encode(), 400,
         "maximum context length"),  # the engine's own 400 passes through
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (33 << 20)}]}).encode(), 413,
         "exceeds"),
    ],
)  # fmt: skip
def test_bad_requests_get_clear_errors(fleet, key, body, status, fragment):
    r = httpx.post(f"{fleet.gateway.url}/v1/chat/completions", content=body, timeout=60,
                   headers={"Authorization": f"Bearer {key}", "content-type": "application/json"})  # fmt: skip
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]["message"]


# ---- generation through the gateway ----------------------------------------------------------------


def test_chat_and_completions_through_the_sdk(fleet, key):
    c = sdk(fleet, key)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5)
    assert r.usage.completion_tokens == 5 and r.choices[0].message.content
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, n=2, seed=7)
    assert len(r.choices) == 2 and r.usage.completion_tokens == 6


def test_streaming_passes_through_and_usage_is_only_there_when_asked(fleet, key):
    c = sdk(fleet, key)
    msgs = [{"role": "user", "content": "stream please"}]
    plain = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, stream=True, seed=1))
    assert all(ch.usage is None for ch in plain)
    assert sum(1 for ch in plain if ch.choices and ch.choices[0].delta.content) >= 1
    with_usage = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, stream=True, seed=1,
                                                stream_options={"include_usage": True}))  # fmt: skip
    assert with_usage[-1].usage.completion_tokens == 6 and with_usage[-1].choices == []
    text = lambda chunks: "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)  # noqa: E731
    assert text(plain) == text(with_usage)

    # usage was metered either way (reported to Redis in the background, within ~50 ms of the stream's end)
    def metered() -> int | None:
        usage = fleet.gateway.admin("GET", "/admin/usage", params={"tenant": "acme"}).json()["data"]["acme"]
        return usage["total"]["completion_tokens"] if usage["total"]["completion_tokens"] >= 12 else None

    wait_until(metered, 10, 0.05, "both streams' completion tokens to be metered")


def test_shared_prefix_sticks_to_one_replica_and_the_prediction_is_exact(fleet, key):
    """Same system prompt -> same replica, and the gateway's predicted cached tokens equal the engine's."""
    replicas, predictions = set(), []
    for i in range(4):
        r = chat_raw(
            fleet, key, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"q{i}"}]
        )
        assert r.status_code == 200, r.text
        route = json.loads(r.headers["x-kvfleet-route"])
        assert route["policy"] == "prefix-aware" and len(route["candidates"]) == 2
        replicas.add(r.headers["x-kvfleet-replica"])
        predicted = route["candidates"][0]["matched_tokens"]
        predictions.append((predicted, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]))
        time.sleep(0.3)  # let the replica's KV events reach Redis
    assert len(replicas) == 1
    assert predictions[0] == (0, 0)
    assert all(p == actual and p > 0 for p, actual in predictions[1:]), predictions
    # prompts with nothing in common (not even a chat template's first block) spread over both replicas
    spread, routes = set(), []
    for word in ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"]:
        r = httpx.post(f"{fleet.gateway.url}/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {key}", "x-kvfleet-debug": fleet.gateway.admin_token},
                       json={"model": MODEL, "prompt": f"{word} " * 12, "max_tokens": 1})  # fmt: skip
        spread.add(r.headers["x-kvfleet-replica"])
        routes.append(r.headers["x-kvfleet-route"])
    assert len(spread) == 2, routes
    m = fleet.gateway.metrics()
    assert any(
        k.startswith("kvfleet_gateway_routing_decisions_total") and 'prefix_hit="true"' in k for k in m
    )


def test_gateway_token_ids_and_block_hashes_equal_the_engines(fleet, key):
    store = fleet.store()
    [hb, *_] = store.live_replicas(MODEL)
    tok = load_tokenizer_files(store.fetch_tokenizer(MODEL, hb.tokenizer_revision))
    engine = fleet.engines[0]
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Ünïcode, emoji 🚀 and\ttabs"},
    ]
    chat = ChatCompletionRequest(model=MODEL, messages=messages)
    engine_ids = httpx.post(f"{engine.url}/tokenize", json={"messages": messages}).json()["tokens"]
    assert prompt_token_ids(tok, chat) == engine_ids
    text = "The quick brown fox — jumps over the lazy dog. " * 4
    completion = CompletionRequest(model=MODEL, prompt=text)
    assert (
        prompt_token_ids(tok, completion)
        == httpx.post(f"{engine.url}/tokenize", json={"prompt": text}).json()["tokens"]
    )
    # the hashes the gateway computes (with the tenant's salt) are exactly the blocks the engine stored
    salt = store.tenant_for_key_hash(__import__("hashlib").sha256(key.encode()).hexdigest()).cache_salt
    assert salt  # tenants get their own cache by default
    r = chat_raw(fleet, key, messages, max_tokens=1)
    replica = r.headers["x-kvfleet-replica"]
    hashes = hash_blocks(engine_ids, hb.block_size, salt)
    assert len(hashes) >= 4
    wait_until(lambda: store.prefix_match(MODEL, hashes, [replica])[replica] == len(hashes), 10, 0.1,
               "the replica's KV events")  # fmt: skip
    unsalted = hash_blocks(engine_ids, hb.block_size, "")
    assert store.prefix_match(MODEL, unsalted, [replica])[replica] == 0  # another tenant could not match it


# ---- quotas ----------------------------------------------------------------------------------------


def test_requests_per_minute_limit(fleet):
    k = fleet.gateway.create_tenant("rpm2", requests_per_minute=2)
    c = sdk(fleet, k)
    for _ in range(2):
        c.completions.create(model=MODEL, prompt="a", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model=MODEL, prompt="a", max_tokens=1)
    assert e.value.body["code"] == "rate_limit_exceeded"
    assert 1 <= int(e.value.response.headers["retry-after"]) <= 120  # a sliding minute: up to two


def test_tokens_per_minute_are_charged_from_real_usage(fleet):
    k = fleet.gateway.create_tenant("tpm", tokens_per_minute=20)
    c = sdk(fleet, k)
    c.completions.create(
        model=MODEL, prompt="one two three four five", max_tokens=16, extra_body={"ignore_eos": True}
    )

    def refused():
        try:
            c.completions.create(model=MODEL, prompt="a", max_tokens=1)
        except openai.RateLimitError as e:
            return e
        return None

    err = wait_until(refused, 10, 0.2, "the token limit to apply")  # usage is reported within ~50 ms
    assert "tokens per minute" in err.body["message"]


def test_max_concurrent_requests(fleet):
    k = fleet.gateway.create_tenant("one-at-a-time", max_concurrent=1)
    c = sdk(fleet, k)
    stream = c.completions.create(model=MODEL, prompt="long", max_tokens=400, stream=True,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    chunks = iter(stream)  # keep the iterator: a collected one closes the response
    next(chunks)  # in flight now
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model=MODEL, prompt="b", max_tokens=1)
    assert "concurrent" in e.value.body["message"]
    assert fleet.gateway.metric("kvfleet_gateway_inflight_requests", model=MODEL) == 1
    stream.close()
    wait_until(lambda: fleet.gateway.metric("kvfleet_gateway_inflight_requests", model=MODEL) == 0, 10, 0.1,
               "the gauge to drop")  # fmt: skip
    wait_until(lambda: _ok(lambda: c.completions.create(model=MODEL, prompt="b", max_tokens=1)), 10, 0.1,
               "the slot to free")  # fmt: skip


def _ok(fn) -> bool:
    try:
        fn()
        return True
    except openai.RateLimitError:
        return False


# ---- disconnects -----------------------------------------------------------------------------------


def test_client_disconnect_aborts_the_engine_request(fleet, key):
    with httpx.stream("POST", f"{fleet.gateway.url}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": MODEL, "prompt": "go", "max_tokens": 480, "stream": True, "ignore_eos": True}) as r:  # fmt: skip
        replica = r.headers["x-kvfleet-replica"]
        next(r.iter_bytes())
    engine = fleet.engine_for(replica)
    wait_until(lambda: engine.metric("kvfleet_engine_num_requests_running") == 0, 20, 0.1, "the abort")
    blocks = engine.metric("kvfleet_engine_kv_cache_blocks")
    wait_until(
        lambda: engine.metric("kvfleet_engine_kv_cache_free_blocks") == blocks - 1,
        20,
        0.1,  # - the null block
        "blocks freed",
    )
    finished = fleet.gateway.metric("kvfleet_gateway_requests_total", status="499")
    assert finished >= 1


def test_process_metrics_loop_lag_and_a_frozen_start_up_heap(fleet, key):
    hello = [{"role": "user", "content": "hi"}]
    sdk(fleet, key).chat.completions.create(model=MODEL, messages=hello, max_tokens=2)
    g = fleet.gateway
    assert g.metric("process_cpu_seconds_total") > 0 and g.metric("process_resident_memory_bytes") > 0
    assert any(k.startswith("python_gc_collections_total") for k in g.metrics())
    lag_samples = lambda: g.metric("kvfleet_gateway_event_loop_lag_seconds_count")  # noqa: E731
    wait_until(lambda: lag_samples() >= 2, 10, 0.1, "loop-lag samples")
    log = g.log()
    # frozen after start-up and again after the first request loaded the tokenizer (transformers, torch)
    assert "out of garbage collection (gateway started" in log
    assert "out of garbage collection (tokenizer of" in log
    assert "ended span" not in log  # a stream's route span used to be written to after it had ended


# ---- admin -----------------------------------------------------------------------------------------


def test_tenant_admin_lifecycle(fleet):
    g = fleet.gateway
    k1 = g.create_tenant("lifecycle", models=["tiny"], priority=3)
    assert g.admin("POST", "/admin/tenants", json={"name": "lifecycle"}).status_code == 409
    assert g.admin("POST", "/admin/tenants", json={"name": "bad name!"}).status_code == 400
    assert g.admin("POST", "/admin/tenants", json={"name": "x", "requests_per_minute": 0}).status_code == 400
    t = g.admin("GET", "/admin/tenants/lifecycle").json()
    assert t["models"] == ["tiny"] and t["priority"] == 3 and t["cache_isolated"] and len(t["key_ids"]) == 1
    assert "cache_salt" not in t and k1 not in json.dumps(t)
    r = g.admin("PATCH", "/admin/tenants/lifecycle", json={"requests_per_minute": 100, "priority": None})
    assert r.status_code == 200 and r.json()["requests_per_minute"] == 100 and r.json()["priority"] == 0
    k2 = g.admin("POST", "/admin/tenants/lifecycle/keys").json()
    sdk(fleet, k1).models.list()
    sdk(fleet, k2["api_key"]).models.list()
    assert g.admin("DELETE", f"/admin/tenants/lifecycle/keys/{k2['key_id']}").status_code == 200
    assert g.admin("DELETE", "/admin/tenants/lifecycle/keys/nope").status_code == 404
    with pytest.raises(openai.AuthenticationError):
        sdk(fleet, k2["api_key"]).models.list()  # revoked on this gateway at once
    assert "lifecycle" in [t["name"] for t in g.admin("GET", "/admin/tenants").json()]
    assert g.admin("DELETE", "/admin/tenants/lifecycle").status_code == 200
    assert g.admin("GET", "/admin/tenants/lifecycle").status_code == 404
    with pytest.raises(openai.AuthenticationError):
        sdk(fleet, k1).models.list()


def test_admin_models_lists_replicas_with_their_load(fleet):
    data = fleet.gateway.admin("GET", "/admin/models").json()["data"]
    [m] = [m for m in data if m["name"] == MODEL]
    assert len(m["replicas"]) == 2 and m["routing_policy"] == "prefix-aware"
    for rep in m["replicas"]:
        assert rep["url"].startswith("http://127.0.0.1:") and rep["state"] == "awake"
        assert set(rep["load"]) >= {"running", "waiting", "kv_usage", "gateway_inflight"}


def test_sleep_through_the_admin_api_and_wake_on_request(fleet, key):
    g = fleet.gateway
    r = g.admin("POST", f"/admin/models/{MODEL}/sleep", params={"level": 1})
    assert r.status_code == 200 and len(r.json()["replicas"]) == 2, r.text
    store = fleet.store()
    wait_until(lambda: all(hb.state == "sleeping" for hb in store.live_replicas(MODEL)), 20, 0.1, "sleep")
    wait_until(lambda: g.metric("kvfleet_gateway_replicas", model=MODEL, state="sleeping") == 2, 10, 0.1,
               "the gateway to see it")  # fmt: skip
    results: list = []

    def ask():
        results.append(sdk(fleet, key).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "wake up"}], max_tokens=3))  # fmt: skip

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 3 and all(r.usage.completion_tokens == 3 for r in results)
    assert g.metric("kvfleet_gateway_wakes_total", model=MODEL, outcome="woke") >= 1
    assert "waking it" in g.log()
    wait_until(lambda: all(hb.state == "awake" for hb in store.live_replicas(MODEL)), 20, 0.1, "awake")
    # per replica too
    replica = store.live_replicas(MODEL)[0]
    r = g.admin("POST", f"/admin/models/{MODEL}/replicas/{replica.name}/sleep")
    assert r.status_code == 200 and list(r.json()["replicas"]) == [replica.replica_id]
    assert g.admin("POST", f"/admin/models/{MODEL}/replicas/{replica.name}/wake").status_code == 200
    assert g.admin("POST", f"/admin/models/{MODEL}/replicas/nope/wake").status_code == 404
    assert g.admin("POST", f"/admin/models/{MODEL}/sleep", params={"level": 3}).status_code == 400
    assert store.last_activity(MODEL) is not None and time.time() - store.last_activity(MODEL) < 60


def test_replicas_put_to_sleep_behind_the_gateways_back_are_woken_not_failed(fleet, key):
    """The engines sleep (an operator's idle scale-down, another gateway) while this gateway's snapshot
    still says awake: their 503 says "sleeping", so the request wakes the model instead of failing."""
    g = fleet.start_gateway("--registry-refresh", "60")  # its snapshot will not see the sleep
    before = g.metric("kvfleet_gateway_routing_fallbacks_total", model=MODEL, reason="replica_asleep")
    for e in fleet.engines:
        r = httpx.post(f"{e.url}/sleep", params={"level": 1}, headers=e.admin_headers, timeout=60)
        assert r.status_code == 200, r.text
    reply = sdk(fleet, key, gateway=g).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "are you there"}], max_tokens=2
    )
    assert reply.usage.completion_tokens == 2
    assert (
        g.metric("kvfleet_gateway_routing_fallbacks_total", model=MODEL, reason="replica_asleep")
        >= before + 1
    )
    wait_until(lambda: fleet.gateway.metric("kvfleet_gateway_replicas", model=MODEL, state="awake") == 2, 20,
               0.1, "the other gateway to see them awake")  # fmt: skip


def test_one_redis_round_trip_per_request(fleet, key):
    g = fleet.gateway
    before = g.metric("kvfleet_gateway_redis_round_trips_total", path="request")
    c = sdk(fleet, key)
    for i in range(10):
        c.completions.create(model=MODEL, prompt=f"count {i}", max_tokens=1)
    after = g.metric("kvfleet_gateway_redis_round_trips_total", path="request")
    assert after - before <= 10 + 1  # admit per request (+ at most one tenant-cache refresh)


def test_schemathesis_finds_no_server_errors(fleet, key):
    """Fuzz the gateway's OpenAI and admin operations (authenticated): nothing may answer 5xx."""
    schemathesis = pytest.importorskip("schemathesis")

    g = fleet.gateway
    schema = schemathesis.openapi.from_url(f"{g.url}/openapi.json")
    failures: list = []
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path.endswith(("/sleep", "/wake")) or op.method.upper() == "DELETE":
            continue  # state-changing admin calls: tested by name above
        _fuzz(op, g.url, g.admin_token if op.path.startswith("/admin") else key, failures)
    assert not failures, failures[:3]


def _fuzz(op, base_url: str, token: str, failures: list) -> None:
    from hypothesis import HealthCheck, given, settings

    from tests.server.test_bad_input import _keep_generation_short

    @settings(max_examples=10, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy())
    def fuzz(case):
        _keep_generation_short(case.body)
        response = case.call(base_url=base_url, timeout=60, headers={"Authorization": f"Bearer {token}"})
        if response.status_code >= 500:
            failures.append((op.method, op.path, case.body, response.status_code, response.text[:300]))

    fuzz()


# ---- the fast path (kvfleet_gateway.fast_path) -------------------------------------------------------

_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
_UGLY = [  # (name, body, headers beyond the tenant's key; None: no key at all)
    ("malformed JSON", b"{not json", {}),
    ("truncated JSON", b'{"model": "', {}),
    ("no key", json.dumps(_CHAT).encode(), None),
    ("wrong key", json.dumps(_CHAT).encode(), {"Authorization": "Bearer kvf-wrong"}),
    ("not a bearer key", json.dumps(_CHAT).encode(), {"Authorization": "Basic Zm9vOmJhcg=="}),
    ("negative temperature", json.dumps({**_CHAT, "temperature": -1}).encode(), {}),
    ("n = 0", json.dumps({**_CHAT, "n": 0}).encode(), {}),
    ("two problems", json.dumps({**_CHAT, "n": 0, "top_p": 7}).encode(), {}),
    ("no messages", json.dumps({"model": MODEL}).encode(), {}),
    ("messages an object", json.dumps({"model": MODEL, "messages": {"role": "user"}}).encode(), {}),
    ("unknown model", json.dumps({**_CHAT, "model": "nope"}).encode(), {}),
    ("too long for the model", json.dumps({**_CHAT, "messages": [{"role": "user", "content": "word " * 2000}]}).encode(), {}),
    ("too large", json.dumps({**_CHAT, "messages": [{"role": "user", "content": "x" * (33 << 20)}]}).encode(), {}),
]  # fmt: skip


def _post(url: str, path: str, body: bytes, headers: dict | None, key: str) -> httpx.Response:
    h = {"content-type": "application/json"}
    if headers is not None:
        h["Authorization"] = f"Bearer {key}"
        h.update(headers)
    return httpx.post(f"{url}{path}", content=body, headers=h, timeout=60)


def test_the_fast_path_answers_like_fastapi(fleet, key):
    """Every ugly request gets the same status and the same OpenAI-shaped error from the fast path as
    from the FastAPI routes (``--no-fast-path``), and a good request the same completion."""
    with run_gateway(fleet.redis.url, fleet.log_dir, "--no-fast-path") as slow:
        for path in ("/v1/chat/completions", "/v1/completions"):
            for name, body, headers in _UGLY:
                if path == "/v1/completions" and body.startswith(b"{") and b"messages" in body:
                    body = body.replace(b'"messages"', b'"prompt"')
                fast_r = _post(fleet.gateway.url, path, body, headers, key)
                slow_r = _post(slow.url, path, body, headers, key)
                assert fast_r.status_code == slow_r.status_code, (path, name, fast_r.text, slow_r.text)
                assert fast_r.status_code in (400, 401, 404, 413), (path, name, fast_r.text)
                assert fast_r.json() == slow_r.json(), (path, name)
                assert fast_r.headers.get("www-authenticate") == slow_r.headers.get("www-authenticate")
        good = {**_CHAT, "max_tokens": 5, "temperature": 0}
        answers = [
            _post(g.url, "/v1/chat/completions", json.dumps(good).encode(), {}, key)
            for g in (fleet.gateway, slow)
        ]
        assert [a.status_code for a in answers] == [200, 200]
        assert answers[0].json()["choices"] == answers[1].json()["choices"]
        # not on the fast path: other methods, other paths
        assert httpx.get(f"{fleet.gateway.url}/v1/chat/completions").status_code == 405
    assert "POST /v1/chat/completions rejected: 401" in fleet.gateway.log()  # rejections get their log line


def test_the_fast_path_reads_json_whatever_the_content_type(fleet, key):
    """``curl -d`` sends form-encoded headers; an empty body or a non-object is a clear 400."""
    r = httpx.post(f"{fleet.gateway.url}/v1/chat/completions", content=json.dumps(_CHAT),
                   headers={"Authorization": f"Bearer {key}", "content-type": "application/x-www-form-urlencoded"})  # fmt: skip
    assert r.status_code == 200, r.text
    for body, fragment in ((b"", "empty"), (b"  \n", "empty"), (b"[1, 2]", "valid dictionary"),
                           (b"\xff\xfe{}", "not valid JSON")):  # fmt: skip
        r = httpx.post(f"{fleet.gateway.url}/v1/chat/completions", content=body,
                       headers={"Authorization": f"Bearer {key}"})  # fmt: skip
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_oversized_request_heads_get_a_431_and_normal_ones_still_pass(fleet, key):
    """The gateway bounds a request's headers (``--max-request-head-bytes``, 64 KiB) as it bounds its body."""
    headers = {"Authorization": f"Bearer {key}", "x-request-id": "r" * (80 * 1024)}
    r = httpx.post(f"{fleet.gateway.url}/v1/chat/completions", json=_CHAT, headers=headers, timeout=60)
    assert r.status_code == 431 and r.json()["error"]["code"] == "request_header_fields_too_large"
    headers["x-request-id"] = "r" * (8 * 1024)  # within the bound: served, under an id of the gateway's own
    r = httpx.post(
        f"{fleet.gateway.url}/v1/chat/completions", json={**_CHAT, "max_tokens": 2}, headers=headers
    )
    assert r.status_code == 200 and r.headers["x-request-id"].startswith("gw-")
    assert len(r.headers["x-request-id"]) < 64 and "r" * 201 not in fleet.gateway.log()


def test_the_client_request_id_reaches_the_replica_when_usable(fleet, key):
    """A usable X-Request-Id is the request's id from end to end (the response header and ``id``, the
    gateway's and the replica's log lines); one with spaces is replaced by the gateway's own."""
    auth = {"Authorization": f"Bearer {key}"}
    r = httpx.post(f"{fleet.gateway.url}/v1/chat/completions", json={**_CHAT, "max_tokens": 2},
                   headers={**auth, "x-request-id": "trace-4a7/b"})  # fmt: skip
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-4a7/b" == r.json()["id"]
    replica = fleet.engine_for(r.headers["x-kvfleet-replica"])
    wait_until(lambda: " trace-4a7/b " in fleet.gateway.log() and " trace-4a7/b " in replica.log_path.read_text(),
               10, 0.1, "both log lines")  # fmt: skip
    r = httpx.post(f"{fleet.gateway.url}/v1/chat/completions", json={**_CHAT, "max_tokens": 2},
                   headers={**auth, "x-request-id": "two words"})  # fmt: skip
    assert r.status_code == 200 and r.headers["x-request-id"].startswith("gw-")
    assert r.json()["id"] == r.headers["x-request-id"]


def test_a_client_whose_body_stops_arriving_gets_a_408_and_leaves_nothing_behind(fleet, key):
    """Slowloris on the body: the gateway answers 408 after ``--request-read-timeout`` and the request's task
    ends quietly (no traceback, no 500); the next request on a new connection is served."""
    with run_gateway(fleet.redis.url, fleet.log_dir, "--request-read-timeout", "1") as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        body = json.dumps(_CHAT).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer {key}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode()  # fmt: skip
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(head + body[:10])
            response = b""
            while chunk := sock.recv(65536):
                response += chunk
        assert response.startswith(b"HTTP/1.1 408 "), response
        r = httpx.post(
            f"{gw.url}/v1/chat/completions", json=_CHAT, headers={"Authorization": f"Bearer {key}"}
        )
        assert r.status_code == 200
        time.sleep(0.5)
        log = gw.log()
    assert "body did not arrive within 1 s" in log and "Traceback" not in log and "status=500" not in log
