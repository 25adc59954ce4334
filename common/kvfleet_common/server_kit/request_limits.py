"""What one request may make a server do, bounded at the edge (the gateway and the engine server alike).

A server's event loop serves every tenant, so no request may hold it for long, and no client-chosen string
may grow what the server keeps or writes:

- JSON nesting is bounded (``MAX_JSON_DEPTH``) before the body is parsed: deeper bodies are a 400, never a
  ``RecursionError`` (``json_too_deep``; FastAPI routes: ``BoundedJsonRoute``).
- A prompt's size is bounded before it is tokenized: a text longer than the model's context could hold even
  if every token were the vocabulary's longest (``TextBound``, times ``SAFETY_FACTOR``) is a 400 at once, in
  characters and in UTF-8 bytes. A 10 MB prompt against a 512-token context is refused in microseconds
  instead of tokenized for a minute.
- What is tokenized anyway, when large (``LARGE_TEXT_CHARS``), is tokenized in a worker thread, with the
  ``tokenizers`` call that releases the GIL (``encode_off_loop``).
- ``max_tokens`` / ``min_tokens`` must fit the context with the prompt (``context_problem``): a 400, as
  OpenAI's, rather than a silent cap.
- Names a client chose (an unknown model) are clipped before they are echoed or logged (``clip``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import Request, Response
from fastapi.routing import APIRoute

from kvfleet_common.server_kit.http import ApiError

MAX_JSON_DEPTH = 32  # an OpenAI request nests 5 levels (messages -> content parts)
SAFETY_FACTOR = 4  # room for normalizers that shrink text before tokenizing (NFC composes up to 3 -> 1)
LARGE_TEXT_CHARS = 8192  # ~3 ms of tokenizing: longer texts go to a worker thread
SHOWN_NAME_CHARS = 64  # of a client's name, in an error message or a log line
# when a tokenizer has no readable vocabulary: generous bounds on one token's text
FALLBACK_CHARS_PER_TOKEN = 64
FALLBACK_BYTES_PER_TOKEN = 256

# ---- JSON depth ----------------------------------------------------------------------------------------

_DROP_BUT_STRUCTURE = bytes(sorted(set(range(256)) - set(b'[]{}"')))
_DEPTH_CHUNK = 1 << 20


def json_too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text nests arrays/objects deeper than ``limit``; linear, in C and numpy (no
    parsing, so nothing recurses). Brackets inside strings do not count. Garbage in: any answer (the
    parser rejects it next)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:  # every request of ordinary shape stops here
        return False
    # strings out: escaped backslashes, then escaped quotes, then every "..." (the odd pieces of a split)
    structure = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _DROP_BUT_STRUCTURE)
    brackets = b"".join(structure.split(b'"')[::2])
    depth = 0
    for start in range(0, len(brackets), _DEPTH_CHUNK):  # in chunks: a few MB of temporaries at most
        a = np.frombuffer(brackets, np.uint8, min(_DEPTH_CHUNK, len(brackets) - start), start)
        running = np.cumsum(((a == 0x5B) | (a == 0x7B)).astype(np.int32) * 2 - 1) + depth
        if int(running.max()) > limit:
            return True
        depth = int(running[-1])
    return False


def json_too_deep_error() -> ApiError:
    return ApiError(
        400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels", code="invalid_request"
    )


class BoundedJsonRoute(APIRoute):
    """A FastAPI route whose JSON body is checked for depth (``json_too_deep``) before FastAPI parses it.
    Install with ``app.router.route_class = BoundedJsonRoute`` before declaring the routes."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def bounded(request: Request) -> Response:
            if json_too_deep(await request.body()):  # the body is kept: FastAPI reads it again
                return json_too_deep_error().response()
            return await handler(request)

        return bounded


