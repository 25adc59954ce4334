"""Tool calls out of generated text, as it streams: OpenAI's ``delta.tool_calls`` and ``message.tool_calls``.

Three shapes of output, by ``tool_choice`` (``chat_structure.py`` picks the parser and the constraint):

- ``auto``: Hermes' format, what the chat template asks for: free text with ``<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>`` blocks. ``HermesToolParser``.
- ``required``: a JSON array ``[{"name": ..., "parameters": {...}}, ...]`` (enforced by a schema).
  ``CallArrayParser``.
- a named function: the whole output is that function's arguments object (enforced by its schema).
  ``NamedCallParser``.

Every parser is fed the text as it is generated (``feed``) and then told the end (``finish``); each returns
the ``DeltaMessage`` pieces to send: content outside the calls, a call's first piece (``index``, ``id``,
``type``, ``function.name``, ``arguments`` ""), then pieces of its arguments' text. A whole response is the
same parser fed once (``parse_whole``), so streamed and non-streamed answers agree. Decisions wait for the
end of a ``feed``: a call that begins and ends inside one piece of text is checked whole (``json.loads``)
before anything of it is sent, and a call whose text is invalid is left as content. A call still open at
the end of a piece is sent as far as it goes once its name is complete and its arguments began (that is
streaming); should its text turn out invalid later, what was sent stands and the rest of it is dropped.

Whitespace touching a Hermes block belongs to the block (the template joins blocks with newlines), so a
response made only of calls has null content. Text that could be the start of ``<tool_call>`` is held
back until it is known not to be one: a tag never leaks into content in pieces.
"""

from __future__ import annotations

import json
import secrets
from typing import Protocol

from kvfleet_common.openai_protocol import DeltaMessage
from kvfleet_common.openai_tools import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from kvfleet_engine.server.json_scanner import JsonObjectScanner

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
NO_ARGUMENTS = "{}"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolCallParser(Protocol):
    calls: int  # how many calls were sent so far

    def feed(self, text: str) -> list[DeltaMessage]: ...

    def finish(self) -> list[DeltaMessage]: ...


class _Pieces:
    """The deltas of one ``feed``: adjacent content, and adjacent argument pieces of one call, merged."""

    def __init__(self) -> None:
        self.items: list[DeltaMessage] = []

    def content(self, text: str) -> None:
        if not text:
            return
        last = self.items[-1] if self.items else None
        if last is not None and last.content is not None:
            last.content += text
        else:
            self.items.append(DeltaMessage(content=text))

    def call_start(self, index: int, name: str) -> None:
        function = DeltaFunctionCall(name=name, arguments="")
        call = DeltaToolCall(index=index, id=new_call_id(), type="function", function=function)
        self.items.append(DeltaMessage(tool_calls=[call]))

    def arguments(self, index: int, text: str) -> None:
        if not text:
            return
        last = self.items[-1] if self.items else None
        if (
            last is not None
            and last.tool_calls
            and last.tool_calls[0].index == index
            and last.tool_calls[0].id is None
        ):
            last.tool_calls[0].function.arguments += text
        else:
            self.items.append(
                DeltaMessage(
                    tool_calls=[DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=text))]
                )
            )


class _CallObject:
    """One call's JSON object (``{"name": ..., <arguments_key>: {...}}``) being scanned, and what of it
    was sent."""

    def __init__(self, index: int, arguments_key: str) -> None:
        self.index = index
        self.arguments_key = arguments_key
        self.scanner = JsonObjectScanner()
        self.started = False  # its first piece was sent
        self.sent = 0  # characters of its arguments sent

    def can_start(self) -> bool:
        """Its name is complete and its arguments object began (``{`` read)."""
        args = self.scanner.value_text(self.arguments_key)
        return self.scanner.string_value("name") is not None and args is not None and args.startswith("{")

    def is_valid_whole(self) -> bool:
        """The finished object is JSON with a string name and object arguments (or none)."""
        if not self.scanner.done:
            return False
        try:
            call = json.loads(self.scanner.text)
        except ValueError:
            return False
        args = call.get(self.arguments_key, {})
        return isinstance(call.get("name"), str) and isinstance(args, dict)

    def send(self, out: _Pieces) -> None:
        """Send what is known: the first piece, then the arguments' text not yet sent."""
        if not self.started:
            out.call_start(self.index, self.scanner.string_value("name") or "")
            self.started = True
        args = self.scanner.value_text(self.arguments_key)
        if args is None and self.scanner.done:
            args = NO_ARGUMENTS
        if args is not None and len(args) > self.sent:
            out.arguments(self.index, args[self.sent :])
            self.sent = len(args)


