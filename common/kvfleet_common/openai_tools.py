"""OpenAI's structured outputs and tool calling, the request and stream shapes: ``response_format``, vLLM's
``structured_outputs``, ``tools`` / ``tool_choice``, a message's ``tool_calls`` and their stream deltas.

Validation that needs only the request is here (one constraint at a time, function names, object schemas);
the engine checks that a schema compiles (``kvfleet_engine.structured_output``). Free-form JSON (schemas,
function parameters) is checked as the typed fields are: UTF-8 strings, finite numbers.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_serializer, model_validator

from kvfleet_common.openai_fields import REQUEST_CONFIG, JsonObject, json_document, utf8_text


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema the answer must follow (``strict`` is accepted; the
    schema is always enforced)."""

    model_config = REQUEST_CONFIG

    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    json_schema: JsonObject = Field(alias="schema")
    strict: bool | None = None

    _texts = field_validator("name", "description")(utf8_text)
    _schema = field_validator("json_schema")(json_document)


class ResponseFormat(BaseModel):
    """``{"type": "text"}`` (the default), ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {...}}``."""

    model_config = REQUEST_CONFIG

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs a json_schema object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"response_format of type {self.type!r} takes no json_schema")
        return self


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs`` extra: exactly one of ``json`` (a schema), ``json_object``, ``regex``,
    ``choice``, ``grammar`` (Lark, llguidance's dialect); the engine checks that it compiles."""

    model_config = REQUEST_CONFIG

    json_schema: JsonObject | str | None = Field(None, alias="json")  # a schema (or its JSON text)
    json_object: bool | None = None
    regex: str | None = None
    choice: Annotated[list[str], Field(max_length=1024, fail_fast=True)] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    _texts = field_validator("regex", "choice", "grammar")(utf8_text)
    _schema = field_validator("json_schema")(json_document)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsRequest:
        values = {
            "json": self.json_schema, "json_object": self.json_object or None, "regex": self.regex,
            "choice": self.choice, "grammar": self.grammar,
        }  # fmt: skip
        given = [name for name, value in values.items() if value is not None]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                f"got {', '.join(given) or 'none'}"
            )
        return self

    def params_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the engine's ``StructuredOutputsParams``."""
        return {
            "json": self.json_schema, "json_object": bool(self.json_object), "regex": self.regex,
            "choice": self.choice, "grammar": self.grammar, "disable_any_whitespace": self.disable_any_whitespace,
        }  # fmt: skip


# vLLM's older request fields for output constraints -> their structured_outputs names.
_LEGACY_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def with_legacy_guided_fields_renamed(data: Any) -> Any:
    """A raw request with vLLM's older names (``guided_json``, ``guided_regex``, ``guided_choice``,
    ``guided_grammar``) read as ``structured_outputs``: clients written for vLLM still send them, and
    ignoring them would answer free text to a request that asked for a schema (worse than a 400)."""
    if not isinstance(data, dict):
        return data
    given = {key: data[key] for key in _LEGACY_GUIDED if data.get(key) is not None}
    if not given:
        return data
    if len(given) > 1 or data.get("structured_outputs") is not None:
        raise ValueError(
            f"give one output constraint: {', '.join(sorted(given))} and structured_outputs exclude each other"
        )
    ((key, value),) = given.items()
    renamed = {k: v for k, v in data.items() if k not in _LEGACY_GUIDED}
    renamed["structured_outputs"] = {_LEGACY_GUIDED[key]: value}
    return renamed


MAX_TOOLS = 128  # OpenAI's limit on a request's functions
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionDefinition(BaseModel):
    model_config = REQUEST_CONFIG

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: JsonObject | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: bool | None = None  # accepted; the arguments are enforced when tool_choice is required or named

    _texts = field_validator("description")(utf8_text)
    _schema = field_validator("parameters")(json_document)

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: JsonObject | None) -> JsonObject | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("a function's parameters must be a JSON schema of an object (type 'object')")
        return value


class ToolDefinition(BaseModel):
    model_config = REQUEST_CONFIG

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = REQUEST_CONFIG

    name: str = Field(min_length=1, max_length=64)

    _texts = field_validator("name")(utf8_text)


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: the answer is a call of that function."""

    model_config = REQUEST_CONFIG

    type: Literal["function"]
    function: NamedFunction


class FunctionCall(BaseModel):
    """A call's function, in an assistant message of the history and in a response."""

    model_config = REQUEST_CONFIG

    name: str
    arguments: str  # the arguments object as JSON text

    _texts = field_validator("name", "arguments")(utf8_text)


class ToolCall(BaseModel):
    model_config = REQUEST_CONFIG

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall

    _texts = field_validator("id")(utf8_text)


class ToolChoiceRules:
    """``ChatCompletionRequest``'s rules about its ``tools``, ``tool_choice``, ``response_format`` and
    ``structured_outputs`` fields (a mixin: the fields are the request's)."""

    def check_tools(self) -> None:
        """Raise ``ValueError`` for a tool_choice the tools cannot satisfy or a conflicting constraint."""
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            dup = next(name for name in names if names.count(name) > 1)
            raise ValueError(f"tools: the function name {dup!r} is declared more than once")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not names:
            raise ValueError("tool_choice needs tools: declare the functions the model may call")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, not among the tools")
        if self.forces_tool_call and (self.response_format_constrains or self.structured_outputs is not None):
            raise ValueError(
                "tool_choice 'required' or a named function already constrains the output: it cannot be "
                "combined with response_format or structured_outputs"
            )

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """The tool choice, None resolved as OpenAI does: "auto" with tools, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def forces_tool_call(self) -> bool:
        return self.effective_tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)


# ---- responses: tool calls ---------------------------------------------------------------------------


def without_none(handler, value: BaseModel, keys: tuple[str, ...]) -> dict[str, Any]:
    """``value`` serialised, less those of ``keys`` whose value is None: OpenAI leaves them out, and the
    openai SDK's stream accumulator takes a null ``type`` or ``id`` for a new value."""
    data = handler(value)
    for key in keys:
        if data.get(key) is None:
            data.pop(key, None)
    return data


class DeltaFunctionCall(BaseModel):
    name: str | None = None  # in a call's first delta
    arguments: str | None = None  # the next piece of the arguments' JSON text

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler) -> dict[str, Any]:
        return without_none(handler, self, ("name", "arguments"))


class DeltaToolCall(BaseModel):
    """A piece of the ``index``-th call of a choice: the first carries ``id``, ``type`` and the name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler) -> dict[str, Any]:
        return without_none(handler, self, ("id", "type"))
