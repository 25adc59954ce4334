"""Structured outputs, tool calling, logit bias and prompt logprobs through the gateway (real Redis, two real
tiny engine replicas, two real gateways: the fast path and ``--no-fast-path``).

What the gateway owes these requests: their fields reach the engine unchanged (the answer through the
gateway is the answer the engine gives the same request directly), its prompt-token prediction counts the
tools the chat template renders (and not a ``response_format`` schema, which the model never reads), so
routing finds the prefix of a shared system prompt + tools and a tenant is charged once, what the engine
ran; and the engine's 400s for bad structured inputs reach the client as the engine wrote them.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import httpx
import pytest

from kvfleet_common.chat_rendering import render_chat_prompt
from kvfleet_common.openai_protocol import ChatCompletionRequest
from kvfleet_gateway.tokenization import load_tokenizer_files
from tests.engine.tool_definitions import TIME, WEATHER
from tests.gateway.gateway_harness import MODEL, Fleet, wait_until

SYSTEM = ("You are kvfleet's travel assistant. Answer briefly and precisely; call a function when one "
          "can answer the question. ") * 2  # fmt: skip
TOOLS = [WEATHER, TIME]
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["answer", "ok"],
    "additionalProperties": False,
}


def _big_schema(properties: int = 40) -> dict:
    """A schema of ~20 kB (long descriptions: the grammar ignores them), thousands of tokens were it part of
    the prompt, which holds 1,024."""
    described = "This property's description is long on purpose, as generated API schemas often are. " * 6
    props = {f"field_{i}": {"type": "boolean", "description": described} for i in range(properties)}
    return {"type": "object", "properties": props, "required": ["field_0"], "additionalProperties": False}


def chat(user: str, **kw) -> dict:
    return {"model": MODEL, "temperature": 0, "max_tokens": 8,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}], **kw}  # fmt: skip


NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}
JSON_SCHEMA = {
    "type": "json_schema",
    "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True},
}


def completion(prompt: str, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 4, **kw}


# (endpoint, body): each a greedy request whose new fields the engine must see as sent
CHAT, COMPLETIONS = "chat/completions", "completions"
CASES = {
    "tools-required": (CHAT, chat("Weather?", tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                  max_tokens=200)),
    "tools-named-streamed": (CHAT, chat("Time in Oslo?", tools=TOOLS, tool_choice=NAMED_TIME, stream=True,
                                        max_tokens=200)),
    "json-schema": (CHAT, chat("Is it sunny?", response_format=JSON_SCHEMA, max_tokens=60)),
    "json-object-streamed": (CHAT, chat("Any JSON", response_format={"type": "json_object"}, stream=True)),
    "structured-outputs-choice": (CHAT, chat("Yes or no?", structured_outputs={"choice": ["yes", "no", "maybe"]})),
    "logit-bias": (CHAT, chat("Say anything", max_tokens=4, logit_bias={"300": 100})),
    "prompt-logprobs": (COMPLETIONS, completion("The lighthouse keeper", prompt_logprobs=2)),
    "echo-logprobs": (COMPLETIONS, completion("Once upon a time", echo=True, logprobs=2)),
}  # fmt: skip
# every case through the fast path; through FastAPI's (--no-fast-path) a streamed, a whole and a completion
ROUTES = [(case, "fast-path") for case in CASES] + [
    (case, "fastapi") for case in ("tools-named-streamed", "json-schema", "echo-logprobs")
]


@pytest.fixture(scope="module")
def fleet(demo_model, tmp_path_factory):
    with Fleet(demo_model("llama", "tiny"), tmp_path_factory.mktemp("fleet")) as f:
        f.start_engines(2, "--max-model-len", "1024")  # room for the tools' system turn and their calls
        f.start_gateway()
        f.start_gateway("--no-fast-path")
        yield f


@pytest.fixture(scope="module")
def key(fleet):
    return fleet.gateway.create_tenant("structured")


@pytest.fixture(scope="module")
def tokenizer(fleet):
    store = fleet.store()
    [hb, *_] = store.live_replicas(MODEL)
    return load_tokenizer_files(store.fetch_tokenizer(MODEL, hb.tokenizer_revision))


def post(url: str, endpoint: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}/v1/{endpoint}", json=body, headers=headers or {}, timeout=120)


def through_gateway(fleet, key: str, endpoint: str, body: dict, gateway: int = 0) -> httpx.Response:
    g = fleet.gateways[gateway]
    return post(g.url, endpoint, body, {"Authorization": f"Bearer {key}", "x-kvfleet-debug": g.admin_token})


def answer(response: httpx.Response, stream: bool) -> dict:
    """The response less what differs between two runs of one request (ids, timestamps, cached tokens). A
    stream is taken as what its events add up to: how tokens fall into events depends on timing (a slow
    reader gets several merged into one)."""
    assert response.status_code == 200, response.text
    if not stream:
        data = response.json()
        for choice in data["choices"]:
            for call in choice.get("message", {}).get("tool_calls") or ():
                call.pop("id")  # a call's id is random (call_<uuid>)
    else:  # (the calls' ids left out)
        lines = [line for line in response.text.split("\n\n") if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        data = accumulated([json.loads(line[len("data: ") :]) for line in lines[:-1]])
    data.pop("id", None), data.pop("created", None)
    if data.get("usage"):
        data["usage"].pop("prompt_tokens_details", None)
    return data


def accumulated(events: list[dict]) -> dict:
    """A chat stream's events as one response: per choice its content, its calls (pieces joined), its
    logprobs and finish reason; the stream's usage."""
    choices: dict[int, dict] = {}
    for event in events:
        for ch in event["choices"]:
            acc = choices.setdefault(ch["index"], {"index": ch["index"], "message": {}, "logprobs": []})
            delta, message = ch["delta"], acc["message"]
            for key in ("role", "content"):
                if delta.get(key) is not None:
                    message[key] = message.get(key, "") + delta[key]
            for piece in delta.get("tool_calls") or ():
                call = message.setdefault("tool_calls", {}).setdefault(piece["index"], {"arguments": ""})
                call.update({k: v for k, v in piece.items() if k not in ("index", "function", "id")})
                call.setdefault("name", piece["function"].get("name"))
                call["arguments"] += piece["function"].get("arguments", "")
            acc["logprobs"] += (ch.get("logprobs") or {}).get("content") or []
            if ch.get("finish_reason") is not None:
                acc["finish_reason"] = ch["finish_reason"]
    usage = [e["usage"] for e in events if e.get("usage")]
    return {"model": events[0]["model"], "choices": [choices[i] for i in sorted(choices)], "usage": usage}


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Equal, floats (logprobs) within 1e-4: a prompt whose prefix was cached is prefilled in other shapes."""
    if isinstance(want, float) and isinstance(got, (float, int)):
        assert math.isclose(got, want, abs_tol=1e-4), f"{where}: {got} != {want}"
    elif isinstance(want, dict) and isinstance(got, dict):
        assert got.keys() == want.keys(), f"{where}: {sorted(got)} != {sorted(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list) and isinstance(got, list):
        assert len(got) == len(want), f"{where}: {len(got)} items != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


# ---- the fields pass through ----------------------------------------------------------------------------


@pytest.mark.parametrize(("case", "path"), ROUTES, ids=[f"{c}-{p}" for c, p in ROUTES])
def test_the_answer_through_the_gateway_is_the_engines(fleet, key, case, path):
    endpoint, body = CASES[case]
    gateway = ["fast-path", "fastapi"].index(path)
    via = through_gateway(fleet, key, endpoint, body, gateway)
    assert via.status_code == 200, via.text
    engine = fleet.engine_for(via.headers["x-kvfleet-replica"])
    # the same request, straight to the replica that served it (its own salt: a prefill of its own)
    direct = post(engine.url, endpoint, {**body, "cache_salt": f"direct-{case}-{gateway}"})
    stream = bool(body.get("stream"))
    got, want = answer(via, stream), answer(direct, stream)
    assert_same(got, want)
    if case == "tools-required":
        [choice] = want["choices"]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"]
        for call in choice["message"]["tool_calls"]:
            assert call["function"]["name"] in {"get_weather", "get_time"}
            json.loads(call["function"]["arguments"])
    elif case == "tools-named-streamed":
        [choice] = want["choices"]
        assert [c["name"] for c in choice["message"]["tool_calls"].values()] == ["get_time"]
    elif case == "json-schema":
        assert want["choices"][0]["finish_reason"] == "stop"
        assert set(json.loads(want["choices"][0]["message"]["content"])) == {"answer", "ok"}
    elif case == "structured-outputs-choice":
        assert want["choices"][0]["message"]["content"] in {"yes", "no", "maybe"}
    elif case == "prompt-logprobs":
        assert want["choices"][0]["prompt_logprobs"][0] is None
        assert len(want["choices"][0]["prompt_logprobs"]) == want["usage"]["prompt_tokens"]
    elif case == "echo-logprobs":
        assert want["choices"][0]["text"].startswith("Once upon a time")


def test_logit_bias_reaches_the_engine(fleet, key, tokenizer):
    _, body = CASES["logit-bias"]
    r = through_gateway(fleet, key, "chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == tokenizer.decode([300] * 4)


def test_the_body_is_forwarded_byte_for_byte(fleet, key):
    """Fields the request model renames (``schema``), nests or does not know at all reach the engine as
    sent: the engine echoes none back, but it answers them: a ``schema`` alias dropped would be a 400."""
    body = chat("Is it sunny?", max_tokens=60, some_future_field={"x": [1, 2.5, "\u00e9"]}, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}})  # fmt: skip
    raw = json.dumps(body, indent=2, ensure_ascii=True).encode() + b"\n\n"  # whitespace and escapes: kept
    for g in fleet.gateways:
        r = httpx.post(f"{g.url}/v1/chat/completions", content=raw, timeout=120,
                       headers={"Authorization": f"Bearer {key}", "content-type": "application/json"})  # fmt: skip
        assert r.status_code == 200, r.text
        assert set(json.loads(r.json()["choices"][0]["message"]["content"])) == {"answer", "ok"}


# ---- tools in the prompt: prediction, routing, accounting -----------------------------------------------


def test_predicted_prompt_tokens_count_the_tools_and_not_the_schema(fleet, key, tokenizer):
    def predicted_and_used(body: dict) -> tuple[int, int]:
        r = through_gateway(fleet, key, "chat/completions", body)
        assert r.status_code == 200, r.text
        return json.loads(r.headers["x-kvfleet-route"])["prompt_tokens"], r.json()["usage"]["prompt_tokens"]

    plain = predicted_and_used(chat("Weather in Rome?"))
    tools = predicted_and_used(chat("Weather in Rome?", tools=TOOLS, tool_choice="none"))
    schema = predicted_and_used(chat("Weather in Rome?", response_format={
        "type": "json_schema", "json_schema": {"name": "big", "schema": _big_schema()}}))  # fmt: skip
    assert plain[0] == plain[1] and tools[0] == tools[1] and schema[0] == schema[1]
    rendered = render_chat_prompt(
        tokenizer, ChatCompletionRequest.model_validate(chat("Weather in Rome?", tools=TOOLS))
    )
    assert '"name": "get_weather"' in rendered  # the tools are in the prompt...
    assert tools[0] == len(tokenizer.encode(rendered, add_special_tokens=False)) > plain[0] + 100
    assert schema[0] == plain[0]  # ...a response_format schema is not


def test_a_shared_system_prompt_with_tools_is_a_prefix_hit(fleet, key):
    replicas, predictions = set(), []
    for i in range(3):
        r = through_gateway(fleet, key, "chat/completions", chat(f"Question {i}: weather?", tools=TOOLS))
        assert r.status_code == 200, r.text
        route = json.loads(r.headers["x-kvfleet-route"])
        replicas.add(r.headers["x-kvfleet-replica"])
        chosen = next(c for c in route["candidates"] if c["replica"] == r.headers["x-kvfleet-replica"])
        predictions.append(
            (chosen["matched_tokens"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        )
        time.sleep(0.3)  # the replica's KV events reach Redis
    assert len(replicas) == 1, predictions
    # the system turn with the tools (~hundreds of tokens) is cached, and the gateway knew it would be
    assert all(p == actual and p >= 128 for p, actual in predictions[1:]), predictions


def test_a_schema_heavy_tenant_is_charged_what_the_engine_ran(fleet):
    """Tokens per minute: a ~20 kB response_format schema is no part of the prompt, so neither the
    reservation nor the charge counts it; the tenant is charged the engine's usage, once."""
    key = fleet.gateway.create_tenant("schema-heavy", tokens_per_minute=2000)
    body = chat("Fill the form", max_tokens=8, response_format={
        "type": "json_schema", "json_schema": {"name": "form", "schema": _big_schema()}})  # fmt: skip
    minute = int(time.time() // 60)
    used = []
    for _ in range(3):  # were the schema counted (~4,000 tokens) the second would be refused (429)
        r = through_gateway(fleet, key, "chat/completions", body)
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        used.append((u["prompt_tokens"], u["completion_tokens"]))
    prompt, completion = sum(p for p, _ in used), sum(c for _, c in used)
    assert prompt < 3 * 200

    def usage() -> dict | None:
        data = fleet.gateway.admin("GET", "/admin/usage", params={"tenant": "schema-heavy"}).json()["data"]
        total = data["schema-heavy"]["total"]
        return data["schema-heavy"] if total["prompt_tokens"] + total["completion_tokens"] else None

    wait_until(lambda: (u := usage()) and u["total"]["completion_tokens"] >= completion, 10, 0.05, "usage")
    data = usage()
    assert data["total"]["prompt_tokens"] == prompt and data["total"]["completion_tokens"] == completion
    if int(time.time() // 60) == minute:  # the minute's window: charged once, every reservation handed back
        wait_until(lambda: usage()["this_minute"]["tokens"] == prompt + completion, 10, 0.05, "settlement")


# ---- the engine's 400s -------------------------------------------------------------------------------------


BAD = {
    "bad-regex": chat("x", structured_outputs={"regex": "(unclosed"}),
    "bad-grammar": chat("x", structured_outputs={"grammar": "start: ??? nonsense"}),
    "bad-schema": chat(
        "x",
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "s",
                "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}},
            },
        },
    ),
    "continue-a-user-message": chat("x", continue_final_message=True, add_generation_prompt=False),
}


