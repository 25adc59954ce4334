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
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TOKEN_ID = 2**31 - 1  # block hashes pack token ids as int32 (kvfleet_common.hashing)
MAX_PRIORITY = 2**31 - 1  # the gateway adds the tenant's priority: far from int64's edge


_SURROGATE = re.compile("[\ud800-\udfff]")
_NOT_UTF8 = "must be valid UTF-8 text (it holds a lone surrogate, e.g. \\ud800)"


def _utf8(value: Any) -> Any:
    """A field validator: the string, or each string of the list / of the content parts, is valid UTF-8
    (JSON's ``\\ud800`` escapes decode to lone surrogates, which no tokenizer or encoder takes)."""
    text = value
    if isinstance(value, list):  # joined in C: a million strings are not checked one by one
        try:
            text = "".join(value)
        except TypeError:  # content parts
            text = "".join(getattr(part, "text", "") for part in value)
    if isinstance(text, str) and not text.isascii() and _SURROGATE.search(text):
        raise ValueError(_NOT_UTF8)
    return value


Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
# a list's validation stops at its first error: a million bad items must not make a million errors
TokenIds = Annotated[list[TokenId], Field(fail_fast=True)]
# requests: OpenAI's types, not pydantic's lax coercions; unknown fields ignored
_REQUEST_CONFIG = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


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
    logit_bias: dict[str, float] | None = None
    # vLLM-style extras
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

    _texts = field_validator("model", "stop", "user", "cache_salt")(_utf8)

    @model_validator(mode="after")
    def _common_checks(self) -> _SamplingRequest:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
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
        if self.echo and self.logprobs is not None:
            raise ValueError(
                "echo together with logprobs is not supported (prompt logprobs are not computed)"
            )
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

    _texts = field_validator("content", "name")(_utf8)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(BaseModel):
    """Only ``{"type": "text"}`` is supported; nothing else of it is kept (or forwarded)."""

    model_config = _REQUEST_CONFIG

    type: str = "text"

    _texts = field_validator("type")(_utf8)


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1, fail_fast=True)]
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Any] | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tools:
            raise ValueError("tools are not supported")
        if self.response_format and self.response_format.type != "text":
            raise ValueError("only response_format type 'text' is supported")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


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


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


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


class TokenizeChatRequest(BaseModel):
    model_config = _REQUEST_CONFIG

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, fail_fast=True)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False

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
