"""OpenAI-compatible request/response models, shared by the engine server and the gateway.

Requests are validated here (ranges, types, what we do not support) so both servers reject bad
input with the same OpenAI-style 400, before it reaches an engine. Beyond OpenAI's fields the
requests take vLLM's common extras (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ...) and kvfleet's ``priority`` and ``cache_salt`` (set by the
gateway per tenant). Unknown fields are ignored, as OpenAI's SDKs send new ones over time.

Types are strict, as OpenAI's are: ``"stream": "yes"`` or ``1``, ``"max_tokens": "16"`` or ``16.0`` and a
prompt of booleans are 400s, not coerced. Every integer is bounded (int64; token ids int32, as the block
hashes pack them), every string must be valid UTF-8 (no lone surrogates, which JSON's ``\\ud800`` escapes
can smuggle in) and NaN / Infinity are refused: what passes can be forwarded, serialized and hashed.

The shapes of structured outputs and tool calling (``response_format``, ``structured_outputs``, ``tools``,
``tool_choice``, ``tool_calls`` and their deltas) live in ``openai_tools``; the validation primitives both
modules use in ``openai_fields``.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from kvfleet_common.openai_fields import NOT_UTF8 as _NOT_UTF8
from kvfleet_common.openai_fields import REQUEST_CONFIG as _REQUEST_CONFIG
from kvfleet_common.openai_fields import SURROGATE as _SURROGATE
from kvfleet_common.openai_fields import utf8_text as _utf8
from kvfleet_common.openai_tools import (
    MAX_TOOLS,
    DeltaToolCall,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputsRequest,
    ToolCall,
    ToolChoiceRules,
    ToolDefinition,
    with_legacy_guided_fields_renamed,
    without_none,
)

MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TOKEN_ID = 2**31 - 1  # block hashes pack token ids as int32 (kvfleet_common.hashing)
MAX_PRIORITY = 2**31 - 1  # the gateway adds the tenant's priority: far from int64's edge


Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
# a list's validation stops at its first error: a million bad items must not make a million errors
TokenIds = Annotated[list[TokenId], Field(fail_fast=True)]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# HTTP status -> OpenAI's error "type".
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


class StreamOptions(BaseModel):
    model_config = _REQUEST_CONFIG

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(BaseModel):
    """Fields common to completions and chat completions."""

    model_config = _REQUEST_CONFIG

    model: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: Int64 | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS, fail_fast=True)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # vLLM-style extras
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # top-n per prompt token
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # kvfleet: scheduling priority (lower runs first) and prefix-cache isolation salt
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    cache_salt: str | None = Field(None, max_length=256)
    # what the output must conform to: OpenAI's response_format or vLLM's structured_outputs, not both
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    _texts = field_validator("model", "stop", "user", "cache_salt")(_utf8)

    @model_validator(mode="before")
    @classmethod
    def _legacy_guided_fields(cls, data: Any) -> Any:
        return with_legacy_guided_fields_renamed(data)

    @model_validator(mode="after")
    def _one_output_constraint(self) -> _SamplingRequest:
        if self.structured_outputs is not None and self.response_format_constrains:
            raise ValueError(
                "response_format and structured_outputs cannot both constrain the output: send one of them"
            )
        return self

    @property
    def response_format_constrains(self) -> bool:
        return self.response_format is not None and self.response_format.type != "text"

    def structured_outputs_kwargs(self) -> dict[str, Any] | None:
        """Keyword arguments for the engine's ``StructuredOutputsParams`` from ``structured_outputs`` or
        ``response_format``; None when the output is free text."""
        if self.structured_outputs is not None:
            return self.structured_outputs.params_kwargs()
        if not self.response_format_constrains:
            return None
        if self.response_format.type == "json_object":
            return {"json_object": True}
        return {"json": self.response_format.json_schema.json_schema}

    @model_validator(mode="after")
    def _common_checks(self) -> _SamplingRequest:
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10) or int(key) > MAX_TOKEN_ID:
                shown = key if len(key) <= 32 else key[:32] + "..."
                raise ValueError(f"logit_bias keys must be token ids (integers as strings), got {shown!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {key}")
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not available when stream is true")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def sampling_kwargs(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        """Keyword arguments for the engine's SamplingParams."""
        return {
            "n": self.n,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": 0 if self.top_k in (None, -1) else self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "prompt_logprobs": self.prompt_logprobs,
            "logit_bias": {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
        }

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _prompt_shape(value: Any) -> str:
    """Which of the prompt's shapes to validate, by its first item: one, not four (a union tries each,
    and a million token ids tried as strings made a million errors first)."""
    if isinstance(value, str):
        return "text"
    first = value[0] if isinstance(value, list) and value else None
    return "texts" if isinstance(first, str) else "token_lists" if isinstance(first, list) else "tokens"


PromptInput = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[str], Tag("texts"), Field(fail_fast=True)]
    | Annotated[TokenIds, Tag("tokens")]
    | Annotated[list[TokenIds], Tag("token_lists"), Field(fail_fast=True)],
    Discriminator(_prompt_shape),
]
_PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