# ---- prompt size and tokenization ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TextBound:
    """The most text one token of a tokenizer stands for: its vocabulary's longest entry, in characters and
    in UTF-8 bytes of the entry as stored. Both are upper bounds on the decoded text of any token: a
    byte-level BPE entry holds one character per byte, a SentencePiece entry its characters (``▁`` for a
    space, 3 bytes for 1; byte-fallback ``<0xNN>``, 6 for 1)."""

    chars_per_token: int = FALLBACK_CHARS_PER_TOKEN
    bytes_per_token: int = FALLBACK_BYTES_PER_TOKEN

    @classmethod
    def of(cls, tokenizer: Any) -> TextBound:
        """Measured once per tokenizer (a pass over its vocabulary: ~30 ms for 150k entries)."""
        try:
            vocab = tokenizer.get_vocab()
        except Exception:  # not a transformers tokenizer: the generous fallback
            return cls()
        if not vocab:
            return cls()
        chars = max(map(len, vocab))
        return cls(chars, max(len(t.encode("utf-8", "surrogatepass")) for t in vocab))

    def limits(self, max_model_len: int) -> tuple[int, int]:
        """(characters, bytes): more text than this cannot fit ``max_model_len`` tokens."""
        return (
            max_model_len * self.chars_per_token * SAFETY_FACTOR,
            max_model_len * self.bytes_per_token * SAFETY_FACTOR,
        )

    def problem(self, texts: Sequence[str], max_model_len: int) -> str | None:
        """Why ``texts`` (one prompt, or the parts of one) cannot fit the context; None if they may."""
        max_chars, max_bytes = self.limits(max_model_len)
        chars = sum(map(len, texts))
        if chars > max_chars:
            return (
                f"the prompt is {chars} characters long: more than the maximum context length of "
                f"{max_model_len} tokens can hold (at most {max_chars} characters)"
            )
        if chars * 4 <= max_bytes:  # UTF-8 takes at most 4 bytes a character: no need to count
            return None
        size = sum(len(t) if t.isascii() else len(t.encode("utf-8", "surrogatepass")) for t in texts)
        if size > max_bytes:
            return (
                f"the prompt is {size} bytes long (UTF-8): more than the maximum context length of "
                f"{max_model_len} tokens can hold (at most {max_bytes} bytes)"
            )
        return None


def encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """``tokenizer.encode`` through the Rust ``tokenizers`` object when there is one: the same ids (the
    wrapper calls it with the same flag), without the wrapper's per-call Python (BatchEncoding, tensor
    conversion), which was ~8 % of the gateway's CPU per request. Holds the GIL: for short texts only."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return backend.encode(text, add_special_tokens=add_special_tokens).ids


def _encode_without_gil(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    # encode_batch releases the GIL while it works (encode does not): the event loop runs meanwhile
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


async def encode_off_loop(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """``encode``; in a worker thread, without the GIL, when the text is long (``LARGE_TEXT_CHARS``)."""
    if len(text) <= LARGE_TEXT_CHARS:
        return encode(tokenizer, text, add_special_tokens)
    return await asyncio.to_thread(_encode_without_gil, tokenizer, text, add_special_tokens)


def context_problem(
    prompt_tokens: int, max_tokens: int | None, min_tokens: int, max_model_len: int
) -> tuple[str, str] | None:
    """(message, param) when the prompt and the tokens asked for cannot fit the context; None if they fit.
    ``max_tokens`` None: whatever room is left."""
    n = prompt_tokens
    if n >= max_model_len:
        return (
            f"the prompt is {n} tokens long, but the maximum context length is {max_model_len} tokens "
            "(prompt plus at least one generated token)",
            "prompt",
        )
    if max_tokens is not None and n + max_tokens > max_model_len:
        return (
            f"the maximum context length is {max_model_len} tokens, but {n + max_tokens} were requested "
            f"({n} in the prompt, {max_tokens} for the completion): lower max_tokens or shorten the prompt",
            "max_tokens",
        )
    if n + min_tokens > max_model_len:
        return (
            f"the maximum context length is {max_model_len} tokens, but min_tokens asks for {min_tokens} "
            f"after the prompt's {n}",
            "min_tokens",
        )
    return None


def clip(name: str, limit: int = SHOWN_NAME_CHARS) -> str:
    """A client's name as it may be echoed or logged: quoted, at most ``limit`` characters of it."""
    if len(name) <= limit:
        return repr(name)
    return f"{name[:limit]!r}... ({len(name)} characters)"
