"""The gateway's tokenizer: the engine's own files, fetched from Redis, so routing predictions are exact.

Engines publish their tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, the chat template)
under a content revision; heartbeats name the revision. The gateway loads each (model, revision) once
with transformers' fast tokenizer, the same class the engine uses, and turns a request into token ids
exactly as the engine's server does: completions encode the (first) prompt with special tokens; chat
renders the chat template to text (``kvfleet_common.chat_rendering``, the engine's own rendering: messages,
tools and the template's flags) and encodes it without adding special tokens again. So a chat's tools count
in its prompt tokens (routing and the tenant's tokens/min reservation), and a ``response_format`` schema
does not (the engine never puts it in the prompt). Each prompt is tokenized once per request.

On the request path (``bounded_prompt_token_ids``) the prompt's size is bounded first, against what the
model's context can hold (``kvfleet_common.server_kit.request_limits.TextBound``, measured once per tokenizer), and long
texts are tokenized in a worker thread: one tenant's huge prompt never holds the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kvfleet_common.chat_rendering import ChatTemplateError, render_chat_prompt
from kvfleet_common.openai_protocol import ChatCompletionRequest, CompletionRequest
from kvfleet_common.server_kit.gc_heap import freeze_long_lived
from kvfleet_common.server_kit.request_limits import TextBound, encode, encode_off_loop

logger = logging.getLogger(__name__)

Fetch = Callable[[str, str], Awaitable[dict[str, bytes] | None]]


def load_tokenizer_files(files: dict[str, bytes]) -> Any:
    """A transformers fast tokenizer built from published files (written to a private temp dir)."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="kvfleet-tok-") as d:
        for name, body in files.items():
            if "/" in name or name.startswith("."):
                raise ValueError(f"refusing tokenizer file name {name!r}")
            (Path(d) / name).write_bytes(body)
        return AutoTokenizer.from_pretrained(d, local_files_only=True)


def prompt_token_ids(tokenizer: Any, request: CompletionRequest | ChatCompletionRequest) -> list[int] | None:
    """The token ids the engine will see for the request's first prompt; None if the engine will reject
    it anyway (e.g. a chat template error: the engine answers the 400, the gateway just routes)."""
    if isinstance(request, CompletionRequest):
        prompt = request.prompts()[0]
        return (
            _encode(tokenizer, prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
        )
    text = _chat_text(tokenizer, request)
    return None if text is None else _encode(tokenizer, text, add_special_tokens=False)


class PromptTooLarge(Exception):
    """The prompt's text cannot fit the model's context, whatever it tokenizes to."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


async def bounded_prompt_token_ids(
    tokenizer: Any, bound: TextBound, request: CompletionRequest | ChatCompletionRequest, max_model_len: int
) -> list[int] | None:
    """``prompt_token_ids`` on the request path: every prompt's size is checked before anything is
    tokenized (raises ``PromptTooLarge``; a chat's texts, messages and tools, before the template is
    rendered too, as the engine checks them), and a long text is tokenized off the event loop."""
    if isinstance(request, CompletionRequest):
        prompts = request.prompts()
        for prompt in prompts:
            if isinstance(prompt, str):
                _check_size(bound, [prompt], max_model_len, "prompt")
        first = prompts[0]
        return await encode_off_loop(tokenizer, first, True) if isinstance(first, str) else list(first)
    _check_size(bound, request.template_texts(), max_model_len, "messages")
    text = _chat_text(tokenizer, request)
    if text is None:
        return None
    _check_size(bound, [text], max_model_len, "messages")
    return await encode_off_loop(tokenizer, text, False)


def _check_size(bound: TextBound, texts: list[str], max_model_len: int, param: str) -> None:
    problem = bound.problem(texts, max_model_len)
    if problem is not None:
        raise PromptTooLarge(problem, param)


def _chat_text(tokenizer: Any, request: ChatCompletionRequest) -> str | None:
    try:
        return render_chat_prompt(tokenizer, request)
    except ChatTemplateError:  # the engine answers the same 400 with its own message; routed without a prefix
        return None


_encode = encode  # request_limits.encode: the engine's ids, without the wrapper's Python


class TokenizerCache:
    """(model, revision) -> tokenizer, loaded once (concurrent first requests share one load)."""

    def __init__(self, fetch: Fetch) -> None:
        self._fetch = fetch
        self._loaded: dict[tuple[str, str], Any] = {}
        self._bounds: dict[tuple[str, str], TextBound] = {}
        self._loading: dict[tuple[str, str], asyncio.Task] = {}

    def cached(self, model: str, revision: str) -> Any | None:
        return self._loaded.get((model, revision))

    def bound(self, model: str, revision: str) -> TextBound:
        """The loaded tokenizer's ``TextBound`` (the generous default before it is loaded)."""
        return self._bounds.get((model, revision)) or TextBound()

    async def get(self, model: str, revision: str) -> Any | None:
        """The tokenizer, or None when the engine published none (routing then ignores prefixes)."""
        key = (model, revision)
        if not revision:
            return None
        tok = self._loaded.get(key)
        if tok is not None:
            return tok
        task = self._loading.get(key)
        if task is None:
            task = asyncio.create_task(self._load(model, revision))
            self._loading[key] = task
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():
                self._loading.pop(key, None)

    async def _load(self, model: str, revision: str) -> Any | None:
        files = await self._fetch(model, revision)
        if not files:
            logger.warning("tokenizer %s@%s is not in Redis: routing %s without prefix matching",
                           model, revision[:12], model)  # fmt: skip
            return None
        tok, bound = await asyncio.to_thread(_load_measured, files)
        self._bounds[(model, revision)] = bound
        self._loaded[(model, revision)] = tok
        freeze_long_lived(f"tokenizer of {model} loaded")  # transformers (and torch) were imported just now
        logger.info("loaded tokenizer of %s (revision %s)", model, revision[:12])
        return tok


def _load_measured(files: dict[str, bytes]) -> tuple[Any, TextBound]:
    tok = load_tokenizer_files(files)
    return tok, TextBound.of(tok)
