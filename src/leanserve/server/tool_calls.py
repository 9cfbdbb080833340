"""Tool calls out of generated text, whole (non-streaming) or as it streams.

Three formats, one per ``tool_choice``:
  * a named function: the text is that function's arguments (constrained to its parameters);
  * ``"required"``: the text is a JSON array of ``{"name", "parameters"}`` (constrained by the
    schema ``server.structured_outputs`` builds, as vLLM does);
  * ``"auto"``: the model's own format, read by ``--tool-call-parser``; ``hermes`` reads
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2/Qwen3, Hermes, ...).

A parser takes text deltas (``feed``) and gives back content text and ``ToolCallDelta``s, in the
shape of OpenAI's ``delta.tool_calls``: a call's first delta has its name (and gets an id),
later ones append to its arguments. ``finish()`` flushes what was held back.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

TOOL_CALL_PARSERS = ("hermes",)


@dataclass
class ToolCallDelta:
    index: int  # which call of the message
    arguments: str  # more of its arguments' JSON text
    name: str | None = None  # set on the call's first delta

    def json(self) -> dict:
        """One ``delta.tool_calls`` entry."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, **_call_json(self.name, self.arguments)}


def _call_json(name: str, arguments: str) -> dict:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _arguments(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class NamedFunctionParser:
    """tool_choice names a function: all the text is its arguments, streamed as they come."""

    def __init__(self, name: str):
        self.name = name
        self._started = False

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        if not delta and self._started:
            return "", []
        first, self._started = not self._started, True
        return "", [ToolCallDelta(0, delta, self.name if first else None)]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self.feed("") if not self._started else ("", [])


class _JsonElements:
    """Splits a streamed JSON array into its top-level elements, each as it closes."""

    def __init__(self):
        self._depth, self._in_string, self._escaped = 0, False, False
        self._element: list[str] | None = None

    def feed(self, delta: str) -> list[str]:
        done = []
        for ch in delta:
            if self._element is not None:
                self._element.append(ch)
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._element = [ch]
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1 and self._element is not None:
                    done.append("".join(self._element))
                    self._element = None
        return done


class RequiredParser:
    """tool_choice "required": a JSON array of {"name", "parameters"}; each call is sent whole
    when its object closes. Text that never made a call (cut by max_tokens) comes back as
    content."""

    def __init__(self):
        self._elements = _JsonElements()
        self._text = ""
        self._count = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self._text += delta
        calls = []
        for element in self._elements.feed(delta):
            call = json.loads(element)
            calls.append(ToolCallDelta(self._count, _arguments(call.get("parameters", {})), call["name"]))
            self._count += 1
        return "", calls

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return ("", []) if self._count else (self._text, [])


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>``: the text before the first tag
    is content (vLLM's hermes parser drops text after it); each call is sent whole when its end
    tag arrives. Text that may be the start of a tag is held back."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self):
        self._pending = ""  # held-back content, or the body of the open call
        self._in_call = False
        self._tagged = False  # a start tag was seen: no more content
        self._count = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self._pending += delta
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._pending.find(self.END)
                if end < 0:
                    return content, calls
                body, self._pending = self._pending[:end], self._pending[end + len(self.END):]
                self._in_call = False
                calls += self._parse(body)
                continue
            start = self._pending.find(self.START)
            if start < 0:
                cut = len(self._pending) - _partial_suffix(self._pending, self.START)
                if not self._tagged:
                    content += self._pending[:cut]
                self._pending = self._pending[cut:]
                return content, calls
            if not self._tagged:
                content += self._pending[:start]
            self._pending = self._pending[start + len(self.START):]
            self._in_call = self._tagged = True

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        rest, self._pending = self._pending, ""
        if self._in_call:  # unclosed at the end: the model stopped before its end tag
            return "", self._parse(rest)
        return ("" if self._tagged else rest), []

    def _parse(self, body: str) -> list[ToolCallDelta]:
        try:
            call = json.loads(body)
            delta = ToolCallDelta(self._count, _arguments(call.get("arguments", {})), call["name"])
        except (ValueError, KeyError, TypeError, AttributeError):
            return []  # not a call after all: dropped, as vLLM's parser drops it
        self._count += 1
        return [delta]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def make_parser(tool_choice, tool_call_parser: str | None):
    """The parser a chat request's output goes through; None: plain content."""
    if isinstance(tool_choice, str):
        if tool_choice == "required":
            return RequiredParser()
        if tool_choice == "auto" and tool_call_parser == "hermes":
            return HermesParser()
        return None
    return NamedFunctionParser(tool_choice.function.name)


def parse_all(parser, text: str) -> tuple[str | None, list[dict]]:
    """Non-streaming: the message's content (None if empty) and its ``tool_calls``."""
    content, deltas = parser.feed(text)
    rest, more = parser.finish()
    calls: list[dict] = []
    for d in deltas + more:
        if d.name is not None:
            calls.append(_call_json(d.name, d.arguments))
        else:
            calls[d.index]["function"]["arguments"] += d.arguments
    return (content + rest) or None, calls
