"""The grammar library behind structured outputs: llguidance (Microsoft's; one of vLLM's backends).

llguidance compiles a JSON schema, regex or Lark grammar lazily against the tokenizer's vocabulary and
computes each step's allowed-token bitmask in microseconds; we only translate our parameters into its
grammar text and hold its tokenizer. Nothing here knows about requests or batches.

Whitespace in JSON: llguidance's default lets a model put any run of whitespace between JSON tokens.
A model that starts padding then never stops (random weights always do, real ones sometimes), so by
default a run is bounded (``JSON_WHITESPACE_PATTERN``: enough to pretty-print several levels deep);
``disable_any_whitespace`` allows none at all.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

import llguidance
import llguidance.hf

from kvfleet_engine.structured_output.params import StructuredOutputsParams

JSON_WHITESPACE_PATTERN = r"[\x20\x0A\x0D\x09]{0,24}"
_JSON_OBJECT_SCHEMA = {"type": "object"}


# How errors name each kind of constraint (the request may have said response_format, tools, ...).
_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice",
               "grammar": "grammar"}  # fmt: skip


class GrammarError(ValueError):
    """The constraint does not compile (a bad schema, regex or grammar): the request's fault (400)."""


def grammar_source(params: StructuredOutputsParams) -> str:
    """llguidance's grammar text for ``params`` (not yet checked: see ``validate``)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = json.loads(params.json) if kind == "json" else _JSON_OBJECT_SCHEMA
        if params.disable_any_whitespace:
            options = {"whitespace_flexible": False}
        else:
            options = {"whitespace_pattern": JSON_WHITESPACE_PATTERN}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid: {e}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        # A Lark alternation of string literals: each choice matches exactly, nothing else does.
        alternatives = " | ".join(json.dumps(c) for c in params.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    return llguidance.LLMatcher.grammar_from_lark(params.grammar)


# Verdicts of ``validate`` by cache key: a request is checked where it is built (the server, before
# tokenizing) and again by the InputProcessor for each of its n sequences; a schema is parsed once.
_VERDICTS: dict[tuple[str, str, bool], str] = {}
_MAX_VERDICTS = 1024


def validate(params: StructuredOutputsParams) -> None:
    """Raise ``GrammarError`` unless ``params`` compiles. Needs no tokenizer: the API server calls it
    on every structured request, so a bad grammar is a 400 there and never reaches the engine core."""
    key = params.cache_key
    problem = _VERDICTS.get(key)
    if problem is None:
        problem = llguidance.LLMatcher.validate_grammar(grammar_source(params))
        if len(_VERDICTS) >= _MAX_VERDICTS:
            _VERDICTS.clear()
        _VERDICTS[key] = problem
    if problem:
        raise GrammarError(f"the {_KIND_NAMES[params.kind]} does not compile: {_first_lines(problem)}")


def _first_lines(message: str, limit: int = 400) -> str:
    message = message.strip()
    return message if len(message) <= limit else message[:limit] + "..."


class GrammarCompiler:
    """Turns parameters into fresh matchers over one model's vocabulary.

    ``vocab_size`` is the width of the model's logits (it can exceed the tokenizer's vocabulary: the
    extra ids are never allowed). Building llguidance's tokenizer takes a while for large vocabularies,
    so it is built on first use, in the compile thread."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)

    @functools.cached_property
    def tokenizer(self) -> llguidance.LLTokenizer:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(self.tokenizer_path)
        eos = self.eos_token_ids or hf.eos_token_id
        return llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A matcher at the start of the grammar. Raises ``GrammarError`` if it does not compile."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar_source(params), log_level=0)
        if matcher.is_error():
            raise GrammarError(
                f"the {_KIND_NAMES[params.kind]} does not compile: {_first_lines(matcher.get_error())}"
            )
        return matcher
