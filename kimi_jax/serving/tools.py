"""OpenAI function tools and reasoning over K2's chat format: what a chat request's ``tools``, ``tool_choice``,
``chat_template_kwargs.thinking`` and tool messages may say, how they shape the prompt, and how the model's reply
(parsed by ``kimi_jax.text.reply_format``) becomes ``content``, ``reasoning_content`` and ``tool_calls``, whole
or as stream deltas.

``tool_choice`` acts through the prompt. ``"auto"`` declares the tools; ``"none"`` does not declare them
(and a tool-call section in the reply is then plain content); ``"required"`` declares them and pre-fills the
reply with ``<|tool_calls_section_begin|><|tool_call_begin|>`` (both special tokens, so the model picks the
name from a clean token boundary); a named function also pre-fills ``functions.NAME:`` (the model writes the
call's index and the arguments). A pre-filled reply starts with a tool call, so it cannot start with reasoning:
``thinking: true`` with a forced call is a 400, and with ``thinking`` unset or false the thought is skipped.

A tool with ``"strict": true`` constrains decoding: the whole reply is compiled to one token automaton
(``ToolPlan.reply_regex``; K2's markers are special tokens, written into the regex as control characters that
only those tokens spell, ``grammar.MARKER_CHARS``) and generated under it inside the DDTree round like any
response format: a forced call's arguments match its tool's ``parameters`` schema; under "auto" the reply is an
optional thought, then text (or, with a ``response_format``, that format's content) or a call section whose strict
calls match their schemas. A non-strict tool's arguments stay free text (without markers), and call indices have
at most 3 digits.

A call the reply makes that is not well formed (arguments not one JSON object, a header not
``functions.NAME:IDX``, or a function the request did not declare) is still returned, with its raw arguments
and a per-call field ``invalid`` saying why; in a stream that field comes in a last delta of the call.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kimi_jax.text.grammar import MARKER_CHARS, schema_regex
from kimi_jax.text.reply_format import (ARGUMENTS, CALL, END_CALL, END_SECTION, END_THINK, MARKERS, NAME, SECTION,
                                        THINK, Event, ReplyParser)


# A strict reply's call index (K2 numbers the calls of a conversation from 0): bounded, so that a constrained reply
# cannot spend its tokens on digits.
CALL_INDEX = "[0-9]{1,3}"


class InvalidToolRequest(ValueError):
    """A 400: what the request says about tools cannot be served; ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=f"^{NAME}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None          # a JSON Schema object; rendered into the prompt as given
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class CalledFunction(_Strict):
    name: str
    arguments: str


class MessageToolCall(_Strict):
    """A call in an earlier assistant turn, as this server returned it (``invalid`` included, so a client can
    send the message back unchanged; the prompt renders the call as the model wrote it)."""
    id: str
    type: Literal["function"]
    function: CalledFunction
    invalid: str | None = None


class ChatTemplateKwargs(_Strict):
    thinking: bool | None = None         # vLLM's switch for K2.x: true thinking mode, false instant mode


def check_messages(messages: list) -> None:
    """Tool fields only where they belong: ``tool_calls`` and ``reasoning_content`` on assistant turns,
    ``tool_call_id`` on (and required by) tool turns."""
    for i, m in enumerate(messages):
        for name in ("tool_calls", "reasoning_content"):
            if getattr(m, name) is not None and m.role != "assistant":
                raise InvalidToolRequest(f"messages.{i}.{name}: unknown field for role {m.role!r} (assistant "
                                         "only)", f"messages.{i}.{name}")
        if (m.tool_call_id is not None) != (m.role == "tool"):
            what = "required" if m.role == "tool" else f"unknown field for role {m.role!r} (tool only)"
            raise InvalidToolRequest(f"messages.{i}.tool_call_id: {what}", f"messages.{i}.tool_call_id")


def has_reply_format(tokenizer) -> bool:
    """Whether the tokenizer's chat format is K2's (its special tokens name every reply marker): only then are
    replies parsed and tools declared."""
    return all(m in tokenizer.special_tokens for m in MARKERS)


