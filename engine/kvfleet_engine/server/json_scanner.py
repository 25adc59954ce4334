"""Follow the text of one JSON object as it arrives, recording where its top-level members' values lie.

A tool call is generated a token at a time, and its arguments are streamed to the client while they are
still being written: that needs to know, at every point of a partial text, whether the call's ``name`` is
complete and where its ``arguments`` began. The scanner is structural only (strings with their escapes,
nesting, member boundaries); it does not check the tokens inside a value, nor that brackets pair up by
kind: ``json.loads`` judges a finished object. Each character is looked at once, so following a whole
generation costs its length, not its length squared.
"""

from __future__ import annotations

import json

_WHITESPACE = frozenset(" \t\n\r")
_SCALAR_CHARS = frozenset("-+.0123456789eEtruefalsn")  # numbers, true, false, null

# states
_START = 0  # before the opening brace
_KEY_OR_CLOSE = 1  # after "{": a key or "}"
_KEY_NEXT = 2  # after ",": a key
_KEY = 3  # inside a key string
_COLON = 4
_VALUE_START = 5
_NESTED = 6  # inside an object or array value
_STRING = 7  # inside a string value
_SCALAR = 8  # inside a number, true, false or null
_AFTER_VALUE = 9  # "," or "}"
_DONE = 10
_FAILED = 11


class JsonObjectScanner:
    """Scans one JSON object fed in pieces (leading whitespace allowed).

    Invariants: ``text`` is exactly the characters consumed (it ends at the closing brace once ``done``);
    ``members[key]`` is ``[start, end]`` of the key's value in ``text``, ``end`` None while the value is
    still open; a duplicate key's later value wins, as in ``json.loads``."""

    def __init__(self) -> None:
        self.text = ""
        self.members: dict[str, list[int | None]] = {}
        self._state = _START
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._key_start = 0
        self._key = ""

    @property
    def done(self) -> bool:
        return self._state == _DONE

    @property
    def failed(self) -> bool:
        return self._state == _FAILED

    def feed(self, chunk: str) -> int:
        """Scan ``chunk``; return how many of its characters were consumed: all of them unless the object
        closed (the closing brace is consumed) or turned out not to be JSON (the offending character is not)
        inside it. Once done or failed, nothing more is consumed."""
        if self._state in (_DONE, _FAILED):
            return 0
        base = len(self.text)
        consumed = len(chunk)
        for i, char in enumerate(chunk):
            self._step(char, base + i, chunk, base)
            if self._state == _DONE:
                consumed = i + 1
                break
            if self._state == _FAILED:
                consumed = i
                break
        self.text += chunk[:consumed]
        return consumed

    def _step(self, char: str, pos: int, chunk: str, base: int) -> None:
        state = self._state
        if state == _NESTED:
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.members[self._key][1] = pos + 1
                    self._state = _AFTER_VALUE
        elif state in (_KEY, _STRING):
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                if state == _STRING:
                    self.members[self._key][1] = pos + 1
                    self._state = _AFTER_VALUE
                else:
                    raw = (self.text + chunk[: pos - base + 1])[self._key_start :]
                    try:
                        self._key = json.loads(raw)
                        self._state = _COLON
                    except ValueError:  # an invalid escape
                        self._state = _FAILED
            elif char < " ":  # JSON strings hold no raw control characters
                self._state = _FAILED
        elif state == _SCALAR:
            if char in _SCALAR_CHARS:
                return
            self.members[self._key][1] = pos
            self._state = _AFTER_VALUE
            self._step(char, pos, chunk, base)  # the character after a scalar is "," "}" or whitespace
        elif char in _WHITESPACE:
            return
        elif state == _START:
            self._state = _KEY_OR_CLOSE if char == "{" else _FAILED
        elif state in (_KEY_OR_CLOSE, _KEY_NEXT):
            if char == '"':
                self._key_start = pos
                self._state = _KEY
            elif char == "}" and state == _KEY_OR_CLOSE:
                self._state = _DONE
            else:
                self._state = _FAILED
        elif state == _COLON:
            self._state = _VALUE_START if char == ":" else _FAILED
        elif state == _VALUE_START:
            self.members[self._key] = [pos, None]
            if char in "{[":
                self._depth = 1
                self._state = _NESTED
            elif char == '"':
                self._state = _STRING
            elif char in _SCALAR_CHARS:
                self._state = _SCALAR
            else:
                self._state = _FAILED
        elif state == _AFTER_VALUE:
            self._state = _KEY_NEXT if char == "," else _DONE if char == "}" else _FAILED

    def value_text(self, key: str) -> str | None:
        """The text of ``key``'s value so far (all of it once closed); None before it began."""
        span = self.members.get(key)
        if span is None:
            return None
        start, end = span
        return self.text[start:end] if end is not None else self.text[start:]

    def value_closed(self, key: str) -> bool:
        span = self.members.get(key)
        return span is not None and span[1] is not None

    def string_value(self, key: str) -> str | None:
        """``key``'s value once it is a complete JSON string, decoded; else None."""
        if not self.value_closed(key):
            return None
        try:
            value = json.loads(self.value_text(key))
        except ValueError:
            return None
        return value if isinstance(value, str) else None
