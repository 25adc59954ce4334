"""The gateway's tokenizer: the engine's own files, fetched from Redis, so routing predictions are exact.

Engines publish their tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, the chat template)
under a content revision; heartbeats name the revision. The gateway loads each (model, revision) once
with transformers' fast tokenizer, the same class the engine uses, and turns a request into token ids
exactly as the engine's server does: completions encode the (first) prompt with special tokens; chat
renders the chat template to text and encodes it without adding special tokens again.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kvfleet_common.gc_heap import freeze_long_lived
from kvfleet_common.openai_protocol import ChatCompletionRequest, CompletionRequest

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
    try:
        text = tokenizer.apply_chat_template(
            request.template_messages(), tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
        )  # fmt: skip
    except Exception:  # jinja errors: the engine reports them as a 400 with its own message
        return None
    return _encode(tokenizer, text, add_special_tokens=False)


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """``tokenizer.encode`` through the Rust ``tokenizers`` object when there is one: the same ids (the
    wrapper calls it with the same flag), without the wrapper's per-call Python (BatchEncoding, tensor
    conversion), which was ~8 % of the gateway's CPU per request."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return backend.encode(text, add_special_tokens=add_special_tokens).ids


class TokenizerCache:
    """(model, revision) -> tokenizer, loaded once (concurrent first requests share one load)."""

    def __init__(self, fetch: Fetch) -> None:
        self._fetch = fetch
        self._loaded: dict[tuple[str, str], Any] = {}
        self._loading: dict[tuple[str, str], asyncio.Task] = {}

    def cached(self, model: str, revision: str) -> Any | None:
        return self._loaded.get((model, revision))

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
        tok = await asyncio.to_thread(load_tokenizer_files, files)
        self._loaded[(model, revision)] = tok
        freeze_long_lived(f"tokenizer of {model} loaded")  # transformers (and torch) were imported just now
        logger.info("loaded tokenizer of %s (revision %s)", model, revision[:12])
        return tok
