"""Incremental detokenization with stop strings.

The engine turns each request's generated token ids into text as they stream out, and checks the
user's stop strings on that text. :class:`IncrementalDetokenizer` does that in O(new tokens) work per
step (it never re-decodes the whole output) while keeping these invariants:

* **Same text as a full decode.** When no stop string matched, ``output_text`` after the request
  finished is exactly ``tokenizer.decode(output_token_ids, skip_special_tokens=...)``: the text of
  the output *on its own*. The prompt does not change the text: a tokenizer whose decoder drops the
  leading space of the first token (SentencePiece ``▁``) drops it here too, and bytes that would
  complete a character the prompt left unfinished decode to U+FFFD, as in that full decode. (vLLM's
  streaming detokenizer decodes after a few prompt tokens instead, so with such tokenizers its text
  can start with a space that ``tokenizer.decode`` of the output drops; byte-level BPE tokenizers,
  GPT-2/Llama-3/Qwen style, give the same text either way on valid UTF-8.)
* **Never a partial character.** With byte-level BPE one character can be split over several
  tokens; its bytes decode to U+FFFD until the last one arrives. Text is only committed up to the
  last character that can no longer change, so no streamed delta ever holds a U+FFFD that a later
  token would turn into a real character. A trailing U+FFFD that never completes (the model emitted
  invalid UTF-8, or a real U+FFFD) is released when the request finishes. Byte-fallback tokenizers
  (``<0xHH>`` tokens, Llama-2/Mistral style) decode a run of byte tokens all or nothing, so there the
  text of a run is committed once a non-byte token closes it.
* **Stop strings** are searched only in the newly committed text plus ``longest stop - 1`` chars
  before it. The match that *ends* first in the text wins (ties: the longest string), so the result
  does not depend on how tokens were grouped into steps. The text is cut before the match, or after
  it with ``include_stop_str_in_output``.
* **Streaming hold-back.** While a request runs, :meth:`get_next_output_text` holds back the last
  ``longest stop - 1`` chars (when stop strings are to be cut from the output), so text that a later
  token may still turn into a stop string is never sent. Concatenating all deltas gives the final
  ``output_text``.

Decoding uses the prefix-offset / read-offset technique: the window ``ids[prefix_offset:]`` is
decoded each step, and the text past what was already committed of that window is new. The window
starts a few tokens back (at the previous read offset) so that decoders whose output for a token
depends on its neighbours (leading-space stripping, WordPiece ``##``) see the same context in both
decodes, and it only moves forward to token boundaries after which the text can no longer change.

**Byte-level shortcut.** A byte-level BPE decoder (GPT-2/Llama-3/Qwen style: ``decoders.ByteLevel``)
maps each token to bytes and decodes their concatenation as UTF-8 with replacement; when a token's own
bytes are complete UTF-8, the decode of any window ending in it is the decode of the window before it
followed by the token's own text. So when the window is in its settled state (its committed text is
exactly the decode of its ids, nothing held back) and one such token arrives, its cached text *is* the
new text and the window moves on by one token, exactly as the full decode would have moved it: the
usual decode step costs a dictionary lookup instead of a decode. Everything else takes the general
path above.

Notes: ``clean_up_tokenization_spaces`` is not applied (it rewrites text across token boundaries;
transformers ignores it for BPE tokenizers anyway and vLLM does not apply it when streaming).
``spaces_between_special_tokens`` only means something to slow (pure-Python) tokenizers; fast ones
ignore it, as in transformers.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from kvfleet_engine.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
# A window that has held back this many tokens without reaching a clean boundary (the model keeps
# emitting invalid UTF-8, or real U+FFFD characters) looks for a boundary inside the held tokens, so
# that the decoded window stays short. A real character needs at most 4 byte tokens.
_RESYNC_AFTER_TOKENS = 16
_RESYNC_CANDIDATES = 8

# Per-tokenizer facts shared by all requests: single-token texts for decode_token() (logprobs), the
# ids of special tokens (which skip_special_tokens drops), of <0xHH> byte-fallback tokens, each
# token's text decoded on its own with the detokenizer's options (one cache per option set), and
# whether the decoder is byte-level (the shortcut in the module docstring).
_tokenizer_info: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def _info(tokenizer: Any) -> dict[str, Any]:
    try:
        info = _tokenizer_info.get(tokenizer)
    except TypeError:  # not weak-referenceable: computed per detokenizer
        return _compute_info(tokenizer)
    if info is None:
        info = _tokenizer_info[tokenizer] = _compute_info(tokenizer)
    return info


def _compute_info(tokenizer: Any) -> dict[str, Any]:
    backend = _backend_of(tokenizer)
    if backend is not None and hasattr(backend, "get_added_tokens_decoder"):
        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
    else:
        special = set(getattr(tokenizer, "all_special_ids", ()))
    byte_ids: set[int] = set()
    if backend is not None and getattr(getattr(backend, "model", None), "byte_fallback", False):
        for b in range(256):
            tid = backend.token_to_id(f"<0x{b:02X}>")
            if tid is not None:
                byte_ids.add(tid)
    return {
        "token_texts": {},
        "special_ids": frozenset(special),
        "byte_ids": frozenset(byte_ids),
        "token_strs": {},  # (skip_special_tokens, spaces_between_special_tokens) -> {token id: text}
        "byte_level": _is_byte_level(backend),
    }


def _is_byte_level(backend: Any | None) -> bool:
    """The backend's decoder is exactly ``decoders.ByteLevel`` (not a sequence that includes it)."""
    if backend is None:
        return False
    try:
        from tokenizers.decoders import ByteLevel
    except ImportError:
        return False
    return isinstance(getattr(backend, "decoder", None), ByteLevel)


