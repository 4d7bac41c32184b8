"""K2's assistant reply format, parsed incrementally: reasoning, content and the tool-call section.

A K2.x reply (the text after the generation prompt, special tokens decoded to their names) is

    [<think> reasoning </think>] content [<|tool_calls_section_begin|> call+ <|tool_calls_section_end|>] content
    call = <|tool_call_begin|> functions.NAME:IDX <|tool_call_argument_begin|> {json arguments} <|tool_call_end|>

``ReplyParser.feed(text)`` takes the text in whatever pieces generation delivers and returns the events that
piece completes; ``finish()`` ends the reply. The pieces never change the result: a marker split across two
pieces is held back until it is complete or cannot be, so any chunking gives the same accumulated ``Reply`` as
parsing the whole text at once (tests split published-format replies at every point).

What is accepted, and how a reply that is not well formed is read (never an exception):
* ``<think>`` opens reasoning only as the reply's first text (the prompt's pre-fill counts: feed it first, see
  ``after_prompt``); ``</think>`` closes it. A tool-call section or call that starts inside reasoning ends the
  reasoning (K2-Thinking models sometimes call tools without closing their thought).
* A call header is ``functions.NAME:IDX`` or ``NAME:IDX`` (whitespace around it ignored, as vLLM does); the
  call's ``id`` is the header as written. A header of another shape still gives a call (id and name the header
  text), marked ``invalid``.
* Arguments are the raw text up to ``<|tool_call_end|>``; a call is ``invalid`` (with the reason) unless they are
  one JSON object. A call also ends at the next ``<|tool_call_begin|>``, at the section's end and at the reply's
  end (cut by max_tokens or a stop string), so a missing end marker loses nothing.
* ``<|tool_call_begin|>`` without the section marker opens the section too; text between calls that is not
  whitespace is content. After the section, text is content again.
* A marker where the format has no place for it is text: e.g. ``<think>`` in the middle of content, or a
  tool-call marker when the request declared no tools (``tool_calls=False``).
"""

from __future__ import annotations

import dataclasses
import json
import re

THINK, END_THINK = "<think>", "</think>"
SECTION, END_SECTION = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL, ARGUMENTS, END_CALL = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
MARKERS = (THINK, END_THINK, SECTION, END_SECTION, CALL, ARGUMENTS, END_CALL)
GENERATION_PROMPT_END = "<|im_middle|>"    # the last marker of the generation prompt; what follows is pre-fill

# OpenAI's function-name rule; K2 writes the call header as functions.NAME:IDX.
NAME = r"[a-zA-Z0-9_-]{1,64}"
_HEADER = re.compile(rf"\s*((?:functions\.)?({NAME}):\d+)\s*")


@dataclasses.dataclass
class ToolCall:
    index: int                  # its place in this reply, from 0
    id: str                     # the header as the model wrote it: functions.NAME:IDX
    name: str
    arguments: str = ""         # raw text, as generated
    invalid: str | None = None  # why this is not a well-formed call (set when the call ends); None when it is


@dataclasses.dataclass
class Reply:
    """Everything parsed so far."""
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Event:
    """``kind``: "reasoning" / "content" (``text``), "call" (a call opens: id and name known), "arguments" (a
    fragment ``text`` of ``call``'s arguments), "end" (``call`` is complete; its ``invalid`` is final)."""
    kind: str
    text: str = ""
    call: ToolCall | None = None


