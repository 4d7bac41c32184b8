"""Tool calls and reasoning in K2's reply format: the incremental parser at every chunk boundary, and the chat
endpoint end to end behind a scripted batcher, driven by the official `openai` client.

The replies are written from K2.6's published format (research notes, kimi_k2.md section 6: a `<think>` thought,
then content, then `<|tool_calls_section_begin|>` with `functions.NAME:IDX` calls). The scripted batcher stands
at the seam where generated token ids reach the HTTP layer (``Job.emit`` / ``Job.finish``): it encodes the
script with a byte-level Kimi tokenizer (K2's special tokens, one token per byte otherwise, so multi-byte
characters are split across deliveries) and delivers it a few tokens at a time, as the real batcher does.
"""

import collections
import itertools
import json
import threading
import types

import httpx
import pytest
from conftest import serve_in_thread

from kimi_jax.serving.tools import ChatReply, InvalidToolRequest, Tool, ToolPlan
from kimi_jax.text.grammar import GrammarCache
from kimi_jax.text.reply_format import Reply, ReplyParser, ToolCall, parse
from kimi_jax.text.tokenizer import BPETokenizer, KimiTokenizer

openai = pytest.importorskip("openai")

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


def _accumulate(deltas):
    """An OpenAI client's view of a stream's deltas: the message they add up to."""
    msg, calls = {"content": "", "reasoning_content": ""}, {}
    for d in deltas:
        for key in ("content", "reasoning_content"):
            msg[key] += d.get(key) or ""
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"function": {"arguments": ""}})
            c.update({k: v for k, v in tc.items() if k not in ("index", "function")})
            c["function"]["name"] = tc.get("function", {}).get("name", c["function"].get("name"))
            c["function"]["arguments"] += tc.get("function", {}).get("arguments", "")
    msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg


@pytest.mark.parametrize("name,text,want", REPLIES, ids=[r[0] for r in REPLIES])
def test_stream_deltas_add_up_to_the_message(name, text, want):
    """At every split, the deltas (first delta of a call: id, type, name; then argument fragments; a last one
    with `invalid`) add up to the non-streamed message."""
    whole = ChatReply(ReplyParser(), {"get_weather", "add", "a", "b", "html"})
    whole.push(text)
    whole.end()
    m = whole.message()
    expected = {"content": m["content"] or "", "reasoning_content": m.get("reasoning_content", ""),
                "tool_calls": m.get("tool_calls", [])}
    for i in range(len(text) + 1):
        reply = ChatReply(ReplyParser(), {"get_weather", "add", "a", "b", "html"})
        deltas = reply.push(text[:i]) + reply.push(text[i:]) + reply.end()
        assert _accumulate(deltas) == expected
        firsts = {}
        for d in deltas:
            for tc in d.get("tool_calls", []):
                if tc["index"] not in firsts:
                    firsts[tc["index"]] = tc
                    assert tc["type"] == "function" and "id" in tc and "name" in tc["function"]
                else:
                    assert "id" not in tc and "name" not in tc.get("function", {})


def _tool(name="get_weather", **extra):
    return {"type": "function", "function": {"name": name, "description": "weather now",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}},
                                             **extra}}


def test_tool_plan_refuses_what_a_non_k2_chat_format_cannot_say():
    tools = [Tool.model_validate(_tool())]
    with pytest.raises(InvalidToolRequest, match="not K2's"):
        ToolPlan(tools, None, None, k2_format=False)
    with pytest.raises(InvalidToolRequest, match="not K2's"):
        ToolPlan(None, None, True, k2_format=False)
    plan = ToolPlan(tools, "none", None, k2_format=False)        # declared nothing: the plain format serves it
    bpe = BPETokenizer({bytes([i]): i for i in range(256)})
    assert plan.prompt(bpe, [{"role": "user", "content": "hi"}]) == "# user: hi\n# assistant:"


# ---- end to end: the real server, a scripted batcher, the official client -----------------------------------