class HermesToolParser:
    """``tool_choice: "auto"``: content with ``<tool_call>`` blocks."""

    def __init__(self) -> None:
        self.calls = 0
        self._pending = ""  # text not yet handled: a possible tag start, or a block's text after its scan
        self._held_space = ""  # trailing whitespace of the content: sent once more content follows
        self._strip_leading = False  # right after a block: its trailing whitespace is the block's
        self._call: _CallObject | None = None  # the open block's call
        self._block_text = ""  # the open block's text after the open tag (left as content if invalid)
        self._space_before_block = ""  # whitespace between content and the open block

    def feed(self, text: str) -> list[DeltaMessage]:
        out = _Pieces()
        self._pending += text
        self._advance(out)
        call = self._call
        if call is not None and (call.started or (not call.scanner.failed and call.can_start())):
            call.send(out)  # an open call streams: its text so far is all the text there is
        return out.items

    def finish(self) -> list[DeltaMessage]:
        out = _Pieces()
        call = self._call
        if call is not None:  # a block never closed: a whole call stands, else its text is content
            if call.started or (call.is_valid_whole() and not self._pending.strip()):
                self._end_call(out)
            else:
                self._invalid_block(out, self._pending, closed=False)
            self._pending = ""
        self._content(out, self._pending, before_block=False)
        self._pending = ""
        out.content(self._held_space)
        self._held_space = ""
        return out.items

    def _advance(self, out: _Pieces) -> None:
        while self._pending:
            if self._call is None:
                at = self._pending.find(OPEN_TAG)
                if at < 0:
                    keep = _partial_tag_length(self._pending, OPEN_TAG)
                    self._content(out, self._pending[: len(self._pending) - keep], before_block=False)
                    self._pending = self._pending[len(self._pending) - keep :]
                    return
                self._content(out, self._pending[:at], before_block=True)
                self._pending = self._pending[at + len(OPEN_TAG) :]
                self._call = _CallObject(self.calls, "arguments")
                self._block_text = ""
                continue
            scanner = self._call.scanner
            if not (scanner.done or scanner.failed):
                used = scanner.feed(self._pending)
                self._block_text += self._pending[:used]
                self._pending = self._pending[used:]
                continue
            at = self._pending.find(CLOSE_TAG)
            if at < 0:
                return  # wait for the close tag
            between = self._pending[:at]
            self._pending = self._pending[at + len(CLOSE_TAG) :]
            if self._call.started or (self._call.is_valid_whole() and not between.strip()):
                self._end_call(out)
                self._strip_leading = True
            else:
                self._invalid_block(out, between, closed=True)

    def _end_call(self, out: _Pieces) -> None:
        assert self._call is not None
        self._call.send(out)
        self.calls += 1
        self._call = None
        self._space_before_block = ""

    def _invalid_block(self, out: _Pieces, rest: str, closed: bool) -> None:
        text = OPEN_TAG + self._block_text + rest + (CLOSE_TAG if closed else "")
        self._call = None
        self._held_space += self._space_before_block
        self._space_before_block = ""
        self._content(out, text, before_block=False)

    def _content(self, out: _Pieces, text: str, before_block: bool) -> None:
        if self._strip_leading:
            text = text.lstrip()
            self._strip_leading = not text
        body = text.rstrip()
        if body:
            out.content(self._held_space + body)
            self._held_space = ""
        space = self._held_space + text[len(body) :]
        if before_block:
            self._space_before_block, self._held_space = space, ""
        else:
            self._held_space = space


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (0: none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class CallArrayParser:
    """``tool_choice: "required"``: ``[{"name": ..., "parameters": {...}}, ...]``. Until a call was sent, text
    that is not such an array is content (it happens only where the schema was not enforced)."""

    def __init__(self) -> None:
        self.calls = 0
        self._text = ""  # everything fed
        self._pos = 0  # how much of it was scanned
        self._state = "start"  # start, element, in_element, after_element, done, failed
        self._call: _CallObject | None = None
        self._content_sent = 0

    def feed(self, text: str) -> list[DeltaMessage]:
        out = _Pieces()
        self._text += text
        self._advance(out)
        call = self._call
        if call is not None and (call.started or (not call.scanner.failed and call.can_start())):
            call.send(out)
        self._content_if_failed(out)
        return out.items

    def finish(self) -> list[DeltaMessage]:
        out = _Pieces()
        if self._state != "done" and self.calls == 0 and not (self._call is not None and self._call.started):
            self._state = "failed"  # the text stopped before its first call was complete
        self._content_if_failed(out)
        return out.items

    def _advance(self, out: _Pieces) -> None:
        while self._pos < len(self._text) and self._state not in ("done", "failed"):
            if self._state == "in_element":
                assert self._call is not None
                used = self._call.scanner.feed(self._text[self._pos :])
                self._pos += used
                if not self._call.scanner.done:
                    if self._call.scanner.failed:
                        self._state = "failed"
                elif self._call.started or self._call.is_valid_whole():
                    self._call.send(out)
                    self.calls += 1
                    self._call = None
                    self._state = "after_element"
                else:
                    self._state = "failed"
                continue
            char = self._text[self._pos]
            if char in " \t\n\r":
                self._pos += 1
            elif self._state == "start":
                self._state = "element" if char == "[" else "failed"
                self._pos += 1
            elif self._state == "element" and char == "{":
                self._call = _CallObject(self.calls, "parameters")
                self._state = "in_element"
            elif char == "]" and (
                self._state == "after_element" or (self._state == "element" and not self.calls)
            ):
                self._state = "done"
                self._pos += 1
            elif self._state == "after_element" and char == ",":
                self._state = "element"
                self._pos += 1
            else:
                self._state = "failed"

    def _content_if_failed(self, out: _Pieces) -> None:
        if self._state == "failed" and self.calls == 0 and (self._call is None or not self._call.started):
            out.content(self._text[self._content_sent :])
            self._content_sent = len(self._text)


class NamedCallParser:
    """A named function: the whole output is its arguments object."""

    def __init__(self, name: str) -> None:
        self.calls = 0
        self._name = name

    def feed(self, text: str) -> list[DeltaMessage]:
        out = _Pieces()
        if not self.calls:
            out.call_start(0, self._name)
            self.calls = 1
        out.arguments(0, text)
        return out.items

    def finish(self) -> list[DeltaMessage]:
        return self.feed("") if not self.calls else []


def parse_whole(parser: ToolCallParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole generation's content (None when empty) and calls: the parser's deltas accumulated."""
    content: list[str] = []
    calls: dict[int, ToolCall] = {}
    for delta in parser.feed(text) + parser.finish():
        if delta.content:
            content.append(delta.content)
        for piece in delta.tool_calls or ():
            call = calls.get(piece.index)
            if call is None:
                function = FunctionCall(
                    name=piece.function.name or "", arguments=piece.function.arguments or ""
                )
                calls[piece.index] = ToolCall(id=piece.id or new_call_id(), function=function)
            else:
                call.function.arguments += piece.function.arguments or ""
    return ("".join(content) or None), [calls[i] for i in sorted(calls)]
