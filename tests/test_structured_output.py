"""Structured output under DDTree on the embedded default: the tree keeps only prefixes the automaton allows,
verify masks every node by its state, and the walk stays exact, so greedy DDTree decodes what greedy AR decodes
under the same schema (token for token, at every budget), and every finished reply validates against its schema
(jsonschema, an independent validator) on held-out prompts, greedy and sampled."""

import json

import jsonschema
import pytest

from kimi_jax.cli.decode import DEFAULT_DRAFTER, DEFAULT_TARGET

# Slow: each test compiles its own programs of the embedded default (~20-50 s apiece on a 2-core VM). The fast loop
# has the parts: the automaton's tables and walks (test_grammar), the tree under an automaton (test_constrained_tree),
# DDTree sampling under a schema against AR's conditionals (test_processors' chi-square), an automaton in a batch's
# state (test_slot_buckets).
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (DEFAULT_TARGET / "kimi_config.json").exists(),
                                                   reason="embedded default not built")]

# A schema whose every reply is short (bounded strings, an enum, a boolean): all replies finish within MAX_NEW.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "kind", "hidden"],
          "properties": {"name": {"type": "string", "maxLength": 10}, "kind": {"enum": ["file", "dir", "link"]},
                         "hidden": {"type": "boolean"}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "entry", "schema": SCHEMA, "strict": True}}
MAX_NEW = 72
# Held-out prompts (written here, not from the training corpus).
PROMPTS = ["# one directory entry as JSON\nentry = ", "def describe(path):\n    return ", "config = json.loads(",
           "x = "]


@pytest.fixture(scope="module")
def model():
    import kimi_jax
    return kimi_jax.load(str(DEFAULT_TARGET), drafter=str(DEFAULT_DRAFTER))


def _reply(model, tokens):
    eos = set(model.config.eos_token_ids)
    assert tokens and tokens[-1] in eos, "the reply did not finish within MAX_NEW"
    return json.loads(model.tokenizer.decode([t for t in tokens if t not in eos]))


@pytest.mark.parametrize("budget", [0, 4, 32])
def test_greedy_ddtree_equals_greedy_ar_under_the_schema(model, budget):
    ar = model.generate(PROMPTS[:2], MAX_NEW, method="ar", response_format=FORMAT)
    tree = model.generate(PROMPTS[:2], MAX_NEW, method="ddtree", budget=budget, response_format=FORMAT)
    assert tree.tokens == ar.tokens
    plain = model.generate(PROMPTS[:2], MAX_NEW, method="ar")
    assert plain.tokens != ar.tokens                         # the schema changes what greedy decodes
    for tokens in ar.tokens:
        jsonschema.validate(_reply(model, tokens), SCHEMA)


def test_every_reply_validates_greedy_and_sampled(model):
    """All held-out prompts, greedy and three sampled seeds (with top_p, a processor beside the grammar)."""
    got = [model.generate(PROMPTS, MAX_NEW, method="ddtree", budget=8, response_format=FORMAT)]
    got += [model.generate(PROMPTS, MAX_NEW, method="ddtree", budget=8, temperature=1.0, seed=s, top_p=0.95,
                           response_format=FORMAT) for s in range(3)]
    replies = [_reply(model, tokens) for g in got for tokens in g.tokens]
    for reply in replies:
        jsonschema.validate(reply, SCHEMA)
    assert len({json.dumps(r, sort_keys=True) for r in replies}) > 2      # sampling does vary within the schema


def test_json_object_and_regex(model):
    out = model.generate(PROMPTS[:2], MAX_NEW, method="ddtree", budget=8, temperature=1.0, seed=1,
                         response_format={"type": "json_object"})
    eos = set(model.config.eos_token_ids)
    for tokens in out.tokens:                                 # finished replies parse; cut ones are a JSON prefix
        if tokens[-1] in eos:
            assert isinstance(_reply(model, tokens), dict)
        else:
            assert model.tokenizer.decode(tokens).startswith("{")
    out = model.generate(PROMPTS[:2], 24, method="ddtree", budget=8, regex=r"(yes|no), [0-9]{1,3}")
    import re
    for tokens in out.tokens:
        assert re.fullmatch(r"(yes|no), [0-9]{1,3}", model.tokenizer.decode([t for t in tokens if t not in eos]))


def test_stream_equals_generate_and_bad_schemas_are_clear(model):
    from kimi_jax.fields import GenerationError
    *chunks, final = model.stream(PROMPTS[0], MAX_NEW, method="ddtree", budget=8, response_format=FORMAT)
    want = model.generate(PROMPTS[0], MAX_NEW, method="ddtree", budget=8, response_format=FORMAT).tokens
    assert final.tokens == want and [t for c in chunks for t in c[0]] == want[0]
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 3}}}
    with pytest.raises(GenerationError, match="minimum"):
        model.generate(PROMPTS[0], 8, response_format=bad)
    request = model.prepare(PROMPTS[0], 8, "ar")
    with pytest.raises(GenerationError, match="prepared without structured output"):
        model.inputs(request, response_format=FORMAT)