class ScriptedBatcher:
    """What the HTTP layer uses of a Batcher; each submitted job gets the next script, as tokens, a few per
    delivery, then <|im_end|> (eos) unless max_tokens cuts it first."""
    method, budget, max_batch, degraded, prefix, lost, processes = "ar", None, 4, None, None, None, 1
    max_len, queue_size = 1024, 8

    def __init__(self, tok):
        grammars = GrammarCache()
        self.model = types.SimpleNamespace(tokenizer=tok, config=types.SimpleNamespace(
            eos_token_ids=tok.eos_ids, vocab_size=tok.vocab_size),
            grammar=lambda **asked: grammars.get(tok, **asked))
        self.stats = types.SimpleNamespace(mean_tau=0.0)
        self.scripts, self.prompts, self.grammars, self.processing = collections.deque(), [], [], []
        self.active = self.queue_depth = 0
        self.draining = False

    def check(self, ids, max_tokens):
        pass

    def check_grammar(self, compiled):
        self.grammars.append(compiled)

    def submit(self, job):
        self.prompts.append(self.model.tokenizer.decode(job.ids))
        self.processing.append(job.processing)
        tokens = self.model.tokenizer.encode(self.scripts.popleft()) + [self.model.tokenizer.special_tokens[
            "<|im_end|>"]]
        threading.Thread(target=self._deliver, args=(job, tokens[:job.max_tokens]), daemon=True).start()

    def _deliver(self, job, tokens):
        sent, sizes = 0, itertools.cycle([1, 2, 3, 5])        # tokens per delivery, as rounds accept them
        while sent < len(tokens) and not job.cancelled.is_set():
            n = next(sizes)
            job.emit(tokens[sent:sent + n])
            sent += n
        eos = sent >= len(tokens) and tokens[-1] in self.model.config.eos_token_ids
        job.finish("cancelled" if job.cancelled.is_set() else "stop" if eos else "length")

    def drain(self, grace):
        self.draining = True


@pytest.fixture(scope="module")
def live():
    from kimi_jax.serving.server import create_app, shutdown
    tok = KimiTokenizer({bytes([i]): i for i in range(256)})
    batcher = ScriptedBatcher(tok)
    app = create_app(batcher, "k2-scripted")
    url, thread = serve_in_thread(app, 1.0)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    yield types.SimpleNamespace(url=url, client=client, batcher=batcher)
    shutdown(app)
    thread.join(10)


USER = [{"role": "user", "content": "Weather in Zürich and 2+3?"}]
TOOLS = [_tool(), _tool("add")]


def _ask(live, script, stream=False, **kw):
    live.batcher.scripts.append(script)
    kw = {"model": "k2-scripted", "messages": USER, "max_tokens": 200, "temperature": 0, **kw}
    r = live.client.chat.completions.create(stream=stream, **kw)
    if not stream:
        return r, live.batcher.prompts[-1]
    return list(r), live.batcher.prompts[-1]


def _streamed_message(chunks):
    deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in chunks if c.choices]
    return _accumulate(deltas), chunks[-1].choices[0].finish_reason


def test_a_tool_call_non_streamed(live):
    r, prompt = _ask(live, REPLIES[2][1], tools=TOOLS)
    assert prompt.startswith("<|im_system|>tool_declare<|im_middle|>[") and '"name":"add"' in prompt
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|>")
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content == "Let me check."
    assert m.reasoning_content == "Need the weather."
    (tc,) = m.tool_calls
    assert (tc.id, tc.type, tc.function.name) == ("functions.get_weather:0", "function", "get_weather")
    assert json.loads(tc.function.arguments) == {"city": "Zürich", "unit": "c"}
    assert not (tc.model_extra or {}).get("invalid")