class ToolPlan:
    """What one chat request's tool fields mean for its prompt and its reply."""

    def __init__(self, tools: list[Tool] | None, tool_choice: ToolChoice | None, thinking: bool | None,
                 k2_format: bool):
        tools = tools or []
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise InvalidToolRequest(f"tools: the function name {dup!r} is declared twice", "tools")
        choice = tool_choice or ("auto" if tools else "none")
        if choice != "none" and not tools:
            raise InvalidToolRequest(f"tool_choice {_show(choice)} needs tools", "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidToolRequest(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                                     "tool_choice")
        if (tools and choice != "none" or thinking is not None) and not k2_format:
            raise InvalidToolRequest("this model's chat format has no tool calls or thinking switch (it is not "
                                     "K2's)", "tools" if tools else "chat_template_kwargs")
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        if forced and thinking:
            raise InvalidToolRequest(f"tool_choice {_show(choice)} pre-fills the reply with a tool call, so it "
                                     "cannot start with reasoning: set chat_template_kwargs.thinking to false or "
                                     "use tool_choice \"auto\"", "tool_choice")
        self.declared = {} if choice == "none" else {t.function.name: t for t in tools}
        self.thinking = thinking
        self.prefill = ""
        if forced:
            self.prefill = SECTION + CALL
            if isinstance(choice, NamedToolChoice):
                self.prefill += f"functions.{choice.function.name}:"
        self.k2_format = k2_format
        self.choice = choice

    @property
    def strict(self) -> bool:
        """Whether a declared tool asks for ``strict`` arguments: then the whole reply is constrained
        (``reply_regex``)."""
        return any(t.function.strict for t in self.declared.values())

    def reply_regex(self, content: str | None = None) -> str:
        """The regex of every reply this request may get, K2's markers written as ``grammar.MARKER_CHARS``: a forced
        call is the rest of its call section; "auto" is an optional thought, then any text and an optional call
        section, or with ``content`` (the response format's regex) that content or a call section. A strict tool's
        arguments match its ``parameters`` schema, another's are any text."""
        x = {marker: f"\\x{ord(c):02x}" for marker, c in MARKER_CHARS.items()}      # each marker, escaped
        text = f"[^\\x00-{max(x.values())}]*"          # any text without a marker (they are \x01, \x02, ...)
        after_name = {}                                 # each tool's call after "functions.NAME:"
        for name, tool in self.declared.items():
            params = tool.function.parameters or {"type": "object", "properties": {}}
            args = schema_regex(params, f"tools function {name!r} parameters") if tool.function.strict else text
            after_name[name] = f"{CALL_INDEX}{x[ARGUMENTS]}(?:{args}){x[END_CALL]}"
        if isinstance(self.choice, NamedToolChoice):      # the pre-fill wrote "functions.NAME:"; one call
            return after_name[self.choice.function.name] + x[END_SECTION]
        one = "(?:" + "|".join(f"functions\\.{re.escape(n)}:{rest}" for n, rest in after_name.items()) + ")"
        calls = f"{one}(?:{x[CALL]}{one})*{x[END_SECTION]}"
        if self.choice == "required":                   # the pre-fill opened the section and the first call
            return calls
        thought = f"(?:{x[THINK]}{text}{x[END_THINK]})?" if self.thinking is not False else ""
        section = f"{x[SECTION]}{x[CALL]}{calls}"
        if content is None:
            return f"{thought}{text}(?:{section})?"
        return f"{thought}(?:(?:{content})|{section})"          # the format's content, or calls

    def prompt(self, tokenizer, messages: list[dict]) -> str:
        """The chat prompt: the declared tools, the thinking switch, then the forced call's pre-fill."""
        tools = [t.model_dump(exclude_none=True, exclude={"function": {"strict"}}) for t in self.declared.values()]
        tools = tools or None
        kwargs = {"tools": tools, "thinking": self.thinking} if self.k2_format else {}
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs) + self.prefill

    def reply(self, prompt: str) -> "ChatReply":
        parser = ReplyParser.after_prompt(prompt, tool_calls=bool(self.declared)) if self.k2_format else None
        return ChatReply(parser, set(self.declared))


class ChatReply:
    """One chat reply: the generated text in (in the pieces the server releases), OpenAI's message fields or
    stream deltas out."""

    def __init__(self, parser: ReplyParser | None, declared: set[str]):
        self.parser, self.declared = parser, declared
        self.text = ""                  # the reply's text when it is not parsed (no K2 format)

    def push(self, text: str) -> list[dict]:
        """The stream deltas (``choices[0].delta`` objects) this text completes."""
        if self.parser is None:
            self.text += text
            return [{"content": text}] if text else []
        return self._deltas(self.parser.feed(text))

    def end(self) -> list[dict]:
        return [] if self.parser is None else self._deltas(self.parser.finish())

    def message(self) -> dict:
        if self.parser is None:
            return {"role": "assistant", "content": self.text}
        reply = self.parser.reply
        message = {"role": "assistant", "content": reply.content or (None if reply.calls else "")}
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments},
                                      **({"invalid": c.invalid} if c.invalid else {})} for c in reply.calls]
        return message

    def finish_reason(self, reason: str) -> str:
        """OpenAI's "tool_calls" for a reply that ended by itself after calling."""
        calls = self.parser is not None and self.parser.reply.calls
        return "tool_calls" if calls and reason == "stop" else reason

    def _deltas(self, events: list[Event]) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if e.kind == "call" and e.call.invalid is None and e.call.name not in self.declared:
                e.call.invalid = f"{e.call.name!r} is not one of the request's tools"
            delta = _delta(e)
            if delta is None:
                continue
            if out and _mergeable(out[-1], delta):     # consecutive text of one kind: one delta
                _merge(out[-1], delta)
            else:
                out.append(delta)
        return out


def _delta(e: Event) -> dict | None:
    if e.kind == "content":
        return {"content": e.text}
    if e.kind == "reasoning":
        return {"reasoning_content": e.text}
    c = e.call
    if e.kind == "call":
        return {"tool_calls": [{"index": c.index, "id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": ""}}]}
    if e.kind == "arguments":
        return {"tool_calls": [{"index": c.index, "function": {"arguments": e.text}}]}
    return {"tool_calls": [{"index": c.index, "invalid": c.invalid}]} if c.invalid else None


def _mergeable(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    if "tool_calls" not in a:
        return True
    x, y = a["tool_calls"][0], b["tool_calls"][0]
    return x["index"] == y["index"] and "invalid" not in x and "invalid" not in y


def _merge(a: dict, b: dict) -> None:
    if "tool_calls" in a:
        a["tool_calls"][0]["function"]["arguments"] += b["tool_calls"][0]["function"]["arguments"]
    else:
        key = next(iter(a))
        a[key] += b[key]


def _show(choice) -> str:
    return f'"{choice}"' if isinstance(choice, str) else f"for function {choice.function.name!r}"
