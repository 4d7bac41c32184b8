"""kimi_jax.text.grammar: response formats compiled to token automata on the embedded tokenizer.

Random walks through the device tables (uniform over the allowed tokens, batched through the jitted ``allowed``
and ``advance``) must decode to JSON that validates against the schema, or text that matches the regex; the tables
must agree with outlines-core's own Index state by state, and with Python's ``regex`` (partial matching) token by
token; the size limits and unsupported schema features must be clear GenerationErrors.
"""

from __future__ import annotations

import json
import pathlib
import re
import time

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import outlines_core
import pytest
import regex as regex_module

from kimi_jax.fields import GenerationError
from kimi_jax.text import grammar
from kimi_jax.text.tokenizer import KimiTokenizer, load_tokenizer

TARGET = pathlib.Path(__file__).resolve().parent.parent / "checkpoints" / "target"

SHORT = {"type": "string", "maxLength": 6}   # bounded strings keep uniform walks short
PERSON = {
    "type": "object",
    "properties": {"name": SHORT, "age": {"type": "integer"}, "color": {"enum": ["red", "green", "blue"]},
                   "tags": {"type": "array", "items": SHORT, "maxItems": 2}},
    "required": ["name", "age", "color", "tags"],
}
NESTED = {
    "type": "object",
    "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer"}, "email": SHORT},
                            "required": ["id", "email"]},
                   "active": {"type": "boolean"}, "score": {"type": ["number", "null"]}},
    "required": ["user", "active"],
}
TOOL_ARGS = {   # a tool call's arguments, as a function's "parameters"
    "type": "object",
    "properties": {"location": SHORT, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer"}},
    "required": ["location"], "additionalProperties": False,
}
REGEX = r"(yes|no): [a-z]{1,8}( [0-9]{1,3}){0,2}"


def json_schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TARGET)


@pytest.fixture(scope="module")
def cache():
    return grammar.GrammarCache()


_allowed = jax.jit(grammar.allowed)
_advance = jax.jit(grammar.advance)


def random_walks(tables, eos_ids, walks=24, max_tokens=120, seed=0):
    """Token lists of ``walks`` uniform random walks that ended with eos within ``max_tokens`` (eos dropped)."""
    rng = np.random.default_rng(seed)
    states = jnp.full((walks,), grammar.INITIAL_STATE, jnp.int32)
    tokens, done = [[] for _ in range(walks)], np.zeros(walks, bool)
    for _ in range(max_tokens):
        mask = np.asarray(_allowed(tables, states))
        assert mask[~done].any(axis=1).all(), "a live state allows nothing"
        chosen = np.array([rng.choice(np.flatnonzero(row)) for row in mask])
        for w in np.flatnonzero(~done):
            done[w] = chosen[w] in eos_ids
            if not done[w]:
                tokens[w].append(int(chosen[w]))
        states = _advance(tables, states, jnp.asarray(chosen, jnp.int32))
        assert (np.asarray(states) != grammar.DEAD_STATE).all()
        if done.all():
            break
    return [t for t, d in zip(tokens, done) if d]


@pytest.mark.parametrize("schema", [PERSON, NESTED, TOOL_ARGS], ids=["person", "nested", "tool_args"])
def test_walks_validate_against_the_schema(tokenizer, cache, schema):
    compiled = cache.get(tokenizer, json_schema_format(schema))
    finished = random_walks(compiled.tables, tokenizer.eos_ids)
    assert len(finished) >= 12
    for ids in finished:
        jsonschema.validate(json.loads(tokenizer.decode_bytes(ids).decode("utf-8")), schema)


def test_every_eos_id_ends_and_no_other_special_token_is_allowed(tokenizer):
    """Kimi's layout (two eos ids, [EOS] and <|im_end|>, among 256 specials): outlines-core knows one eos; the
    tables allow both exactly in the final states, and no other special id anywhere."""
    kimi = KimiTokenizer(tokenizer.ranks)
    assert len(kimi.eos_ids) == 2
    tables = grammar.GrammarCache().get(kimi, json_schema_format(TOOL_ARGS)).tables
    masks = np.asarray(_allowed(tables, jnp.arange(tables.next_state.shape[0])))
    for eos in kimi.eos_ids:
        assert masks[:, eos].tolist() == tables.final.tolist()
    others = [i for i in range(kimi.num_ranks, kimi.vocab_size) if i not in kimi.eos_ids]
    assert not masks[:, others].any()
    for ids in random_walks(tables, kimi.eos_ids):
        jsonschema.validate(json.loads(kimi.decode_bytes(ids).decode("utf-8")), TOOL_ARGS)


def test_json_object_walks_parse(tokenizer, cache):   # outlines-core takes a few seconds for the default depth
    finished = random_walks(cache.get(tokenizer, {"type": "json_object"}).tables, tokenizer.eos_ids, max_tokens=60)
    assert finished
    for ids in finished:
        assert isinstance(json.loads(tokenizer.decode_bytes(ids).decode("utf-8")), dict)


