"""Validation primitives of the OpenAI request models (``openai_protocol``, ``openai_tools``).

Requests take OpenAI's types strictly (no lax coercions), ignore unknown fields, refuse NaN / Infinity, and
every string must be valid UTF-8: JSON's ``\\ud800`` escapes decode to lone surrogates, which no tokenizer or
encoder takes.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ConfigDict

SURROGATE = re.compile("[\ud800-\udfff]")
NOT_UTF8 = "must be valid UTF-8 text (it holds a lone surrogate, e.g. \\ud800)"


def utf8_text(value: Any) -> Any:
    """A field validator: the string, or each string of the list / of the content parts, is valid UTF-8
    (JSON's ``\\ud800`` escapes decode to lone surrogates, which no tokenizer or encoder takes)."""
    text = value
    if isinstance(value, list):  # joined in C: a million strings are not checked one by one
        try:
            text = "".join(value)
        except TypeError:  # content parts
            text = "".join(getattr(part, "text", "") for part in value)
    if isinstance(text, str) and not text.isascii() and SURROGATE.search(text):
        raise ValueError(NOT_UTF8)
    return value


# requests: OpenAI's types, not pydantic's lax coercions; unknown fields ignored
REQUEST_CONFIG = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def json_document(value: Any) -> Any:
    """A field validator for free-form JSON (schemas, function parameters): every string, key included, is
    valid UTF-8 and every number finite, as the typed fields are (the body's nesting is bounded before it
    is parsed, so the walk is shallow)."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
        elif isinstance(item, str):
            utf8_text(item)
        elif isinstance(item, float) and (item != item or item in (float("inf"), float("-inf"))):
            raise ValueError("must not hold NaN or Infinity")
    return value


JsonObject = dict[str, Any]
