"""Strict tool calls: ``tools[].function.strict`` compiles the whole chat reply (thought, content, K2's call
section with its special-token markers) to one token automaton, so every call's arguments match its schema.

The automaton is checked against replies written in K2.6's published format (accepted or refused token by token),
then run under DDTree on the embedded default's weights with a byte-level tokenizer that has K2's special tokens:
every reply, greedy and sampled, parses (``reply_format.parse``, the server's parser) into calls whose arguments
validate against their schema (``jsonschema``, an independent validator)."""

import json

import jax
import jsonschema
import numpy as np
import pytest
from pydantic import TypeAdapter

import kimi_jax
from kimi_jax.cli.decode import DEFAULT_DRAFTER, DEFAULT_TARGET
from kimi_jax.fields import GenerationError
from kimi_jax.serving.tools import Tool, ToolChoice, ToolPlan
from kimi_jax.text import grammar
from kimi_jax.text.reply_format import parse
from kimi_jax.text.tokenizer import BPETokenizer, KimiTokenizer

S, E = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
B, A, C = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Zürich", "東京"]}, "unit": {"enum": ["c", "f"]},
                                            "daily": {"type": "boolean"}},
           "required": ["city", "unit", "daily"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}, "b": {"type": "boolean"}}, "required": ["a"]}
TOK = KimiTokenizer({bytes([i]): i for i in range(256)})       # K2's special tokens, one token per byte


def tools(strict_add: bool = False) -> list[Tool]:
    return [Tool.model_validate({"type": "function", "function": {"name": n, "parameters": p, "strict": s}})
            for n, p, s in (("get_weather", WEATHER, True), ("add", ADD, strict_add))]


def plan(choice, **kw) -> ToolPlan:
    return ToolPlan(tools(**kw), TypeAdapter(ToolChoice).validate_python(choice), None, k2_format=True)


def accepts(compiled, reply: str) -> bool:
    """Whether the automaton takes the reply's tokens and then eos (a walk on the device tables)."""
    state = grammar.INITIAL_STATE
    for token in TOK.encode(reply) + [TOK.eos_ids[0]]:
        state = int(grammar.advance(compiled.tables, np.int32(state), token))
        if state == grammar.DEAD_STATE:
            return False
    return True


GOOD = f'functions.get_weather:0{A}{{"city": "Zürich", "unit": "c", "daily": false}}{C}'
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# (tool_choice, reply after the prompt's pre-fill, accepted)
REPLIES = [
    ("auto", "Just text, no call.", True),
    ("auto", f"<think>Weather needed.</think>Checking.{S}{B}{GOOD}{E}", True),
    ("auto", f"{S}{B}{GOOD}{B}functions.add:1{A}anything at all{C}{E}", True),       # add is not strict
    ("auto", f"{S}{B}{GOOD.replace('Zürich', 'Paris')}{E}", False),                 # not in the enum
    ("auto", f'{S}{B}{GOOD.replace(", \"daily\": false", "")}{E}', False),           # a required field missing
    ("auto", f"{S}{B}functions.fly:0{A}{{}}{C}{E}", False),                          # not a declared tool
    ("auto", f"Checking.{S}{B}{GOOD}{E}And more text after the calls.", False),
    ("required", f"{GOOD}{E}", True),
    ("required", f"{GOOD}{B}{GOOD.replace(':0', ':1')}{E}", True),
    ("required", "No call.", False),
    (NAMED, GOOD.removeprefix("functions.get_weather:") + E, True),
    (NAMED, f"0{A}{{\"a\": 1}}{C}{E}", False),
    (NAMED, GOOD.removeprefix("functions.get_weather:") + B + GOOD + E, False),        # one call for a named choice
]


@pytest.mark.parametrize("choice,reply,ok", REPLIES, ids=[f"{i}-{r[0] if isinstance(r[0], str) else 'named'}"
                                                        for i, r in enumerate(REPLIES)])
