"""What a request's output must be: ``tool_choice``, ``response_format`` and ``structured_outputs`` turned
into the engine's ``StructuredOutputsParams`` and the tool-call parser that reads the answer back.

- ``tool_choice`` a named function: the output is that function's arguments, constrained by its
  ``parameters`` schema; the response holds one call of it. ``finish_reason`` stays the engine's ("stop"),
  as OpenAI answers a named tool_choice.
- ``"required"``: the output is a JSON array of one or more ``{"name": <a declared function>, "parameters":
  <its arguments>}`` (one at most with ``parallel_tool_calls: false``), constrained by a schema built from
  the tools; the response holds those calls and ``finish_reason`` "tool_calls".
- ``"auto"`` (the default with tools): free text, read by the Hermes parser; "tool_calls" when it found a
  call. ``response_format`` / ``structured_outputs`` constrain the text if given (then the model cannot
  write a ``<tool_call>`` block, and none is found).
- ``"none"``: no parsing (the tools are still rendered into the prompt, as vLLM does).

Tool calls are generated without whitespace between JSON tokens (``disable_any_whitespace``): arguments
come out compact, as OpenAI's do, and a model cannot pad them. A call truncated by ``max_tokens`` keeps
"length". Request shapes that conflict are refused by the protocol models (``openai_protocol.py``); the
schemas' compilation is checked by the ``InputProcessor`` (``structured_output.backend.validate``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

from kvfleet_common.openai_protocol import ChatCompletionRequest, CompletionRequest
from kvfleet_common.openai_tools import FunctionDefinition, NamedToolChoice
from kvfleet_common.server_kit.http import ApiError
from kvfleet_engine.server.tool_parser import (
    CallArrayParser,
    HermesToolParser,
    NamedCallParser,
    ToolCallParser,
)
from kvfleet_engine.structured_output.params import StructuredOutputsParams

# OpenAI: "omitting parameters defines a function with an empty parameter list"
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
# Keywords whose values are data, not schemas: a "$ref" inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})

ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ChatOutputPlan:
    constraint: StructuredOutputsParams | None
    tool_mode: ToolMode
    function_name: str | None = None  # the named function

    def new_parser(self) -> ToolCallParser | None:
        """A parser for one choice's text (None: the text is the content as it is)."""
        if self.tool_mode == "auto":
            return HermesToolParser()
        if self.tool_mode == "required":
            return CallArrayParser()
        if self.tool_mode == "named":
            assert self.function_name is not None
            return NamedCallParser(self.function_name)
        return None

    def finish_reason(self, parser: ToolCallParser | None, engine_reason: str | None) -> str | None:
        if parser is not None and parser.calls and engine_reason == "stop" and self.tool_mode != "named":
            return "tool_calls"
        return engine_reason


def output_constraint(req: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The constraint of ``response_format`` or ``structured_outputs`` (None: free text)."""
    kwargs = req.structured_outputs_kwargs()
    if kwargs is None:
        return None
    param = "structured_outputs" if req.structured_outputs is not None else "response_format"
    return _params(kwargs, param)


def plan_chat_output(req: ChatCompletionRequest) -> ChatOutputPlan:
    choice = req.effective_tool_choice
    functions = [tool.function for tool in req.tools or ()]
    if isinstance(choice, NamedToolChoice):
        function = next(f for f in functions if f.name == choice.function.name)  # checked by the protocol
        schema = function.parameters if function.parameters is not None else NO_PARAMETERS
        return ChatOutputPlan(_tool_params(schema), "named", function.name)
    if choice == "required":
        return ChatOutputPlan(
            _tool_params(required_calls_schema(functions, req.parallel_tool_calls)), "required"
        )
    return ChatOutputPlan(output_constraint(req), "auto" if choice == "auto" else "none")


def required_calls_schema(functions: list[FunctionDefinition], parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: "required"``'s answer: an array of calls, each of a declared
    function with arguments valid for it. Each function's schema is embedded whole; its local ``$ref``s
    are rewritten to point at where it now lies."""
    variants = []
    for i, function in enumerate(functions):
        schema = function.parameters if function.parameters is not None else NO_PARAMETERS
        variants.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": function.name},
                    "parameters": _relocated(schema, f"/items/anyOf/{i}/properties/parameters"),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _relocated(schema: dict[str, Any], pointer: str) -> dict[str, Any]:
    """A copy of ``schema`` whose local references (``#...``) resolve the same once it sits at ``pointer``
    inside another document (``#/$defs/X`` becomes ``#<pointer>/$defs/X``)."""
    moved = copy.deepcopy(schema)
    todo: list[Any] = [moved]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                node["$ref"] = "#" + pointer + ref[1:]
            todo.extend(value for key, value in node.items() if key not in _DATA_KEYWORDS)
    return moved


def _tool_params(schema: dict[str, Any]) -> StructuredOutputsParams:
    return _params({"json": schema, "disable_any_whitespace": True}, "tools")


def _params(kwargs: dict[str, Any], param: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise ApiError(400, f"{param}: {e}", param=param, code="invalid_request") from None