def test_a_tool_call_streamed(live):
    chunks, _ = _ask(live, REPLIES[2][1], stream=True, tools=TOOLS)
    msg, finish = _streamed_message(chunks)
    assert finish == "tool_calls" and msg["content"] == "Let me check."
    assert msg["reasoning_content"] == "Need the weather."
    assert msg["tool_calls"] == [{"id": "functions.get_weather:0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Zürich", "unit": "c"}'}}]
    call_deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert call_deltas[0][0].id == "functions.get_weather:0" and call_deltas[0][0].function.name == "get_weather"
    assert len(call_deltas) > 2 and all(d[0].id is None and d[0].function.name is None for d in call_deltas[1:])


def test_two_calls_in_one_turn(live):
    r, _ = _ask(live, REPLIES[3][1], tools=TOOLS)
    got = [(c.id, c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]
    assert got == [("functions.get_weather:0", "get_weather", {"city": "東京"}),
                   ("functions.add:1", "add", {"a": 2, "b": 3})]
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
    chunks, _ = _ask(live, REPLIES[3][1], stream=True, tools=TOOLS)
    msg, finish = _streamed_message(chunks)
    assert finish == "tool_calls"
    assert [(c["id"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        (g[0], g[2]) for g in got]


def test_malformed_arguments_and_unknown_functions_are_flagged(live):
    script = f"{S}{B}functions.add:0{A}{{\"a\": 2, b: 3}}{C}{B}functions.launch:1{A}{{}}{C}{E}"
    r, _ = _ask(live, script, tools=TOOLS)
    bad, unknown = r.choices[0].message.tool_calls
    assert bad.function.arguments == '{"a": 2, b: 3}' and bad.model_extra["invalid"].startswith(NOT_JSON)
    assert unknown.function.name == "launch" and "not one of the request's tools" in unknown.model_extra["invalid"]
    assert r.choices[0].finish_reason == "tool_calls"
    chunks, _ = _ask(live, script, stream=True, tools=TOOLS)
    msg, _ = _streamed_message(chunks)
    assert [c.get("invalid", "")[:20] for c in msg["tool_calls"]] == [
        c.model_extra["invalid"][:20] for c in r.choices[0].message.tool_calls]


def test_max_tokens_inside_a_call_ends_with_length(live):
    script = REPLIES[2][1]
    up_to_unit = len(live.batcher.model.tokenizer.encode(script[:script.index('"unit"')]))
    r, _ = _ask(live, script, tools=TOOLS, max_tokens=up_to_unit)
    (tc,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "length" and tc.model_extra["invalid"].startswith(NOT_JSON)


def test_reasoning_content_in_thinking_and_instant_mode(live):
    r, prompt = _ask(live, "Greeting, so greet.</think>Hello!", extra_body={
        "chat_template_kwargs": {"thinking": True}})
    assert prompt.endswith("<|im_middle|><think>")
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("Greeting, so greet.",
                                                                                        "Hello!")
    assert r.choices[0].finish_reason == "stop"
    chunks, _ = _ask(live, "Greeting, so greet.</think>Hello!", stream=True,
                     extra_body={"chat_template_kwargs": {"thinking": True}})
    msg, _ = _streamed_message(chunks)
    assert (msg["reasoning_content"], msg["content"]) == ("Greeting, so greet.", "Hello!")
    assert any(getattr(c.choices[0].delta, "reasoning_content", None) for c in chunks if c.choices)
    r, prompt = _ask(live, "Hello!", extra_body={"chat_template_kwargs": {"thinking": False}})
    assert prompt.endswith("<|im_middle|><think></think>") and r.choices[0].message.content == "Hello!"
    assert getattr(r.choices[0].message, "reasoning_content", None) is None


def test_tool_choice_none_declares_nothing_and_parses_no_calls(live):
    r, prompt = _ask(live, REPLIES[2][1], tools=TOOLS, tool_choice="none")
    assert "tool_declare" not in prompt and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content.startswith(f"Let me check.{S}") and r.choices[0].finish_reason == "stop"


def test_tool_choice_required_prefills_a_call(live):
    r, prompt = _ask(live, f"functions.add:0{A}{{\"a\": 1, \"b\": 1}}{C}{E}", tools=TOOLS, tool_choice="required")
    assert prompt.endswith(f"<|im_assistant|>assistant<|im_middle|>{S}{B}") and "tool_declare" in prompt
    (tc,) = r.choices[0].message.tool_calls
    assert (tc.id, tc.function.arguments, r.choices[0].finish_reason) == ("functions.add:0", '{"a": 1, "b": 1}',
                                                                          "tool_calls")


def test_tool_choice_named_prefills_the_name(live):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    chunks, prompt = _ask(live, f"4{A}{{\"city\": \"Oslo\"}}{C}{E}", stream=True, tools=TOOLS, tool_choice=choice,
                          extra_body={"chat_template_kwargs": {"thinking": False}})
    assert prompt.endswith(f"<|im_middle|><think></think>{S}{B}functions.get_weather:")
    msg, finish = _streamed_message(chunks)
    assert finish == "tool_calls" and msg["tool_calls"] == [{"id": "functions.get_weather:4", "type": "function",
                                                             "function": {"name": "get_weather",
                                                                          "arguments": '{"city": "Oslo"}'}}]


def test_strict_tools_constrain_the_whole_reply(live):
    """strict: the job carries the reply's automaton (tests/test_strict_tools.py checks what it takes), compiled
    before the job is queued; a schema feature it cannot enforce is a 400 naming the tool."""
    strict = [_tool(strict=True), _tool("add")]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r, _ = _ask(live, f"4{A}{{\"city\": \"Oslo\"}}{C}{E}", tools=strict, tool_choice=choice,
                extra_body={"chat_template_kwargs": {"thinking": False}})
    assert r.choices[0].message.tool_calls[0].function.arguments == '{"city": "Oslo"}'
    assert set(live.batcher.processing[-1]) == {"reply_regex"} and live.batcher.grammars[-1].num_states > 1
    _ask(live, "plain", tools=[_tool(), _tool("add")])
    assert "reply_regex" not in live.batcher.processing[-1]          # no strict tool: nothing constrained
    bounded = _tool(strict=True, parameters={"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}})
    with pytest.raises(openai.BadRequestError, match="tools function 'get_weather' parameters.*minimum"):
        live.client.chat.completions.create(model="k2-scripted", messages=USER, tools=[bounded])


def test_the_reply_goes_back_with_the_tool_result(live):
    """The assistant message as the client got it (the `invalid` flag included) and a tool message: the next
    prompt renders the call and its result in K2's format."""
    r, _ = _ask(live, f"{S}{B}functions.get_weather:0{A}{{\"city\": 1{C}{E}", tools=TOOLS)
    messages = USER + [r.choices[0].message, {"role": "tool", "tool_call_id": "functions.get_weather:0",
                                              "content": "error: bad arguments"}]
    r2, prompt = _ask(live, "Sorry, retrying.", tools=TOOLS, messages=messages)
    assert r2.choices[0].message.content == "Sorry, retrying."
    assert (f"<|im_assistant|>assistant<|im_middle|>{S}{B}functions.get_weather:0{A}{{\"city\": 1{C}{E}<|im_end|>"
            in prompt)
    assert "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nerror: bad arguments" in prompt


BAD_TOOLS = [
    ({"tools": [_tool("get weather")]}, "tools.0.function.name"),
    ({"tools": [_tool("x" * 65)]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "a"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": ["x"]}}]}, "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": "{}"}}]}, "tools.0.function.parameters"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{"type": "function", "function": {"name": "a", "colour": 1}}]}, "tools.0.function.colour"),
    ({"tools": [_tool(), _tool()]}, "tools"),
    ({"tools": [_tool()], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [_tool()], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [_tool()], "tool_choice": "required", "chat_template_kwargs": {"thinking": True}}, "tool_choice"),
    ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs.enable_thinking"),
    ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "x"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages.0.tool_calls"),
    ({"parallel_tool_calls": False, "tools": [_tool()]}, "parallel_tool_calls"),
]


@pytest.mark.parametrize("extra,param", BAD_TOOLS, ids=[b[1] + f"-{i}" for i, b in enumerate(BAD_TOOLS)])
def test_bad_tool_requests_are_400s(live, extra, param):
    body = {"messages": USER, "max_tokens": 8, **extra}
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and param.split(".")[-1] in err["message"], err


def test_bad_tool_schema_through_the_client_and_completions(live):
    with pytest.raises(openai.BadRequestError, match="tools.0.function.name"):
        live.client.chat.completions.create(model="k2-scripted", messages=USER, tools=[_tool("a.b")])
    r = httpx.post(live.url + "/v1/completions", json={"prompt": "x", "tools": [_tool()]}, timeout=30)
    assert r.status_code == 400 and "tools is not supported" in r.json()["error"]["message"]
