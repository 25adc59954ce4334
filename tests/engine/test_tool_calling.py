"""Tool calling on /v1/chat/completions: the Hermes parser (streamed at every split point and whole), the
``required`` / named constraints on a real engine server with the random-weight demo model (whose answers
are valid calls only because the constraint makes them so), the chat template's tools, and the 400s.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from kvfleet_common.openai_tools import FunctionDefinition
from kvfleet_engine.server.chat_structure import required_calls_schema
from kvfleet_engine.server.tool_parser import CallArrayParser, HermesToolParser, NamedCallParser, parse_whole
from kvfleet_engine.tokenizer import load_tokenizer
from tests.engine.tool_definitions import NO_ARGS, ORDER, TIME, WEATHER

TOOL_SETS = [[WEATHER, TIME], [ORDER], [NO_ARGS, ORDER, WEATHER]]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]

SAMPLE = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "notes": ["</tool_call>", {"x": "\\"{"}]}}'
    "\n</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"zone": 1}}'
    "\n</tool_call>"
)
SAMPLE_CALLS = [
    ("get_weather", '{"city": "Paris", "notes": ["</tool_call>", {"x": "\\"{"}]}'),
    ("get_time", '{"zone": 1}'),
]


def schema_of(tool: dict) -> dict:
    return tool["function"].get("parameters") or {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }


# ---- the parsers --------------------------------------------------------------------------------------


def streamed(parser, pieces: list[str]):
    """Feed ``pieces``; return (content deltas, accumulated content or None, [(name, arguments)], first
    pieces of each call)."""
    deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish()
    contents = [d.content for d in deltas if d.content is not None]
    calls: dict[int, list[str]] = {}
    firsts = []
    for d in deltas:
        assert d.content is None or not d.tool_calls  # one kind per delta
        for piece in d.tool_calls or ():
            if piece.index not in calls:
                firsts.append(piece)
                calls[piece.index] = [piece.function.name, piece.function.arguments]
            else:
                assert piece.id is None and piece.type is None and piece.function.name is None
                calls[piece.index][1] += piece.function.arguments
    return contents, ("".join(contents) or None), [tuple(calls[i]) for i in sorted(calls)], firsts


def test_hermes_whole_text():
    content, calls = parse_whole(HermesToolParser(), SAMPLE)
    assert content == "Let me look."
    assert [(c.function.name, c.function.arguments) for c in calls] == SAMPLE_CALLS
    assert all(c.id.startswith("call_") and len(c.id) > 10 and c.type == "function" for c in calls)
    assert len({c.id for c in calls}) == 2
    for _, arguments in SAMPLE_CALLS:
        json.loads(arguments)


@pytest.mark.parametrize("extra_split", [False, True])
def test_hermes_streamed_at_every_split_point(extra_split):
    for i in range(len(SAMPLE) + 1):
        pieces = [SAMPLE[:i], SAMPLE[i:]]
        if extra_split:  # and a second split point, a third of the way further
            j = i + (len(SAMPLE) - i) // 3
            pieces = [SAMPLE[:i], SAMPLE[i:j], SAMPLE[j:]]
        _, content, calls, firsts = streamed(HermesToolParser(), pieces)
        assert content == "Let me look.", i
        assert calls == SAMPLE_CALLS, i
        assert [(f.index, f.type, f.function.arguments) for f in firsts] == [
            (0, "function", ""),
            (1, "function", ""),
        ]
        assert all(f.id.startswith("call_") for f in firsts)


def test_hermes_character_by_character_never_leaks_a_tag():
    contents, content, calls, _ = streamed(HermesToolParser(), list(SAMPLE))
    assert calls == SAMPLE_CALLS and content == "Let me look."
    assert not any("<" in c for c in contents)
    text = "a < b and <tool is not a tag <tool_cal"
    parser = HermesToolParser()
    before_end = "".join(d.content for char in text for d in parser.feed(char))
    assert before_end == "a < b and <tool is not a tag"  # what could begin a tag (and its space) waits
    assert "".join(d.content for d in parser.finish()) == " <tool_cal"


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("no calls here  ", "no calls here  ", []),
        ("<tool_call>\nnot json\n</tool_call> after", "<tool_call>\nnot json\n</tool_call> after", []),
        (
            'x\n<tool_call>{"name": "f", "arguments": {"a": }}</tool_call>',
            'x\n<tool_call>{"name": "f", "arguments": {"a": }}</tool_call>',
            [],
        ),
        (
            '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
            '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
            [],
        ),
        ('<tool_call>{"name": "f"}</tool_call>', None, [("f", "{}")]),
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n\n', None, [("f", '{"a": 1}')]),
        ('<tool_call>{"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a": 1}')]),  # no close tag
    ],
)
def test_hermes_edge_cases(text, content, calls):
    got_content, got_calls = parse_whole(HermesToolParser(), text)
    assert got_content == content
    assert [(c.function.name, c.function.arguments) for c in got_calls] == calls


def test_call_array_and_named_parsers():
    text = '[{"name":"get_time","parameters":{"zone":3}},{"name":"ping","parameters":{}}]'
    for i in range(len(text) + 1):
        _, content, calls, _ = streamed(CallArrayParser(), [text[:i], text[i:]])
        assert content is None and calls == [("get_time", '{"zone":3}'), ("ping", "{}")], i
    assert parse_whole(CallArrayParser(), "not an array") == ("not an array", [])
    _, content, calls, firsts = streamed(NamedCallParser("get_time"), ['{"zo', 'ne":', "3}"])
    assert content is None and calls == [("get_time", '{"zone":3}')] and firsts[0].function.arguments == ""


def test_required_schema_relocates_references():
    functions = [FunctionDefinition.model_validate(t["function"]) for t in (NO_ARGS, ORDER)]
    schema = required_calls_schema(functions)
    good = [
        {"name": "order", "parameters": {"item": {"sku": "a1", "qty": 2}, "gift": False}},
        {"name": "ping", "parameters": {}},
    ]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "order", "parameters": {"item": {"sku": "zz", "qty": 2}, "gift": False}}],
                [{"name": "ping", "parameters": {"x": 1}}], [{"name": "nope", "parameters": {}}]):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert required_calls_schema(functions, parallel=False)["maxItems"] == 1


# ---- on a server -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(demo_model):
    return demo_model("llama", "tiny")


def assert_valid_calls(calls, tools):
    schemas = {t["function"]["name"]: schema_of(t) for t in tools}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in schemas
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("tools", TOOL_SETS, ids=["weather-time", "order-refs", "three"])
def test_required_always_calls_a_declared_function(client, server, tools):
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 11, "n": 3}):  # greedy; 3 seeded samples
        resp = client.chat.completions.create(
            model=server.model, messages=MESSAGES, tools=tools, tool_choice="required", max_tokens=400, **kw
        )
        assert len(resp.choices) == kw.get("n", 1)
        for choice in resp.choices:
            assert choice.finish_reason == "tool_calls", kw
            assert choice.message.content is None
            assert_valid_calls(choice.message.tool_calls, tools)
    one = client.chat.completions.create(
        model=server.model, messages=MESSAGES, tools=tools, tool_choice="required", max_tokens=200,
        temperature=1.0, seed=2, parallel_tool_calls=False,
    )  # fmt: skip
    assert len(one.choices[0].message.tool_calls) == 1
    assert_valid_calls(one.choices[0].message.tool_calls, tools)


def test_named_function(client, server):
    for name, kw in (
        ("get_time", {"temperature": 0}),
        ("order", {"temperature": 1.0, "seed": 3}),
        ("ping", {}),
    ):
        tools = [WEATHER, TIME, ORDER, NO_ARGS]
        resp = client.chat.completions.create(
            model=server.model, messages=MESSAGES, tools=tools, max_tokens=200,
            tool_choice={"type": "function", "function": {"name": name}}, **kw,
        )  # fmt: skip
        choice = resp.choices[0]
        assert choice.finish_reason == "stop"  # as OpenAI answers a named tool_choice
        assert choice.message.content is None
        assert [c.function.name for c in choice.message.tool_calls] == [name]
        assert_valid_calls(choice.message.tool_calls, tools)


def test_none_and_auto_answer_with_text(client, server):
    for tool_choice in ("none", "auto"):
        resp = client.chat.completions.create(
            model=server.model,
            messages=MESSAGES,
            tools=[WEATHER],
            tool_choice=tool_choice,
            max_tokens=8,
            temperature=0,
        )
        choice = resp.choices[0]
        assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
        assert choice.finish_reason == "length"
    plain = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=8, temperature=0)
    raw = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": server.model, "messages": MESSAGES, "max_tokens": 2},
    )
    assert "tool_calls" not in raw.json()["choices"][0]["message"]  # left out, as OpenAI does
    assert plain.choices[0].message.tool_calls is None


HERMES_REGEX = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": [1-9]\}\}\n</tool_call>'


def test_auto_parses_a_generated_hermes_block(client, server):
    """A regex makes the random model write a Hermes block: tool_choice auto reads it back as a call,
    streamed or not."""
    kw = dict(model=server.model, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
              extra_body={"structured_outputs": {"regex": HERMES_REGEX}})  # fmt: skip
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in range(1, 10)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.content for d in deltas)  # no piece of the tags leaks into content
    pieces = [tc for d in deltas for tc in d.tool_calls or ()]
    first, rest = pieces[0], pieces[1:]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (
        0,
        "function",
        "get_time",
        "",
    )
    assert first.id.startswith("call_") and all(p.id is None and p.function.name is None for p in rest)
    assert "".join(p.function.arguments for p in rest) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_sdk_stream_helper_accumulates_required_calls(client, server):
    tools = [WEATHER, TIME]
    kw = dict(
        model=server.model,
        messages=MESSAGES,
        tools=tools,
        tool_choice="required",
        max_tokens=400,
        temperature=0,
    )
    stream_api = getattr(client.chat.completions, "stream", None) or client.beta.chat.completions.stream
    with stream_api(**kw) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    assert any(e.type == "tool_calls.function.arguments.done" for e in events)
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(message.tool_calls, tools)
    for call in message.tool_calls:  # strict tools: the SDK parsed the arguments
        assert call.function.parsed_arguments == json.loads(call.function.arguments)
    whole = client.chat.completions.create(**kw).choices[0].message
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls
    ]


def test_tool_history_is_rendered_with_the_tools(client, server, model_dir):
    messages = [
        {"role": "system", "content": "You help."},
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": 1}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "10:00"},
    ]  # fmt: skip
    resp = client.chat.completions.create(
        model=server.model, messages=messages, tools=[TIME], max_tokens=2, temperature=0
    )
    tokenizer = load_tokenizer(model_dir)
    text = tokenizer.apply_chat_template(
        [{k: v if v is not None else "" for k, v in m.items()} for m in messages],
        tools=[{"type": "function", "function": {k: v for k, v in TIME["function"].items() if k != "strict"}}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>' in text
    assert (
        "<tool_response>\n10:00\n</tool_response>" in text
        and '"name": "get_time"' in text.split("<tools>\n")[1]
    )
    assert resp.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    # /tokenize renders the same prompt (messages, calls, results and tools) as the chat it predicts.
    counted = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "tools": [TIME]})
    assert counted.status_code == 200, counted.text
    assert counted.json()["count"] == resp.usage.prompt_tokens


def post(server, body: dict) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/chat/completions", json={"model": server.model, "max_tokens": 4, **body}
    )


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not among the tools",
        ),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice needs tools"),
        ({"tools": [TIME, TIME]}, "more than once"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "object",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ["x"]}}]}, "parameters"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [TIME], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [TIME], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot be combined",
        ),
        (
            {"tools": [TIME], "tool_choice": "required", "structured_outputs": {"regex": "a"}},
            "cannot be combined",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "tool_calls"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]}, "function"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "x": float("nan")}},
                    }
                ]
            },
            "NaN",
        ),
    ],
)
def test_tool_errors_are_openai_shaped_400s(server, body, fragment):
    body = {"messages": MESSAGES, **body}
    if "nan" in json.dumps(body, allow_nan=True).lower():
        r = httpx.post(
            f"{server.url}/v1/chat/completions",
            content=json.dumps({"model": server.model, **body}, allow_nan=True),
            headers={"content-type": "application/json"},
        )
    else:
        r = post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and fragment in error["message"], error