def test_json_object_nesting_bound():
    pattern = grammar.json_object_regex(2)
    assert re.fullmatch(pattern, '{"a": [1, {"b": null}], "c": {"d": "x"}}') is None    # three deep
    assert re.fullmatch(pattern, '{"a": [1, "b", true], "c": {"d": -2.5e+3}}')
    assert re.fullmatch(pattern, "{}") and not re.fullmatch(pattern, "[]")


def test_regex_walks_fullmatch(tokenizer, cache):
    compiled = cache.get(tokenizer, guided_regex=REGEX)
    finished = random_walks(compiled.tables, tokenizer.eos_ids)
    assert len(finished) >= 12
    for ids in finished:
        assert re.fullmatch(REGEX, tokenizer.decode_bytes(ids).decode("utf-8"))


@pytest.mark.parametrize("schema", [PERSON, NESTED, TOOL_ARGS], ids=["person", "nested", "tool_args"])
def test_tables_agree_with_outlines_index(tokenizer, cache, schema):
    """Walk outlines-core's own Index of the schema's regex and the tables in lockstep: the same allowed tokens at
    every step, the same verdict on random tokens, the same final states."""
    source = grammar.response_format_regex(json_schema_format(schema))
    tables = cache.get(tokenizer, json_schema_format(schema)).tables
    index = outlines_core.Index(source, grammar.outlines_vocabulary(tokenizer))
    rng = np.random.default_rng(1)
    for _ in range(6):
        reference, state = index.get_initial_state(), jnp.int32(grammar.INITIAL_STATE)
        while True:
            expected = sorted(index.get_allowed_tokens(reference))
            if index.is_final_state(reference):
                expected = sorted(set(expected) | set(tokenizer.eos_ids))
            assert np.flatnonzero(_allowed(tables, state)).tolist() == expected
            assert bool(grammar.is_final(tables, state)) == index.is_final_state(reference)
            strangers = rng.integers(0, tokenizer.vocab_size, 8)
            verdicts = _advance(tables, jnp.full(8, state), jnp.asarray(strangers, jnp.int32)) != grammar.DEAD_STATE
            assert verdicts.tolist() == [int(t) in expected for t in strangers]
            token = int(rng.choice([t for t in expected if t not in tokenizer.eos_ids] or expected))
            if token in tokenizer.eos_ids:
                break
            reference, state = index.get_next_state(reference, token), _advance(tables, state, jnp.int32(token))


def test_outlines_index_drops_tokens_after_a_complete_match(tokenizer, cache):
    """The outlines-core 0.2 bug the end mark works around: after "no: ab" (a complete match) its Index drops
    " ", whose text before the last byte is that match; the tables allow it (and it is right, see below)."""
    index = outlines_core.Index(REGEX, grammar.outlines_vocabulary(tokenizer))
    tables = cache.get(tokenizer, guided_regex=REGEX).tables
    reference, state = index.get_initial_state(), jnp.int32(grammar.INITIAL_STATE)
    for token in tokenizer.encode("no: ab"):
        reference, state = index.get_next_state(reference, token), _advance(tables, state, jnp.int32(token))
    space = tokenizer.encode(" ")[0]
    assert space not in index.get_allowed_tokens(reference)       # fixed upstream: this line will start failing
    assert bool(_allowed(tables, state)[space])


PERSON_FORMAT = json_schema_format(PERSON)


@pytest.mark.parametrize("request_kwargs, prefix", [
    *[({"guided_regex": REGEX}, p) for p in ["", "yes", "no: ab", "yes: abcdefgh", "no: a 12", "no: a 123 4"]],
    *[({"response_format": PERSON_FORMAT}, p) for p in ['{"name": "ab', '{"name": "", "age": 1',
                                                        '{"name": "x y", "age": -20, "color": "gr']],
])
def test_allowed_is_what_can_extend_the_prefix(tokenizer, cache, request_kwargs, prefix):
    """Brute force over the vocabulary: a token that is whole UTF-8 is allowed iff prefix + its text can still
    become a full match (Python regex's partial matching); eos iff the prefix is a full match. A token that is part
    of a character (byte-level BPE) is only allowed where the regex allows non-ASCII characters."""
    tables = cache.get(tokenizer, **request_kwargs).tables
    pattern = regex_module.compile(grammar.response_format_regex(**request_kwargs))
    state = jnp.asarray(grammar.INITIAL_STATE, jnp.int32)
    for token in tokenizer.encode(prefix):
        state = _advance(tables, state, jnp.int32(token))
    mask = np.asarray(_allowed(tables, state))
    for token in range(tokenizer.num_ranks):
        try:
            text = tokenizer.decode_bytes([token]).decode("utf-8")
        except UnicodeDecodeError:
            assert not mask[token] or pattern.fullmatch(prefix + "é", partial=True)
            continue
        assert mask[token] == (pattern.fullmatch(prefix + text, partial=True) is not None), (prefix, text)
    complete = pattern.fullmatch(prefix) is not None
    assert all(mask[e] == complete for e in tokenizer.eos_ids)
    assert not mask[tokenizer.num_ranks:].any() or complete
    assert bool(grammar.is_final(tables, state)) == complete


