"""What a request asks its output to conform to: vLLM's ``StructuredOutputsParams`` names.

Exactly one constraint is set. A JSON schema is kept as its canonical JSON text (sorted keys, no
spaces), so two requests with the same schema written differently share one compiled grammar, and
the object crosses the API server -> engine core boundary as plain strings (msgspec).

Validation here needs only the parameters; whether the grammar compiles is the backend's question
(``structured_output.backend.validate``), asked by the ``InputProcessor`` so that a bad grammar is a
400 before the request reaches the engine core.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# One request's grammar source may not exceed this (a schema is compiled once per distinct text,
# and a huge one would hold the compile thread for long).
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass
class StructuredOutputsParams:
    json: str | None = None  # a JSON schema (a dict is accepted and canonicalised)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # one of these strings, exactly
    grammar: str | None = None  # a Lark grammar (llguidance's dialect: `%json {...}` embeds a schema)
    # JSON without whitespace between tokens (as compact as json.dumps(separators=(",", ":"))).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            if not isinstance(self.json, dict | bool):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
            self.json = canonical_json(self.json)
        elif isinstance(self.json, str):
            try:  # canonicalise text too, so the cache key does not depend on formatting
                self.json = canonical_json(json.loads(self.json))
            except ValueError:
                raise ValueError("structured_outputs.json is not valid JSON") from None
        if self.choice is not None:
            self.choice = list(self.choice)
        self._verify()

    def _verify(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                f"got {', '.join(kinds) or 'none'}"
            )
        if self.choice is not None:
            if not self.choice or len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice must list 1 to {MAX_CHOICES} strings")
            if any(not isinstance(c, str) or c == "" for c in self.choice):
                raise ValueError("structured_outputs.choice entries must be non-empty strings")
        for name in ("json", "regex", "grammar"):
            text = getattr(self, name)
            if text is not None and (not isinstance(text, str) or not text):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
            if text is not None and len(text) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"structured_outputs.{name} is longer than {MAX_GRAMMAR_CHARS} characters")

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        raise AssertionError("validated in __post_init__")

    @property
    def cache_key(self) -> tuple[str, str, bool]:
        """Requests with equal keys compile to the same grammar."""
        kind = self.kind
        if kind == "choice":
            source = canonical_json(self.choice)
        elif kind == "json_object":
            source = ""
        else:
            source = getattr(self, kind)
        return kind, source, self.disable_any_whitespace