def _prompt_problem(value: Any) -> str:
    """What is wrong with a prompt that matched none of ``PromptInput``'s shapes (pydantic would report a
    failure per shape, the first of them about strings)."""
    if isinstance(value, str):  # pydantic refuses some lone surrogates itself ("not a unicode string")
        return _NOT_UTF8
    if isinstance(value, list):
        for item in (t for x in value for t in (x if isinstance(x, list) else [x])):
            if isinstance(item, str) and not item.isascii() and _SURROGATE.search(item):
                return _NOT_UTF8
            if isinstance(item, bool):
                return "token ids must be integers, not booleans"
            if isinstance(item, int) and not 0 <= item <= MAX_TOKEN_ID:
                shown = str(item) if abs(item) < 10**30 else f"{str(item)[:12]}... ({len(str(item))} digits)"
                return f"token id {shown} is outside [0, {MAX_TOKEN_ID}]"
    return f"must be {_PROMPT_SHAPES}"


class CompletionRequest(_SamplingRequest):
    prompt: PromptInput
    max_tokens: int | None = Field(16, ge=1, le=INT64_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _check_prompt(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            prompt = handler(value)
        except ValidationError:
            raise ValueError(_prompt_problem(value)) from None
        return _utf8(prompt) if _prompt_shape(prompt) in ("text", "texts") else prompt

    _suffix_text = field_validator("suffix")(_utf8)

    @model_validator(mode="after")
    def _completion_checks(self) -> CompletionRequest:
        p = self.prompt
        if p == "" or p == [] or (isinstance(p, list) and any(x == "" or x == [] for x in p)):
            raise ValueError("prompt must not be empty")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (use n)")
        return self

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list: strings, or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextContentPart(BaseModel):
    model_config = _REQUEST_CONFIG

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _REQUEST_CONFIG

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextContentPart], Field(fail_fast=True)] | None = None
    name: str | None = None
    # an assistant message's calls (its content may then be null)
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS, fail_fast=True)] | None = None
    tool_call_id: str | None = Field(None, max_length=256)  # tool: the call this message answers

    _texts = field_validator("content", "name", "tool_call_id")(_utf8)

    @model_validator(mode="after")
    def _tool_fields_by_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only tool messages carry a tool_call_id")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template reads it: role and text, plus the tool fields when set."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatPrompt(BaseModel):
    """What a chat prompt is rendered from: the messages, the tools and the template switches. Chat
    completions and ``/tokenize`` share it, so both render (and the gateway predicts) the same prompt."""

    model_config = _REQUEST_CONFIG

    messages: Annotated[list[ChatMessage], Field(min_length=1, fail_fast=True)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS, fail_fast=True)] | None = None

    @model_validator(mode="after")
    def _prompt_checks(self) -> ChatPrompt:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template renders them (None without tools). They are rendered for every
        tool_choice, "none" too (as vLLM does): the prompt of a conversation does not change with it."""
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True, exclude={"function": {"strict"}}) for tool in self.tools]

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages]

    def chat_template_kwargs(self) -> dict[str, Any]:
        """What ``apply_chat_template`` takes besides the messages: the engine and the gateway render
        ``apply_chat_template(template_messages(), tokenize=False, **chat_template_kwargs())``."""
        kwargs: dict[str, Any] = {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }
        tools = self.template_tools()
        if tools:  # absent, not None, without tools: the template's output stays what it was
            kwargs["tools"] = tools
        return kwargs

    def template_texts(self) -> list[str]:
        """Every text the template will render (messages, their calls, the tools): bounded before rendering."""
        texts = [m.text() for m in self.messages]
        for call in (call for m in self.messages for call in m.tool_calls or ()):
            texts += [call.function.name, call.function.arguments]
        tools = self.template_tools()
        if tools:
            texts.append(json.dumps(tools, ensure_ascii=False))
        return texts


class ChatCompletionRequest(ToolChoiceRules, _SamplingRequest, ChatPrompt):
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # None: "auto" when there are tools, else "none"
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # false: tool_choice "required" makes exactly one call

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        self.check_tools()
        return self

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- responses ---------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class PromptLogprob(BaseModel):
    """vLLM's prompt-logprob entry: one per token id (a JSON key) at a prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's ``prompt_logprobs``: per prompt token, None for the first, then token id -> its entry.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra, when the request set prompt_logprobs


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None  # left out when None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler) -> dict[str, Any]:
        return without_none(handler, self, ("tool_calls",))


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra, when the request set prompt_logprobs


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None  # left out when None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler) -> dict[str, Any]:
        return without_none(handler, self, ("tool_calls",))


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvfleet"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(BaseModel):
    model_config = _REQUEST_CONFIG

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True

    _texts = field_validator("model", "prompt")(_utf8)


class TokenizeChatRequest(ChatPrompt):
    model: str | None = None

    _texts = field_validator("model")(_utf8)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = _REQUEST_CONFIG

    model: str | None = None
    tokens: TokenIds

    _texts = field_validator("model")(_utf8)


class DetokenizeResponse(BaseModel):
    prompt: str
