"""Structured outputs over HTTP: ``response_format`` and vLLM's ``structured_outputs`` extra on a real server.

One ``kvfleet engine serve`` process (tiny demo model, random weights: conformance is the grammar's doing).
Responses are checked with ``jsonschema`` / ``re.fullmatch``, not with the grammar library; a constraint that
does not compile is an OpenAI-style 400, and the server keeps serving after it.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.engine.structured_schemas import SCHEMAS, validate_instance

# The server's max_model_len is 512 (tests/server/conftest.py): a short prompt plus this fits, and the
# corpus's longest greedy instance with the engine's default (bounded) JSON whitespace is well under it.
MAX_TOKENS = 440
HTTP_SCHEMAS = [
    "invoice",
    "address",
    "shape_oneof",
    "bank_transfer_refs",
    "nullable_fields",
    "top_level_array",
]


def _schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def _chat(server, body: dict, timeout: float = 120) -> httpx.Response:
    body = {"model": server.model, "messages": [{"role": "user", "content": "Extract the record."}], **body}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=timeout)


def test_chat_response_format_json_schema(server):
    """Several schemas at once (concurrent requests share the engine's batches), the default whitespace."""
    with ThreadPoolExecutor(len(HTTP_SCHEMAS)) as pool:
        responses = list(
            pool.map(
                lambda name: _chat(
                    server,
                    {"response_format": _schema_format(name), "temperature": 0, "max_tokens": MAX_TOKENS},
                ),
                HTTP_SCHEMAS,
            )
        )
    for name, resp in zip(HTTP_SCHEMAS, responses):
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        validate_instance(choice["message"]["content"], SCHEMAS[name])


def test_sampled_n2_with_the_openai_sdk(client, server):
    resp = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "A calendar event, please."}],
        response_format=_schema_format("calendar_event"),
        n=2,
        temperature=1.0,
        seed=4,
        max_tokens=MAX_TOKENS,
    )
    assert len(resp.choices) == 2
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        validate_instance(choice.message.content, SCHEMAS["calendar_event"])


def test_streamed_json_validates(client, server):
    stream = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Stream a support ticket."}],
        response_format=_schema_format("support_ticket"),
        temperature=0.7,
        seed=9,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    pieces, finishes = [], []
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert finishes == ["stop"]
    assert sum(1 for p in pieces if p) > 3  # it really streamed in pieces
    validate_instance("".join(pieces), SCHEMAS["support_ticket"])


def test_completions_structured_outputs_extra(server):
    """The ``structured_outputs`` extra on /v1/completions: compact JSON, regex and choice."""
    cases = [
        ({"json": SCHEMAS["log_event"], "disable_any_whitespace": True}, "json"),
        ({"regex": r"\(\d{3}\) \d{3}-\d{4}"}, "regex"),
        ({"choice": ["approve", "reject", "needs review"]}, "choice"),
    ]
    for constraint, kind in cases:
        body = {"model": server.model, "prompt": "Answer:", "max_tokens": 200, "temperature": 0.8, "seed": 1,
                "n": 2, "structured_outputs": constraint}  # fmt: skip
        resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        for choice in resp.json()["choices"]:
            assert choice["finish_reason"] == "stop", choice
            text = choice["text"]
            if kind == "json":
                validate_instance(text, SCHEMAS["log_event"])
                assert " " not in re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
            elif kind == "regex":
                assert re.fullmatch(constraint["regex"], text), text
            else:
                assert text in constraint["choice"], text


def test_json_object_response_format(server):
    # A random model need not close an open object's strings: a bias towards '"' (id 1) and '}' (id 92)
    # makes it (see tests/engine/test_structured_outputs.py); the grammar alone decides what is allowed.
    resp = _chat(
        server,
        {
            "response_format": {"type": "json_object"},
            "temperature": 1.0,
            "seed": 3,
            "n": 3,
            "logit_bias": {"1": 20, "92": 20},
            "max_tokens": MAX_TOKENS,
        },
    )
    assert resp.status_code == 200, resp.text
    for choice in resp.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        assert isinstance(json.loads(choice["message"]["content"]), dict)


BAD = {
    "unsatisfiable-schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "minimum": 5, "maximum": 1}}}},
    "dangling-ref": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}},
    "bad-regex": {"structured_outputs": {"regex": "([a-z]+"}},
    "bad-lark": {"structured_outputs": {"grammar": "start: undefined_rule"}},
}  # fmt: skip


@pytest.mark.parametrize("body", list(BAD.values()), ids=list(BAD))
def test_constraint_that_does_not_compile_is_400_and_server_keeps_serving(server, body):
    resp = _chat(server, {"max_tokens": 8, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    good = _chat(
        server, {"response_format": _schema_format("person"), "temperature": 0, "max_tokens": MAX_TOKENS}
    )
    assert good.status_code == 200, good.text
    validate_instance(good.json()["choices"][0]["message"]["content"], SCHEMAS["person"])
