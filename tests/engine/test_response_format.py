"""response_format (text, json_object, json_schema) and vLLM's structured_outputs over HTTP, on a real engine
server with the random-weight demo model: its answers are JSON only because the constraint makes them so.
Conflicting or malformed constraints are OpenAI-shaped 400s.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

MESSAGES = [{"role": "user", "content": "Describe the weather in Paris as JSON."}]
SMALL_SCHEMA = {
    "type": "object",
    "properties": {"sunny": {"type": "boolean"}},
    "required": ["sunny"],
    "additionalProperties": False,
}
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Lyon", "Nice"]},
        "celsius": {"type": "integer", "minimum": -30, "maximum": 45},
        "sunny": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["city", "celsius", "sunny", "note"],
    "additionalProperties": False,
}


class Weather(BaseModel):
    city: Literal["Paris", "Lyon", "Nice"]
    celsius: int = Field(ge=-30, le=45)
    sunny: bool
    tags: list[Literal["wind", "rain", "sun"]] = Field(max_length=3)


def token_id(server, text: str) -> int:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False})
    [tid] = r.json()["tokens"]
    return tid


def test_json_schema_answers_validate(client, server):
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA}}
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 4, "n": 3}):
        resp = client.chat.completions.create(
            model=server.model, messages=MESSAGES, response_format=response_format, max_tokens=120, **kw
        )
        for choice in resp.choices:
            assert choice.finish_reason == "stop"  # the grammar completed: the request ended there
            jsonschema.validate(json.loads(choice.message.content), WEATHER_SCHEMA)


def test_sdk_parse_with_a_pydantic_model(client, server):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    completion = parse(
        model=server.model,
        messages=MESSAGES,
        response_format=Weather,
        max_tokens=200,
        temperature=0.9,
        seed=8,
        n=2,
    )
    for choice in completion.choices:
        assert isinstance(choice.message.parsed, Weather)
        assert Weather.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_is_a_json_object(client, server):
    """Any JSON object: a random model writes a string key that never ends, so a bias toward "}" (and away
    from the '{"' token) lets it close. Without the constraint the same bias gives "}}}}" (no JSON)."""
    bias = {str(token_id(server, "}")): 100, str(token_id(server, '{"')): -100}
    kw = dict(model=server.model, messages=MESSAGES, max_tokens=40, temperature=0, logit_bias=bias)
    resp = client.chat.completions.create(response_format={"type": "json_object"}, **kw)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)
    free = client.chat.completions.create(**kw).choices[0].message.content
    assert free.startswith("}}}")
    # unbiased: the answer is at least the beginning of an object, whitespace before it bounded
    greedy = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert greedy.choices[0].message.content.lstrip().startswith("{")


def test_text_format_and_stream_of_a_schema(client, server):
    kw = dict(model=server.model, messages=MESSAGES, max_tokens=6, temperature=0)
    text = client.chat.completions.create(response_format={"type": "text"}, **kw).choices[0].message.content
    assert text == client.chat.completions.create(**kw).choices[0].message.content
    schema_kw = dict(
        kw,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SMALL_SCHEMA}},
    )
    whole = client.chat.completions.create(**schema_kw).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **schema_kw)
        if c.choices
    )
    assert streamed == whole
    jsonschema.validate(json.loads(whole), SMALL_SCHEMA)


def test_structured_outputs_extra_on_both_endpoints(client, server):
    regex = r"[a-d]{2,4}-[0-9]{1,2}"
    for seed in (1, 2):
        resp = client.completions.create(
            model=server.model, prompt="The code is", max_tokens=20, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": {"regex": regex}},
        )  # fmt: skip
        assert re.fullmatch(regex, resp.choices[0].text) and resp.choices[0].finish_reason == "stop"
    choices = ["yes", "no", "maybe later"]
    chat = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=20, temperature=1.0, seed=3, n=4,
        extra_body={"structured_outputs": {"choice": choices}},
    )  # fmt: skip
    assert all(c.message.content in choices for c in chat.choices)
    schema = client.completions.create(
        model=server.model, prompt="{", max_tokens=60, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SMALL_SCHEMA}}},
    )  # fmt: skip
    jsonschema.validate(json.loads(schema.choices[0].text), SMALL_SCHEMA)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": server.model, "max_tokens": 4, **body})


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, "schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
            "schema",
        ),
        ({"response_format": {"type": "json_schema"}}, "needs a json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "text", "json_schema": {"schema": {}}}}, "takes no json_schema"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}}, "cannot both"),
        (
            {
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
                "structured_outputs": {"json": {"type": "object"}},
            },
            "cannot both",
        ),
        ({"structured_outputs": {}}, "exactly one"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
        ({"structured_outputs": {"json": "not json"}}, "not valid JSON"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "regex"),
        ({"structured_outputs": {"grammar": "start: nope_rule"}}, "grammar"),
        ({"structured_outputs": {"choice": []}}, "choice"),
        (
            {
                "structured_outputs": {
                    "json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
                }
            },
            "JSON schema does not compile",
        ),
    ],
)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_constraint_errors_are_openai_shaped_400s(server, body, fragment, endpoint):
    if endpoint == "chat":
        r = post(server, "/v1/chat/completions", {"messages": MESSAGES, **body})
    else:
        r = post(server, "/v1/completions", {"prompt": "hi", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and fragment in error["message"], error


BAD_SCHEMA = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
            "response_format",
        ),
        ({"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_a_constraint_that_does_not_compile_names_the_field_it_came_from(server, body, param):
    r = post(server, "/v1/chat/completions", {"messages": MESSAGES, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_structured_output", error
    assert "does not compile" in error["message"]


@pytest.mark.parametrize(
    ("legacy", "check"),
    [
        ({"guided_choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
        ({"guided_regex": "[0-9]{3}"}, lambda text: len(text) == 3 and text.isdigit()),
        ({"guided_json": {"type": "boolean"}}, lambda text: json.loads(text) in (True, False)),
    ],
)
def test_vllms_older_guided_fields_constrain_the_output(server, legacy, check):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 8, **legacy})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and check(choice["text"]), choice


def test_two_constraints_old_and_new_are_a_400(server):
    body = {"prompt": "hi", "guided_regex": "a", "structured_outputs": {"regex": "b"}}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400 and "exclude each other" in r.json()["error"]["message"], r.text
