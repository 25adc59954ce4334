"""Structured outputs through the offline API: every constrained response is complete and conforms.

The demo model has random weights, so nothing but the grammar makes its output JSON: a response that
parses and validates is the grammar's doing. Each response must also end with finish_reason "stop" (the
grammar completed); the schemas of ``structured_schemas`` bound every instance, and ``max_tokens`` is sized
above the longest instance they allow (with the engine's bounded JSON whitespace), so a "length" finish
would be a failure of the engine, not of the budget.

Conformance is checked independently of the grammar library: ``json.loads`` + ``jsonschema`` (draft
2020-12, numbers as ``Decimal`` so ``multipleOf: 0.01`` is exact), ``re.fullmatch`` for regexes, and a
hand-written regular expression equal to the (bounded) Lark grammar.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from kvfleet_engine import LLM, SamplingParams
from kvfleet_engine.structured_output.params import StructuredOutputsParams
from tests.engine.structured_schemas import MAX_TOKENS, SCHEMAS, corpus_failures, prompt_for
from tests.engine.structured_schemas import validate_instance as validate_json

# With the engine's default JSON whitespace (runs of up to 24 characters between tokens) a random model
# pads every gap, which multiplies an instance's length: the longest corpus instance then stays under
# this (measured: ~900 tokens for the deepest schema under uniform random sampling of allowed tokens).
MAX_TOKENS_WITH_WHITESPACE = 1500


@pytest.fixture(scope="module")
def llm(demo_model, test_device):
    engine = LLM(
        demo_model(arch="llama"), device=test_device, dtype="float32", use_tqdm=False, max_model_len=2048
    )
    yield engine
    engine.shutdown()


def _no_leaks(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    pool = llm.engine.scheduler.kv.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    assert not llm.output_processor.requests


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _json_params(schema: dict[str, Any], **kw: Any) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema, **kw)


def _assert_corpus_outputs(outputs, names: list[str], n: int) -> None:
    assert all(len(out.outputs) == n for out in outputs)
    failures = corpus_failures(outputs, names)
    assert not failures, "\n".join(failures)


def test_corpus_is_large_and_valid():
    assert len(SCHEMAS) >= 30
    for schema in SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)


def test_corpus_greedy_compact(llm):
    names = list(SCHEMAS)
    prompts = [prompt_for(i, name) for i, name in enumerate(names)]
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=MAX_TOKENS,
            structured_outputs=_json_params(SCHEMAS[name], disable_any_whitespace=True),
        )
        for name in names
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    _assert_corpus_outputs(outputs, names, n=1)
    for out in outputs:  # disable_any_whitespace: nothing between JSON tokens
        text = out.outputs[0].text
        assert not re.search(r"\s", _JSON_STRING.sub('""', text)), text
    # Greedy is reproducible with a grammar too: the same batch again gives the same tokens.
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs]
    _no_leaks(llm)


def test_corpus_sampled_n2(llm):
    """Seeded sampling, two completions per request, with the engine's default (bounded) JSON whitespace."""
    names = list(SCHEMAS)
    prompts = [prompt_for(i + 1, name) for i, name in enumerate(names)]
    params = [
        SamplingParams(
            n=2,
            temperature=1.0,
            top_p=0.95,
            seed=100 + i,
            max_tokens=MAX_TOKENS_WITH_WHITESPACE,
            structured_outputs=_json_params(SCHEMAS[name]),
        )
        for i, name in enumerate(names)
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    _assert_corpus_outputs(outputs, names, n=2)
    # Sampling is really sampling: the two completions of a request differ for most schemas.
    differ = sum(o.outputs[0].text != o.outputs[1].text for o in outputs)
    assert differ >= len(names) // 2
    _no_leaks(llm)


def test_constrained_and_free_requests_share_a_batch(llm):
    """A grammar's mask applies to its own row only: a free request in the same batch samples exactly as
    it does alone, and a constrained one still conforms."""
    free = SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    alone = llm.generate("Free text about rivers", free, use_tqdm=False)[0].outputs[0]
    schema = SCHEMAS["invoice"]
    constrained = SamplingParams(
        temperature=0.8,
        seed=6,
        max_tokens=MAX_TOKENS,
        structured_outputs=_json_params(schema, disable_any_whitespace=True),
    )
    mixed = llm.generate(
        ["Invoice please", "Free text about rivers", "Another invoice"],
        [constrained, free, constrained],
        use_tqdm=False,
    )
    assert mixed[1].outputs[0].token_ids == alone.token_ids
    assert len(alone.token_ids) == 24 and alone.finish_reason == "length"
    for out in (mixed[0], mixed[2]):
        assert out.outputs[0].finish_reason == "stop"
        validate_json(out.outputs[0].text, schema)
    _no_leaks(llm)


REGEXES = [
    r"\(\d{3}\) \d{3}-\d{4}",
    r"[a-z]{1,10}@[a-z]{2,8}\.(com|org|net)",
    r"20\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    r"(GET|POST|PUT|DELETE) /[a-z0-9/]{0,20}",
    r"#[0-9a-fA-F]{6}",
    r"-?(0|[1-9]\d{0,5})\.\d{2}",
]


def test_regex_outputs_fullmatch(llm):
    params = [
        SamplingParams(
            temperature=t, seed=i, max_tokens=64, structured_outputs=StructuredOutputsParams(regex=rx)
        )
        for i, rx in enumerate(REGEXES)
        for t in (0.0, 1.0)
    ]
    prompts = [f"Answer {i}:" for i in range(len(params))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for sp, out in zip(params, outputs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (sp.structured_outputs.regex, completion.text)
        assert re.fullmatch(sp.structured_outputs.regex, completion.text), (
            sp.structured_outputs.regex,
            completion.text,
        )
    _no_leaks(llm)


def test_choice_outputs_are_one_of_the_choices(llm):
    # "yes" is a prefix of "yes, please": after "yes" the grammar may end or go on, both must be exact.
    choices = ["positive", "negative", "neutral", "yes", "yes, please", "I am not sure"]
    params = SamplingParams(
        n=4,
        temperature=1.5,
        seed=11,
        max_tokens=16,
        structured_outputs=StructuredOutputsParams(choice=choices),
    )
    outputs = llm.generate([f"Classify item {i}:" for i in range(8)], params, use_tqdm=False)
    seen = set()
    for out in outputs:
        for completion in out.outputs:
            assert completion.finish_reason == "stop"
            assert completion.text in choices, completion.text
            seen.add(completion.text)
    assert len(seen) >= 2  # the sampler chose among them, it did not collapse onto one
    _no_leaks(llm)


# A bounded Lark grammar (llguidance's dialect: ``{m,n}`` repetition) and the same language written as a
# regular expression by hand, to check outputs without the grammar library.
SQL_GRAMMAR = r"""
start: "SELECT " columns " FROM " table where? ";"
columns: "*" | column (", " column){0,2}
column: "id" | "name" | "price" | "stock"
table: "products" | "orders"
where: " WHERE " column " " op " " value
op: "=" | "<" | ">" | "<=" | ">="
value: /[0-9]{1,4}/ | "'" /[a-z]{1,8}/ "'"
"""
_COLUMN = r"(id|name|price|stock)"
SQL_REGEX = (
    rf"SELECT (\*|{_COLUMN}(, {_COLUMN}){{0,2}}) FROM (products|orders)"
    rf"( WHERE {_COLUMN} (=|<|>|<=|>=) ([0-9]{{1,4}}|'[a-z]{{1,8}}'))?;"
)


def test_lark_grammar_outputs_parse(llm):
    params = SamplingParams(
        n=3,
        temperature=1.0,
        seed=3,
        max_tokens=80,
        structured_outputs=StructuredOutputsParams(grammar=SQL_GRAMMAR),
    )
    greedy = SamplingParams(
        temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(grammar=SQL_GRAMMAR)
    )
    outputs = llm.generate(
        ["Query 1:", "Query 2:", "Query 3:", "Query 4:"], [params, params, params, greedy], use_tqdm=False
    )
    texts = [c for o in outputs for c in o.outputs]
    assert len(texts) == 10
    for completion in texts:
        assert completion.finish_reason == "stop", completion.text
        assert re.fullmatch(SQL_REGEX, completion.text), completion.text
    _no_leaks(llm)


def test_json_object_outputs_are_objects(llm):
    """``json_object`` admits any object: keys and strings of any length, which a random model need not
    ever close. A strong bias towards ``"`` and ``}`` (added to the logits before the grammar's mask) makes
    it close strings and objects soon; what is allowed is still the grammar's alone."""
    tokenizer = llm.get_tokenizer()
    closers = {tokenizer.encode(c)[0]: 20.0 for c in ('"', "}")}
    assert len(closers) == 2
    params = SamplingParams(
        n=2,
        temperature=1.0,
        seed=21,
        max_tokens=MAX_TOKENS,
        logit_bias=closers,
        structured_outputs=StructuredOutputsParams(json_object=True),
    )
    outputs = llm.generate([f"Give me an object {i}:" for i in range(6)], params, use_tqdm=False)
    objects = []
    for out in outputs:
        for completion in out.outputs:
            assert completion.finish_reason == "stop", completion.text[:200]
            objects.append(json.loads(completion.text))
    assert all(isinstance(o, dict) for o in objects), objects
    assert any(objects), "every object was empty: the bias, not the grammar, decided the outputs"
    _no_leaks(llm)


BAD_CONSTRAINTS = {
    "unsatisfiable-bounds": {"json": {"type": "integer", "minimum": 5, "maximum": 1}},
    "dangling-ref": {"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}},
    "unknown-type": {"json": {"type": "strin"}},
    "bad-pattern": {"json": {"type": "string", "pattern": "([a-z]"}},
    "bad-regex": {"regex": "([a-z]+"},
    "undefined-rule": {"grammar": 'start: greeting name\ngreeting: "hi "'},
    "bad-terminal-regex": {"grammar": "start: /(/"},
}


@pytest.mark.parametrize("fields", list(BAD_CONSTRAINTS.values()), ids=list(BAD_CONSTRAINTS))
def test_constraint_that_does_not_compile_is_a_value_error(llm, fields):
    good = SamplingParams(
        temperature=0,
        max_tokens=MAX_TOKENS,
        structured_outputs=_json_params(SCHEMAS["person"], disable_any_whitespace=True),
    )
    bad = SamplingParams(max_tokens=16, structured_outputs=StructuredOutputsParams(**fields))
    with pytest.raises(ValueError):
        llm.generate(["fine", "broken"], [good, bad], use_tqdm=False)
    _no_leaks(llm)  # the batch's good request was withdrawn with it
    [out] = llm.generate("still serving", good, use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop"
    validate_json(out.outputs[0].text, SCHEMAS["person"])
    _no_leaks(llm)


@pytest.mark.parametrize(
    "fields",
    [{}, {"json": {"type": "object"}, "regex": "a"}, {"choice": []}, {"choice": ["a", ""]}, {"regex": ""}],
    ids=["none", "two-kinds", "no-choices", "empty-choice", "empty-regex"],
)
def test_malformed_parameters_are_value_errors(fields):
    with pytest.raises(ValueError):
        StructuredOutputsParams(**fields)