class ReplyParser:
    def __init__(self, tool_calls: bool = True):
        self.tool_calls = tool_calls
        self.reply = Reply()
        self._state = "start"        # start, reasoning, content, section, header, arguments
        self._held = ""              # unprocessed tail: could be the start of a marker
        self._text = ""              # header text, or text between calls (decided at the next marker)
        self._call: ToolCall | None = None
        self._events: list[Event] = []

    @classmethod
    def after_prompt(cls, prompt: str, tool_calls: bool = True) -> "ReplyParser":
        """A parser that has read what the prompt pre-filled after the generation prompt (``<think>``,
        ``<think></think>``, or the start of a tool call), so the reply continues from there."""
        parser = cls(tool_calls)
        end = prompt.rfind(GENERATION_PROMPT_END)
        parser.feed(prompt[end + len(GENERATION_PROMPT_END):] if end >= 0 else "")
        return parser

    def feed(self, text: str) -> list[Event]:
        buf = self._held + text
        while True:
            at, marker = _first_marker(buf)
            if marker is None:
                break
            self._text_in(buf[:at])
            self._marker(marker)
            buf = buf[at + len(marker):]
        keep = _partial_marker_len(buf)
        self._text_in(buf[:len(buf) - keep])
        self._held = buf[len(buf) - keep:]
        return self._take()

    def finish(self) -> list[Event]:
        """The reply ended: held text is text, an open call ends."""
        self._text_in(self._held)
        self._held = ""
        if self._state == "section":
            self._gap_text()
        elif self._state in ("header", "arguments"):
            self._end_call()
        self._state = "done"
        return self._take()

    # ---- the state machine ---------------------------------------------------------------------------------
    def _text_in(self, text: str) -> None:
        if not text:
            return
        if self._state == "start":
            self._state = "content"
        if self._state in ("reasoning", "content"):
            self._emit(self._state, text)
        elif self._state in ("section", "header"):
            self._text += text
        elif self._state == "arguments":
            self._call.arguments += text
            self._events.append(Event("arguments", text, self._call))

    def _marker(self, m: str) -> None:
        s = self._state
        if s == "start" and m == THINK:
            self._state = "reasoning"
        elif s == "reasoning" and m == END_THINK:
            self._state = "content"
        elif self.tool_calls and s in ("start", "reasoning", "content") and m in (SECTION, CALL):
            self._state = "section" if m == SECTION else "header"
        elif s == "section" and m in (CALL, END_SECTION):
            self._gap_text()
            self._state = "header" if m == CALL else "content"
        elif s == "header" and m == ARGUMENTS:
            self._open_call()
            self._state = "arguments"
        elif s in ("header", "arguments") and m in (END_CALL, CALL, END_SECTION):
            self._end_call()
            self._state = {END_CALL: "section", CALL: "header", END_SECTION: "content"}[m]
        else:                                    # no place for this marker here: it is text
            self._text_in(m)

    def _gap_text(self) -> None:
        if self._text.strip():
            self._emit("content", self._text)
        self._text = ""

    def _open_call(self) -> None:
        header, self._text = self._text, ""
        match = _HEADER.fullmatch(header)
        if match:
            call = ToolCall(len(self.reply.calls), match[1], match[2])
        else:
            call = ToolCall(len(self.reply.calls), header.strip(), header.strip(),
                            invalid=f"the call header {header.strip()!r} is not functions.NAME:IDX")
        self.reply.calls.append(call)
        self._call = call
        self._events.append(Event("call", call=call))

    def _end_call(self) -> None:
        if self._state == "header":           # ended before its arguments began
            self._open_call()
        call, self._call = self._call, None
        if call.invalid is None:
            call.invalid = _arguments_problem(call.arguments)
        self._events.append(Event("end", call=call))

    def _emit(self, kind: str, text: str) -> None:
        setattr(self.reply, kind, getattr(self.reply, kind) + text)
        self._events.append(Event(kind, text))

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events


def parse(text: str, tool_calls: bool = True) -> Reply:
    """A whole reply at once."""
    parser = ReplyParser(tool_calls)
    parser.feed(text)
    parser.finish()
    return parser.reply


def _first_marker(text: str) -> tuple[int, str | None]:
    # No marker contains another, so the first position where one starts names it.
    found = [(i, m) for m in MARKERS if (i := text.find(m)) >= 0]
    return min(found) if found else (-1, None)


def _partial_marker_len(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a marker (it may complete later)."""
    for n in range(min(len(text), max(map(len, MARKERS)) - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in MARKERS):
            return n
    return 0


def _arguments_problem(arguments: str) -> str | None:
    def no_constant(name):               # json.loads takes NaN and Infinity; JSON does not
        raise ValueError(f"{name} is not JSON")
    try:
        value = json.loads(arguments, parse_constant=no_constant)
    except ValueError as e:
        return f"the arguments are not valid JSON ({e})"
    if not isinstance(value, dict):
        return f"the arguments are JSON but not an object ({type(value).__name__})"
    return None