@pytest.mark.parametrize("case", list(BAD))
def test_the_engines_400s_reach_the_client_unchanged(fleet, key, case):
    direct = post(fleet.engines[0].url, "chat/completions", BAD[case])
    assert direct.status_code == 400, direct.text
    error = direct.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    for gateway in (0, 1):
        via = through_gateway(fleet, key, "chat/completions", BAD[case], gateway)
        assert (via.status_code, via.json()) == (400, direct.json())


# ---- the upstream body, as a function --------------------------------------------------------------------


def test_upstream_body_is_the_clients_bytes_with_the_gateways_fields_last():
    from kvfleet_common.schemas import TenantRecord
    from kvfleet_gateway.upstream_request import upstream_payload

    tenant = TenantRecord(name="t", priority=2, cache_salt="salt")
    body = chat(
        "hi", priority=-7, response_format=JSON_SCHEMA, logit_bias={"5": -1.50}, future={"\u00e9": 1e-7}
    )
    sent = json.dumps(body, indent=1, ensure_ascii=False).encode() + b"\n"
    request = ChatCompletionRequest.model_validate_json(sent)
    out = upstream_payload(sent, request, tenant)
    assert out.startswith(sent.rstrip()[:-1])  # every byte the client sent, in its order
    assert json.loads(out) == {**body, "priority": -2, "cache_salt": "salt"}  # the last duplicate wins
    # UTF-16 and a UTF-8 BOM (json.loads reads both): the same request, re-encoded as ASCII JSON
    for encoded in (json.dumps(body).encode("utf-16"), b"\xef\xbb\xbf" + json.dumps(body).encode()):
        out = upstream_payload(encoded, request, tenant)
        assert out.isascii() and json.loads(out) == {**body, "priority": -2, "cache_salt": "salt"}
    streamed = {**body, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    sent = json.dumps(streamed).encode()
    out = json.loads(upstream_payload(sent, ChatCompletionRequest.model_validate_json(sent), tenant))
    assert out["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
