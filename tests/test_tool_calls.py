"""K2's reply format (kimi_jax.text.reply_format): the incremental parser gives the one-shot result at every
chunk boundary.

The replies are written from K2.6's published format (research notes, kimi_k2.md section 6: a `<think>` thought,
then content, then `<|tool_calls_section_begin|>` with `functions.NAME:IDX` calls).
"""

import types

import pytest

from kimi_jax.text.reply_format import Reply, ReplyParser, ToolCall, parse

S, E = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
B, A, C = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def call(i, header, args, name=None, invalid=None):
    return ToolCall(i, header.strip(), name or header.strip().split(".")[-1].split(":")[0], args, invalid)


NOT_JSON = "the arguments are not valid JSON"
# (name, reply text, what it parses to; an `invalid` ending in "..." is matched by its start)
REPLIES = [
    ("plain", "Hello, world: <b>bold</b> <| not a marker.", Reply("", "Hello, world: <b>bold</b> <| not a marker.")),
    ("thought", "<think>The user greets me.</think>Hi there!", Reply("The user greets me.", "Hi there!")),
    ("one call", f"<think>Need the weather.</think>Let me check.{S}{B}functions.get_weather:0{A}"
     f'{{"city": "Zürich", "unit": "c"}}{C}{E}',
     Reply("Need the weather.", "Let me check.",
           [call(0, "functions.get_weather:0", '{"city": "Zürich", "unit": "c"}')])),
    ("two calls", f"{S}{B}functions.get_weather:0{A}{{\"city\": \"東京\"}}{C}\n{B}functions.add:1{A}"
     f'{{"a": 2, "b": 3}}{C}{E}',
     Reply("", "", [call(0, "functions.get_weather:0", '{"city": "東京"}'),
                    call(1, "functions.add:1", '{"a": 2, "b": 3}')])),
    ("malformed arguments", f"{S}{B}functions.add:0{A}{{\"a\": 2, b: 3}}{C}{E}",
     Reply("", "", [call(0, "functions.add:0", '{"a": 2, b: 3}', invalid=NOT_JSON + "...")])),
    ("not an object", f"{S}{B}functions.add:0{A}[2, 3]{C}{B}functions.add:1{A}{{\"a\": NaN}}{C}{E}",
     Reply("", "", [call(0, "functions.add:0", "[2, 3]", invalid="the arguments are JSON but not an object (list)"),
                    call(1, "functions.add:1", '{"a": NaN}', invalid=NOT_JSON + "...")])),
    ("cut mid-arguments", f"Checking.{S}{B}functions.get_weather:0{A}{{\"city\": \"Par",
     Reply("", "Checking.", [call(0, "functions.get_weather:0", '{"city": "Par', invalid=NOT_JSON + "...")])),
    ("cut after arguments", f"{S}{B}functions.get_weather:0{A}{{}}",
     Reply("", "", [call(0, "functions.get_weather:0", "{}")])),
    ("loose spacing, no prefix", f"{S}\n{B} get_weather:3 {A} {{\"city\": \"Oslo\"}} {C}\n{E}\nDone.",
     Reply("", "\nDone.", [call(0, "get_weather:3", ' {"city": "Oslo"} ')])),
    ("bad header", f"{S}{B}get weather{A}{{}}{C}{E}",
     Reply("", "", [call(0, "get weather", "{}", name="get weather",
                         invalid="the call header 'get weather' is not functions.NAME:IDX")])),
    ("no end markers", f"{S}{B}functions.a:0{A}{{}}{B}functions.b:1{A}{{\"x\": 1}}",
     Reply("", "", [call(0, "functions.a:0", "{}"), call(1, "functions.b:1", '{"x": 1}')])),
    ("call without section", f"Sure{B}functions.a:0{A}{{}}{C}",
     Reply("", "Sure", [call(0, "functions.a:0", "{}")])),
    ("call inside the thought", f"<think>I will call a.{S}{B}functions.a:0{A}{{}}{C}{E}",
     Reply("I will call a.", "", [call(0, "functions.a:0", "{}")])),
    ("stray text in the section", f"{S}{B}functions.a:0{A}{{}}{C} oops {E}",
     Reply("", " oops ", [call(0, "functions.a:0", "{}")])),
    ("markers out of place are text", f"x<think>y</think>{A}{C}{E}",
     Reply("", f"x<think>y</think>{A}{C}{E}")),
    ("marker-like argument text", f'{S}{B}functions.html:0{A}{{"t": "<|tool_call_e <think> </thi"}}{C}{E}',
     Reply("", "", [call(0, "functions.html:0", '{"t": "<|tool_call_e <think> </thi"}')])),
    ("header cut before arguments", f"{S}{B}functions.a:0", Reply("", "", [call(0, "functions.a:0", "",
                                                                               invalid=NOT_JSON + "...")])),
    ("emoji and unfinished thought", "<think>🤔 thinking… <|tool", Reply("🤔 thinking… <|tool", "")),
]