def _backend_of(tokenizer: Any) -> Any | None:
    """The Rust ``tokenizers.Tokenizer`` behind ``tokenizer`` (itself if it is one), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and type(tokenizer).__module__.startswith("tokenizers"):
        backend = tokenizer
    return backend


def _make_decode(tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool):
    """A ``decode(ids) -> str`` that gives what ``tokenizer.decode(ids, skip_special_tokens=...)``
    gives, through the Rust backend where there is one (no Python-side overhead per call)."""
    backend = _backend_of(tokenizer)
    if backend is not None:
        decode = backend.decode
        # Positional: a keyword argument costs the Rust binding a dict per call (this runs per token).
        return lambda ids: decode(ids, skip_special_tokens)
    # A slow (pure-Python) transformers tokenizer: the only kind that knows this option.
    return lambda ids: tokenizer.decode(
        ids,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
    )


class _TextBuffer:
    """An append-mostly string kept as parts, so that appending, reading or cutting the last few
    chars costs O(those chars), not O(whole text). ``value`` joins (and caches) the whole text."""

    __slots__ = ("_len", "_parts")

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, s: str) -> None:
        if s:
            self._parts.append(s)
            self._len += len(s)

    @property
    def value(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def slice_from(self, start: int, end: int | None = None) -> str:
        """``value[start:end]``, walking back from the end: cheap when ``start`` is near the end."""
        end = self._len if end is None else end
        if start >= end:
            return ""
        last = self._parts[-1]
        last_start = self._len - len(last)
        if start >= last_start:  # all in the last part: a streamed delta usually is
            return last[start - last_start : end - last_start]
        pieces: list[str] = []
        pos = self._len  # offset just past the part being looked at
        for part in reversed(self._parts):
            part_start = pos - len(part)
            if part_start < end:
                pieces.append(part[max(start - part_start, 0) : min(end, pos) - part_start])
            if part_start <= start:
                break
            pos = part_start
        pieces.reverse()
        return "".join(pieces)

    def truncate(self, length: int) -> None:
        """Cut the text to ``length`` chars, dropping parts from the end."""
        while self._len > length:
            last = self._parts.pop()
            self._len -= len(last)
            if self._len < length:
                keep = last[: length - self._len]
                self._parts.append(keep)
                self._len += len(keep)


class IncrementalDetokenizer:
    """Streams one sequence's output token ids into text, and checks its stop strings.

    ``tokenizer`` is a transformers ``PreTrainedTokenizerFast`` (its Rust backend does the decoding;
    a bare ``tokenizers.Tokenizer`` or a slow transformers tokenizer works too). ``prompt_token_ids``
    are kept for the caller; they do not change the text (see the module docstring for why).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids
        self.skip_special_tokens = params.skip_special_tokens
        self._decode: Callable[[list[int]], str] = _make_decode(
            tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens
        )
        info = _info(tokenizer)
        self._token_texts: dict[int, str] = info["token_texts"]
        # self._decode([id]), shared by the detokenizers with the same tokenizer and options.
        self._token_strs: dict[int, str] = info["token_strs"].setdefault(
            (params.skip_special_tokens, params.spaces_between_special_tokens), {}
        )
        self._byte_level: bool = info["byte_level"]
        # With skip_special_tokens the special ids are dropped before decoding (the decode is the
        # same): a skipped token must not be the one that starts the decode window, or a decoder
        # that treats the first token specially (drops its leading space) would pick the wrong one.
        self._dropped_ids: frozenset[int] = info["special_ids"] if params.skip_special_tokens else frozenset()
        self._byte_ids: frozenset[int] = info["byte_ids"]

        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        # The last ``longest stop - 1`` chars of the text checked so far: a match ending in new text
        # starts at most that far back (so the check never reads the text buffer).
        self._stop_tail = ""
        # Chars to hold back from streamed text: only needed when a match is cut out of the text.
        self._stop_buffer_len = (
            self._max_stop_len - 1 if self.stop and not self.include_stop_str_in_output else 0
        )

        self.output_token_ids: list[int] = []
        self.stop_reason: str | None = None  # the stop string that matched
        self.finished = False

        self._text = _TextBuffer()
        self._last_output_offset = 0  # chars already returned by get_next_output_text(delta=True)
        # Decode window: ids[_prefix_offset:] (all in self._decode_ids). The text of
        # ids[_prefix_offset:_read_offset] is all committed; _window_done is how many chars of the
        # window's decoded text are committed (may run past _read_offset's text: the complete
        # characters before a still-partial one).
        self._decode_ids: list[int] = []  # output ids whose text counts (without a stop-terminating id)
        self._prefix_offset = 0
        self._read_offset = 0
        self._window_done = 0
        # The window is settled: ids[_prefix_offset:_read_offset] decode to exactly _window_done chars
        # (all committed). With nothing after _read_offset, that is the byte-level shortcut's start.
        self._window_settled = False
        self._resync_after = _RESYNC_AFTER_TOKENS

    # ------------------------------------------------------------------ public API

    @property
    def output_text(self) -> str:
        """The output text so far: complete characters only, cut at a stop string once one matched."""
        return self._text.value

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append generated tokens and decode them. Returns the stop string that matched, else None.

        ``stop_terminated``: the last id ended the request (EOS or one of ``stop_token_ids``). It is
        recorded in ``output_token_ids`` but its text is left out (vLLM never shows the stop token's
        text, special or not), and the detokenizer finishes (see :meth:`flush`).

        After the detokenizer finished (stop string matched, or flushed) further tokens are ignored.

        Called for every running sequence every step (usually with one token): the common path
        makes at most one decode call (none with the byte-level shortcut) and copies nothing.
        """
        if self.finished:
            return None
        self.output_token_ids.extend(new_token_ids)
        if stop_terminated and new_token_ids:
            new_token_ids = new_token_ids[:-1]
        dropped = self._dropped_ids
        if dropped and not dropped.isdisjoint(new_token_ids):
            new_token_ids = [t for t in new_token_ids if t not in dropped]
        if new_token_ids:
            self._decode_ids.extend(new_token_ids)
            new_text = self._decode_new()
            if new_text:
                self._text.append(new_text)
                if self.stop and self._check_stop(new_text):
                    return self.stop_reason
        if stop_terminated:
            self.flush()
        return self.stop_reason

    def flush(self) -> str | None:
        """The request finished: commit any text still held back (a trailing U+FFFD that never got
        completed), check it for stop strings, and refuse further tokens. Idempotent. Returns the
        stop string that matched (here or before), else None."""
        if self.finished:
            return self.stop_reason
        self.finished = True
        if self._read_offset < len(self._decode_ids):
            text = self._decode(self._decode_ids[self._prefix_offset :])
            new_text = text[self._window_done :]
            self._text.append(new_text)
            self._window_done = len(text)
            self._check_stop(new_text)
        return self.stop_reason

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to send to the client.

        ``delta=True``: the text not returned by the previous delta call. ``delta=False``: all the
        text. While the request is not finished the last ``longest stop - 1`` chars are held back
        (when stop strings are cut from the output), so text that may still become a stop string is
        never sent. ``finished=True`` flushes the detokenizer (see :meth:`flush`) and returns
        everything.
        """
        if finished:
            self.flush()
        hold = 0 if (finished or self.stop_reason is not None) else self._stop_buffer_len
        end = max(len(self._text) - hold, 0)
        if not delta:
            text = self._text.value
            return text[:end] if end < len(text) else text
        start = self._last_output_offset
        if end <= start:
            return ""
        self._last_output_offset = end
        return self._text.slice_from(start, end)

    def decode_token(self, token_id: int) -> str:
        """One token's own text (special tokens included), e.g. a logprob's ``decoded_token``.
        Bytes of an unfinished character show as U+FFFD. Cached per tokenizer."""
        text = self._token_texts.get(token_id)
        if text is None:
            backend = _backend_of(self.tokenizer)
            decoder = backend if backend is not None else self.tokenizer
            text = decoder.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    # ------------------------------------------------------------------ internals

    def _token_str(self, token_id: int) -> str:
        """``self._decode([token_id])``, cached per tokenizer and decode options."""
        text = self._token_strs.get(token_id)
        if text is None:
            text = self._token_strs[token_id] = self._decode([token_id])
        return text

    def _decode_new(self) -> str:
        """Decode the window after new ids were appended; return the newly committed text."""
        ids = self._decode_ids
        if self._byte_ids:
            # Byte-fallback decoder: a run of <0xHH> tokens decodes all or nothing (valid UTF-8, or
            # one U+FFFD per byte), so its text is final only once a non-byte token closes it.
            if ids[-1] not in self._byte_ids:
                return self._advance(len(ids), self._decode(ids[self._prefix_offset :]))
            group_start = len(ids) - 1
            while group_start > self._read_offset and ids[group_start - 1] in self._byte_ids:
                group_start -= 1
            if group_start > self._read_offset:
                return self._advance(group_start, self._decode(ids[self._prefix_offset : group_start]))
            return ""
        if self._byte_level and self._window_settled and len(ids) == self._read_offset + 1:
            # The byte-level shortcut (module docstring): one new token, of complete characters.
            text = self._token_str(ids[-1])
            if text and _REPLACEMENT not in text:
                # What _advance(len(ids), <window text>) would do, without decoding the window.
                self._prefix_offset, self._window_done = self._read_offset, len(text)
                self._read_offset = len(ids)
                return text
        text = self._decode(ids[self._prefix_offset :])
        if not text.endswith(_REPLACEMENT):  # ends on a whole character: all final
            return self._advance(len(ids), text)
        stable = len(text.rstrip(_REPLACEMENT))
        # Trailing U+FFFD: maybe an unfinished character. Commit the complete characters before it
        # (once decoded, a character is final: the decode goes left to right).
        new = text[self._window_done : stable]
        self._window_done = max(self._window_done, stable)
        self._window_settled = False
        if len(ids) - self._read_offset > self._resync_after:
            new += self._resync(text)
        return new

    def _advance(self, k: int, head: str) -> str:
        """Token boundary ``k`` is final (``head``, the text of the window's ids before it, can no
        longer change): commit ``head`` and move the read offset to ``k``, and the window's start to
        the old read offset (the tokens since it are the context the next decodes start from).
        Returns the text committed."""
        ids, read, done = self._decode_ids, self._read_offset, self._window_done
        new = head[done:]
        overhang = done - len(head) if done > len(head) else 0  # committed chars past head
        # One token (the usual step): its text on its own is cached per tokenizer.
        context_len = len(self._token_str(ids[read]) if k == read + 1 else self._decode(ids[read:k]))
        if context_len:
            self._prefix_offset, self._window_done = read, context_len + overhang
        else:  # the ids since the last boundary have no text: no context to start a window with
            self._window_done = max(done, len(head))
        self._window_settled = context_len > 0 and overhang == 0
        self._read_offset = k
        self._resync_after = _RESYNC_AFTER_TOKENS
        return new

    def _resync(self, text: str) -> str:
        """Many tokens held without a clean boundary: find a token boundary ``k`` whose text is a
        strict prefix of the window's text. Its characters are then final (only the last character
        of a UTF-8 decode can still change), so the window may advance to it. Returns text
        committed."""
        ids = self._decode_ids
        lo = self._read_offset
        for k in range(len(ids) - 1, max(lo, len(ids) - 1 - _RESYNC_CANDIDATES), -1):
            head = self._decode(ids[self._prefix_offset : k])
            if len(head) < len(text) and text.startswith(head):
                return self._advance(k, head)
        self._resync_after *= 2  # none found (e.g. a run of real U+FFFD): back off
        return ""

    def _check_stop(self, new_text: str) -> bool:
        """Look for stop strings ending in ``new_text``, just appended to the text. The match ending
        first wins (ties: the longest). Cuts the text and finishes on a match."""
        if not self.stop or not new_text:
            return False
        tail = self._stop_tail
        window = tail + new_text  # the text from search_start on
        search_start = len(self._text) - len(window)
        keep = self._max_stop_len - 1
        self._stop_tail = window[-keep:] if keep else ""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for s in self.stop:
            # The first occurrence that ends in the new text (one ending earlier would have been
            # found by an earlier call).
            idx = window.find(s, max(len(tail) - len(s) + 1, 0))
            if idx >= 0:
                key = (idx + len(s), -len(s), s)
                if best is None or key[:2] < best[:2]:
                    best = key
        if best is None:
            return False
        end, neg_len, s = best
        cut = search_start + end + (0 if self.include_stop_str_in_output else neg_len)
        self._text.truncate(cut)
        self.stop_reason = s
        self.finished = True
        return True