def test_the_reply_automaton_takes_the_published_format(choice, reply, ok):
    compiled = grammar.GrammarCache().get(TOK, reply_regex=plan(choice).reply_regex())
    assert accepts(compiled, reply) is ok


def test_content_under_a_response_format_or_calls():
    content = grammar.response_format_regex({"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}}})
    compiled = grammar.GrammarCache().get(TOK, reply_regex=plan("auto").reply_regex(content))
    assert accepts(compiled, '{"answer": "yes"}') and accepts(compiled, f"{S}{B}{GOOD}{E}")
    assert not accepts(compiled, "free text") and not accepts(compiled, f'{{"answer": "yes"}}{S}{B}{GOOD}{E}')


def test_marker_bytes_are_the_special_tokens_only():
    """A rank that spells a marker's control character is never allowed, so a marker is its special token."""
    compiled = grammar.GrammarCache().get(TOK, reply_regex=plan("required").reply_regex())
    allowed = np.asarray(grammar.allowed(compiled.tables, np.arange(compiled.num_states)))
    assert not allowed[:, list(range(1, 1 + len(grammar.MARKER_CHARS)))].any()
    assert allowed[:, TOK.special_tokens[E]].any() and allowed[:, TOK.special_tokens[C]].any()


def test_refusals_are_clear():
    bad = Tool.model_validate({"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}}}})
    with pytest.raises(GenerationError, match="tools function 'f' parameters.*minimum"):
        ToolPlan([bad], "auto", None, k2_format=True).reply_regex()
    with pytest.raises(GenerationError, match="no K2 reply markers"):
        plain = BPETokenizer({bytes([i]): i for i in range(256)})
        grammar.GrammarCache().get(plain, reply_regex=plan("required").reply_regex())


@pytest.fixture(scope="module")
def model():
    if not (DEFAULT_TARGET / "kimi_config.json").exists():
        pytest.skip("embedded default not built")
    m = kimi_jax.load(str(DEFAULT_TARGET), drafter=str(DEFAULT_DRAFTER))
    # the embedded weights under a K2-format tokenizer: the grammar alone makes the replies well formed
    return kimi_jax.Model(m.config.replace(eos_token_ids=TOK.eos_ids), m.params, tokenizer=TOK, drafter=m.drafter)


def generate(model, prompts, reply_regex, temperature, seed=0, max_new=120):
    """``Model.generate``'s steps with the server's strict-tools grammar (``reply_regex``)."""
    request = model.resolve(model.prepare(prompts, max_new, "ddtree", 8, temperature, reply_regex=reply_regex))
    program, _ = model.program(request)
    state, _ = program(model.inputs(request, temperature, seed, reply_regex=reply_regex))
    n_out, out = jax.device_get((state.n_out, state.out))
    return [out[i, :n_out[i]].tolist() for i in range(len(prompts))]


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", "named"])
def test_every_forced_call_validates_greedy_and_sampled(model, choice):
    p = plan(NAMED if choice == "named" else "required", strict_add=True)
    prompts = [TOK.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) + p.prefill
               for q in ("Weather in Oslo?", "What is 2 + 3?", "Forecast for Tokyo, in f.")]
    schemas = {"get_weather": WEATHER, "add": ADD}
    whole_calls = ends = 0
    for temperature, seed in ((0.0, 0), (1.0, 1), (1.0, 2)):
        for prompt, tokens in zip(prompts, generate(model, [TOK.encode(x) for x in prompts], p.reply_regex(),
                                                    temperature, seed)):
            finished = bool(tokens) and tokens[-1] in TOK.eos_ids
            ends += finished
            reply = parse(p.prefill + TOK.decode(tokens[:-1] if finished else tokens))
            assert reply.calls, (temperature, TOK.decode(tokens))
            for call in reply.calls[:len(reply.calls) - (not finished)]:      # a cut reply's last call is partial
                assert call.invalid is None and (choice != "named" or call.name == "get_weather"), call
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])
                whole_calls += 1
    assert whole_calls >= 9
    if choice == "named":       # one call, then the section's end and eos: bounded, so every reply ends
        assert ends == 9