def _same(got: Reply, want: Reply):
    assert (got.reasoning, got.content, len(got.calls)) == (want.reasoning, want.content, len(want.calls)), got
    for g, w in zip(got.calls, want.calls):
        if w.invalid and w.invalid.endswith("..."):
            assert g.invalid and g.invalid.startswith(w.invalid[:-3]), g
            g = types.SimpleNamespace(**{**vars(g), "invalid": w.invalid})
        assert vars(g) == vars(w)


def _feed(pieces, tool_calls=True):
    parser = ReplyParser(tool_calls)
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    return parser.reply, events


def _from_events(events) -> Reply:
    """The reply rebuilt from the events alone (what a stream carries)."""
    out, calls = Reply(), {}
    for e in events:
        if e.kind in ("reasoning", "content"):
            setattr(out, e.kind, getattr(out, e.kind) + e.text)
        elif e.kind == "call":
            calls[e.call.index] = ToolCall(e.call.index, e.call.id, e.call.name)
        elif e.kind == "arguments":
            calls[e.call.index].arguments += e.text
        else:
            calls[e.call.index].invalid = e.call.invalid
    out.calls = [calls[i] for i in sorted(calls)]
    return out


@pytest.mark.parametrize("name,text,want", REPLIES, ids=[r[0] for r in REPLIES])
def test_parse_whole_reply(name, text, want):
    _same(parse(text), want)


@pytest.mark.parametrize("name,text,want", REPLIES, ids=[r[0] for r in REPLIES])
def test_every_chunk_boundary_gives_the_one_shot_result(name, text, want):
    """Two pieces split at every point, and single characters: the same reply, and the events rebuild it."""
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        reply, events = _feed(pieces)
        _same(reply, want)
        _same(_from_events(events), want)


def test_three_piece_splits_of_two_calls():
    text = REPLIES[3][1]
    for i in range(0, len(text), 3):
        for j in range(i, len(text), 5):
            _same(_feed([text[:i], text[i:j], text[j:]])[0], REPLIES[3][2])


def test_without_tools_the_section_is_content():
    text = REPLIES[2][1]
    reply = _feed(list(text), tool_calls=False)[0]
    assert reply.calls == [] and reply.reasoning == "Need the weather." and reply.content == text[len(
        "<think>Need the weather.</think>"):]


def test_after_prompt_continues_from_the_prefill():
    p = ReplyParser.after_prompt("<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
                                 "<think>")
    p.feed("mull</think>ok")
    p.finish()
    assert (p.reply.reasoning, p.reply.content) == ("mull", "ok")
    p = ReplyParser.after_prompt(f"<|im_assistant|>assistant<|im_middle|><think></think>{S}{B}functions.f:")
    p.feed(f"7{A}{{}}{C}{E}")
    p.finish()
    assert [(c.id, c.name, c.invalid) for c in p.reply.calls] == [("functions.f:7", "f", None)]