def test_device_ops_any_leading_shape_and_dead_state(tokenizer, cache):
    tables = jax.tree.map(jnp.asarray, cache.get(tokenizer, guided_regex=REGEX).tables)
    yes = tokenizer.encode("yes")[0]
    states = jnp.asarray([[0, 0, -1], [0, -1, 0]], jnp.int32)
    tokens = jnp.asarray([[yes, 5, yes], [yes, yes, tokenizer.eos_ids[0]]], jnp.int32)
    assert _allowed(tables, states).shape == (2, 3, tokenizer.vocab_size)
    assert not _allowed(tables, states)[0, 2].any()
    nxt = _advance(tables, states, tokens)
    assert nxt.shape == (2, 3) and nxt[0, 0] > 0 and nxt[0, 0] == nxt[1, 0]
    assert (nxt[0, 1:] == grammar.DEAD_STATE).all() and (nxt[1, 1:] == grammar.DEAD_STATE).all()


def test_cache_reuses_reports_and_evicts(tokenizer):
    cache = grammar.GrammarCache(max_entries=1)
    first = cache.get(tokenizer, guided_regex=REGEX)
    assert cache.get(tokenizer, guided_regex=REGEX) is first
    [line] = cache.report()
    assert line["device_bytes"] == first.device_bytes == cache.device_bytes > 0
    assert line["states"] == first.num_states and line["classes"] == first.num_classes
    cache.get(tokenizer, guided_regex="[0-9]+")
    assert len(cache.report()) == 1 and cache.get(tokenizer, guided_regex=REGEX) is not first
    assert cache.get(tokenizer, {"type": "text"}) is None and cache.get(tokenizer) is None


def test_limits_are_generation_errors(tokenizer):
    with pytest.raises(GenerationError, match=r"automaton has \d+ states, over the limit of 10"):
        grammar.GrammarCache(max_states=10).get(tokenizer, json_schema_format(PERSON))
    with pytest.raises(GenerationError, match=r"take \d+ device bytes .* over the limit of 1000"):
        grammar.GrammarCache(max_device_bytes=1000).get(tokenizer, json_schema_format(PERSON))


def test_huge_repetition_counts_are_refused_before_compiling(tokenizer):
    """maxLength 100,000 would keep outlines-core busy for hours; the count alone exceeds the state limit."""
    huge = json_schema_format({"type": "object", "properties": {"s": {"type": "string", "maxLength": 100_000}}})
    start = time.perf_counter()
    with pytest.raises(GenerationError, match="repetition count of 100000 .* limit of 20000"):
        grammar.GrammarCache().get(tokenizer, huge)
    assert time.perf_counter() - start < 1
    with pytest.raises(GenerationError, match="repetition count of 50 "):
        grammar.GrammarCache(max_states=40).get(tokenizer, guided_regex="a{2}b{3,50}")


@pytest.mark.parametrize("schema, named", [
    ({"not": {"type": "string"}}, "Unsupported JSON Schema structure"),
    ({"type": "string", "format": "ipv4"}, "Format ipv4 is not supported"),
    ({"$ref": "http://example.com/s.json"}, "Invalid reference path"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}, "#/properties/n/minimum"),
    ({"type": "object", "patternProperties": {"^a": {"type": "string"}}}, "#/patternProperties"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "#/uniqueItems"),
    ({"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "number", "maximum": 2}]}},
     "#/items/anyOf/1/maximum"),
    ({"$defs": {"n": {"type": "integer", "multipleOf": 2}}, "$ref": "#/$defs/n"}, "#/$defs/n/multipleOf"),
])
def test_unsupported_schema_features_are_named(tokenizer, schema, named):
    with pytest.raises(GenerationError, match=re.escape(named)):
        grammar.GrammarCache().get(tokenizer, json_schema_format(schema))


def test_keyword_names_as_property_names_and_enum_values_are_fine():
    schema = {"type": "object", "properties": {"minimum": {"type": "integer"},
                                               "m": {"enum": [{"maximum": 1}]}}, "required": ["minimum"]}
    assert re.fullmatch(grammar.response_format_regex(json_schema_format(schema)), '{"minimum": 3}')


@pytest.mark.parametrize("kwargs, message", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "not both"),
    ({"response_format": {"type": "yaml"}}, "must be text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "needs"),
    ({"guided_regex": ""}, "non-empty string"),
])
def test_bad_requests(kwargs, message):
    with pytest.raises(GenerationError, match=message):
        grammar.response_format_regex(**kwargs)


def test_bad_regex_is_a_generation_error(tokenizer):
    with pytest.raises(GenerationError, match="cannot compile the regex"):
        grammar.GrammarCache().get(tokenizer, guided_regex="(unclosed")
