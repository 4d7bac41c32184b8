"""Structured output: a request's ``response_format`` (or regex) compiled to a token-level automaton, as device tables.

The host side turns a JSON schema (or ``json_object``, or a regex) into a regex, and the regex into a token-level
DFA with outlines-core (``json_schema.build_regex_from_schema``, ``Index``); this module re-packs that DFA into
three dense arrays a jitted round can index for every tree node at once (:class:`GrammarTables`):

* ``token_class [V] int32``: tokens whose transition column is identical in every state share a class (all the
  tokens that are letters-only inside a JSON string, say); K2's 163,840 tokens become a few hundred classes.
* ``next_state [S, C] int32``: the state after a token of class ``c`` in state ``s``; -1 = the token is not allowed.
* ``final [S] bool``: generation may end here (these states, and only these, allow the tokenizer's eos ids).

Both device operations read the one class table (see :func:`allowed` and :func:`advance`): a node's allowed mask is
its ``C``-long row gathered once, then spread to the vocabulary through ``token_class`` (the same ``V`` indices for
every node, so they stay in cache); advancing is two scalar gathers. A per-state bitmask ``[S, V/32]`` (xgrammar's
layout) would cost ``V/8`` bytes a state (20 KiB for K2) next to ``4*C`` here, and still need the class table (or a
second one) for ``advance``; the class row is smaller whenever ``C < V/32`` (5,120 for K2), which every schema
measured in docs/structured_output.md is far below.

State 0 is the initial state; -1 is the dead state (nothing allowed, stays dead), what ``advance`` returns for a
token the automaton rejects. :class:`GrammarCache` compiles each (source, tokenizer) once and bounds the size.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import re
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
import outlines_core
from outlines_core import json_schema

from kimi_jax.fields import GenerationError
from kimi_jax.text.reply_format import MARKERS

__all__ = [
    "GrammarTables", "CompiledGrammar", "GrammarCache", "INITIAL_STATE", "DEAD_STATE", "JSON_OBJECT_DEPTH",
    "WHITESPACE", "json_object_regex", "response_format_regex", "unsupported_schema_keywords",
    "MARKER_CHARS", "schema_regex", "outlines_vocabulary", "automaton_tables", "largest_repeat_count",
    "compile_grammar", "allowed", "advance", "is_final",
]

INITIAL_STATE = 0
DEAD_STATE = -1

# Between JSON tokens at most one space, as outlines-core's default: an unbounded whitespace loop lets a model pad
# forever (the known failure of [ \n\t]*), and every optional character multiplies the states of a nested object.
WHITESPACE = r"[ ]?"

# json_object: any JSON object whose objects and arrays nest at most this deep (the outer object counts as 1).
# A regex cannot count brackets, so a bound is needed; outlines-core's regex-to-DFA step grows about 40x a level
# (each level holds an object and an array, each with a first and a later element: 4 copies of the level below):
# depth 3 compiles in 3-11 s (embedded to K2-sized vocabulary), depth 4 in minutes (docs/structured_output.md).
JSON_OBJECT_DEPTH = 3

# Keywords outlines-core accepts but silently drops (found by trying: the regex it builds ignores them), so its
# output could break the schema; they are refused instead. What it refuses itself (not, if/then/else, allOf with
# bare constraints, unknown formats, external $ref) comes back as its own error, wrapped.
UNSUPPORTED_KEYWORDS = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems", "contains",
    "minContains", "maxContains", "patternProperties", "propertyNames", "dependentRequired", "dependentSchemas",
    "minProperties", "maxProperties",
})
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else")


class GrammarTables(NamedTuple):
    """The device tables (a pytree: pass it into jitted functions as numpy or jax arrays)."""
    token_class: Any   # [V] int32
    next_state: Any    # [S, C] int32, DEAD_STATE where the class is not allowed
    final: Any         # [S] bool


@dataclasses.dataclass(frozen=True)
class CompiledGrammar:
    """One compiled automaton: the regex it was built from, its tables (numpy) and what the build cost."""
    regex: str
    tables: GrammarTables
    compile_seconds: float

    @property
    def num_states(self) -> int:
        return self.tables.next_state.shape[0]

    @property
    def num_classes(self) -> int:
        return self.tables.next_state.shape[1]

    @property
    def device_bytes(self) -> int:
        return sum(a.nbytes for a in self.tables)


# ----------------------------------------------------------------------------- response_format -> regex

def json_object_regex(depth: int = JSON_OBJECT_DEPTH, ws: str = WHITESPACE) -> str:
    """A regex for any JSON object with objects/arrays nested at most ``depth`` deep (outlines' scalar regexes)."""
    def value(d: int) -> str:
        scalars = [json_schema.STRING, json_schema.NUMBER, "true", "false", "null"]
        return "(" + "|".join(scalars + ([obj(d), arr(d)] if d > 0 else [])) + ")"

    def obj(d: int) -> str:
        member = f"{json_schema.STRING}{ws}:{ws}{value(d - 1)}"
        return rf"\{{{ws}({member}({ws},{ws}{member})*)?{ws}\}}"

    def arr(d: int) -> str:
        return rf"\[{ws}({value(d - 1)}({ws},{ws}{value(d - 1)})*)?{ws}\]"

    return obj(depth)


def _subschemas(schema: dict) -> Iterator[tuple[str, Any]]:
    """(relative path, subschema) of each place a schema holds schemas (enum and const values are data)."""
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            yield from ((f"{key}/{name}", sub) for name, sub in schema[key].items())
    for key in _SUBSCHEMA_LISTS + _SUBSCHEMA_ONE:
        value = schema.get(key)
        yield from ((f"{key}/{i}", sub) for i, sub in enumerate(value)) if isinstance(value, list) else [(key, value)]


def unsupported_schema_keywords(schema: Any, path: str = "#") -> list[str]:
    """``path/keyword`` of each keyword in UNSUPPORTED_KEYWORDS, following only subschema positions (a property
    named "minimum" is not the keyword)."""
    if not isinstance(schema, dict):
        return []
    found = [f"{path}/{k}" for k in schema if k in UNSUPPORTED_KEYWORDS]
    for where, sub in _subschemas(schema):
        found += unsupported_schema_keywords(sub, f"{path}/{where}")
    return found


def schema_regex(schema: Any, where: str = "response_format json_schema.schema") -> str:
    """The regex of a JSON schema (``where`` names it in errors)."""
    if not isinstance(schema, (dict, bool)):
        raise GenerationError(f"{where} must be a JSON object, got {type(schema).__name__}")
    bad = unsupported_schema_keywords(schema)
    if bad:
        raise GenerationError(f"{where}: structured output does not support these JSON-schema keywords "
                              f"(outlines-core would ignore them and could break the schema): {', '.join(bad)}")
    try:
        return json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern=WHITESPACE)
    except ValueError as e:   # outlines-core's refusals: "Unsupported JSON Schema structure {...}", "Format ...", ...
        raise GenerationError(f"{where}: structured output does not support this JSON schema: "
                              f"{str(e).splitlines()[0]}") from e


def response_format_regex(response_format: dict | None = None, guided_regex: str | None = None) -> str | None:
    """The regex a request's output must match; None when it is unconstrained (no format, or ``{"type": "text"}``).

    ``response_format`` is OpenAI's: ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
    {"schema": ..., "strict": ...}}``; ``guided_regex`` is vLLM's field. The schema is always enforced, whatever
    ``strict`` says (vLLM does the same).
    """
    if response_format is not None and guided_regex is not None:
        raise GenerationError("give response_format or guided_regex, not both")
    if guided_regex is not None:
        if not isinstance(guided_regex, str) or not guided_regex:
            raise GenerationError("guided_regex must be a non-empty string")
        return guided_regex
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_regex()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise GenerationError('response_format json_schema needs {"json_schema": {"schema": {...}}}')
        return schema_regex(spec["schema"])
    raise GenerationError(f"response_format type must be text, json_object or json_schema, got {kind!r}")


# ----------------------------------------------------------------------------- regex -> token automaton

# outlines-core 0.2.x (0.2.14 included) drops every token whose bytes before the last one complete a match (the
# byte DFA reports matches one byte late, and Index::new keeps no token ending in such a state; fixed upstream in
# commit 2ba0b24, unreleased): after "no: ab" for "(yes|no): [a-z]+( [0-9]+)?" the token " " is missing. Compiling
# the regex followed by an end mark (a NUL, which no JSON text holds) puts the only match after the mark, so no
# token of the real text is dropped; the tables then read "final" as "the end mark is allowed here" and drop the
# mark's own transitions (so a NUL is never generated).
END_MARK = "\\x00"


def end_marked(regex: str) -> str:
    """``regex`` (anchors at its ends removed: it is always matched whole) followed by the end mark."""
    core = regex.removeprefix("^")
    core = core[:-1] if core.endswith("$") and not core.endswith("\\$") else core
    return f"(?:{core}){END_MARK}"


# A reply regex (``reply_regex``: a whole chat reply, tool calls included) names K2's reply markers, which are
# special tokens, as these control characters; its vocabulary maps each marker's token to its character and leaves
# out the ranks whose bytes hold one, so a marker can only be the special token itself (JSON never holds a raw
# control character, and K2's call headers are names and digits).
MARKER_CHARS = {marker: chr(1 + i) for i, marker in enumerate(MARKERS)}
_MARKER_BYTES = frozenset(ord(c) for c in MARKER_CHARS.values())


def outlines_vocabulary(tokenizer, markers: bool = False) -> outlines_core.Vocabulary:
    """outlines-core's view of a kimi_jax tokenizer: every rank's bytes; the first eos id stands for all of them
    (:func:`automaton_tables` gives the others its transitions). Other special tokens are never allowed, but for
    ``markers=True``: K2's reply markers as ``MARKER_CHARS`` (and no rank holding one of those bytes)."""
    ids_by_bytes: dict[bytes, list[int]] = {}
    for token_id in range(tokenizer.num_ranks):
        token = tokenizer.decode_bytes([token_id])
        if not (markers and _MARKER_BYTES.intersection(token)):
            ids_by_bytes.setdefault(token, []).append(token_id)
    if markers:
        missing = [m for m in MARKERS if m not in tokenizer.special_tokens]
        if missing:
            raise GenerationError(f"this tokenizer has no K2 reply markers {missing}: no strict tool calls")
        for marker, char in MARKER_CHARS.items():
            ids_by_bytes[char.encode()] = [tokenizer.special_tokens[marker]]
    if b"\x00" not in ids_by_bytes:
        raise ValueError(f"{tokenizer!r} has no single-byte NUL token, which the end mark needs (byte-level BPE has)")
    return outlines_core.Vocabulary(tokenizer.eos_ids[0], ids_by_bytes)


def _transitions(index: outlines_core.Index, end_token: int, eos_ids: tuple[int, ...]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(state, token, next state) of every transition of the text before the end mark, with dense state numbers
    (the initial state is 0), eos looping on the states where the end mark was allowed; and those states."""
    table, done = index.get_transitions(), set(index.get_final_states())   # done: the end mark has been read
    final_ids = {s for s, row in table.items() if row.get(end_token) in done}
    rows = {s: [(t, d) for t, d in row.items() if d not in done] for s, row in table.items() if s not in done}
    for s in final_ids:
        rows[s] += [(e, s) for e in eos_ids]
    initial = index.get_initial_state()
    state_ids = [initial] + sorted((set(rows) | {d for row in rows.values() for _, d in row}) - {initial})
    dense = {s: i for i, s in enumerate(state_ids)}
    src = np.fromiter((dense[s] for s, row in rows.items() for _ in row), np.int32)
    tok = np.fromiter((t for row in rows.values() for t, _ in row), np.int32)
    dst = np.fromiter((dense[d] for row in rows.values() for _, d in row), np.int32)
    return src, tok, dst, np.isin(state_ids, list(final_ids))


def _token_classes(src: np.ndarray, tok: np.ndarray, dst: np.ndarray, num_states: int, vocab_size: int) -> np.ndarray:
    """``token_class [V]``: equal for tokens with the same (state -> next state) column, by a 64-bit hash of the
    column (a random weight per state times next state + 1, summed); :func:`automaton_tables` checks it exactly."""
    weights = np.random.default_rng(0).integers(1, 2**63, num_states, dtype=np.uint64) | np.uint64(1)
    column_hash = np.zeros(vocab_size, np.uint64)
    np.add.at(column_hash, tok, weights[src] * (dst.astype(np.uint64) + np.uint64(1)))
    _, token_class = np.unique(column_hash, return_inverse=True)
    return token_class.astype(np.int32)


def _minimize(next_state: np.ndarray, final: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge equivalent states (Moore's partition refinement): outlines-core's DFA is not minimal, a list's first
    and later elements get copies of the same states (json_object: 5x the states). Returns the merged
    ``next_state`` and ``final``; the initial state stays 0."""
    part = final.astype(np.int64)
    while True:
        successor = np.where(next_state >= 0, part[np.maximum(next_state, 0)], DEAD_STATE)
        _, refined = np.unique(np.column_stack([part, successor]), axis=0, return_inverse=True)
        if refined.max() == part.max():   # refined splits part: the same count means the same partition
            break
        part = refined.ravel()
    _, first_state = np.unique(part, return_index=True)
    order = np.argsort(first_state)        # blocks by their first state, so state 0's block is block 0
    block_of = np.empty_like(order)
    block_of[order] = np.arange(len(order))
    representative = first_state[order]
    rows = next_state[representative]
    merged = np.where(rows >= 0, block_of[part[np.maximum(rows, 0)]], DEAD_STATE).astype(np.int32)
    return merged, final[representative]


def automaton_tables(index: outlines_core.Index, vocab_size: int, eos_ids: tuple[int, ...], end_token: int
                     ) -> GrammarTables:
    """The minimal device tables of an outlines-core index built on an :func:`end_marked` regex."""
    src, tok, dst, final = _transitions(index, end_token, eos_ids)
    num_states = len(final)
    token_class = _token_classes(src, tok, dst, num_states, vocab_size)
    next_state = np.full((num_states, int(token_class.max()) + 1), DEAD_STATE, np.int32)
    next_state[src, token_class[tok]] = dst
    # Exact check of the hash: every transition is in the table, and no token has fewer than its class's row.
    per_token = np.bincount(tok, minlength=vocab_size)
    per_class = (next_state != DEAD_STATE).sum(0)
    if not (np.array_equal(next_state[src, token_class[tok]], dst) and np.array_equal(per_token,
                                                                                     per_class[token_class])):
        raise RuntimeError("token classes: 64-bit column hash collision (report this schema)")
    next_state, final = _minimize(next_state, final)
    # Merging states can make columns equal: merge their classes too.
    next_state, class_of = np.unique(next_state, axis=1, return_inverse=True)
    return GrammarTables(class_of.ravel()[token_class].astype(np.int32), np.ascontiguousarray(next_state), final)


def largest_repeat_count(regex: str) -> int:
    """The largest count in the regex's counted repetitions (``{n}``, ``{m,n}``, ``{m,}``): a DFA needs at least
    that many states to count it (a JSON string's maxLength takes about 10 a character: UTF-8's byte states)."""
    counts = [int(hi or lo) for lo, hi in re.findall(r"(?<!\\)\{(\d+)(?:,(\d*))?\}", regex)]
    return max(counts, default=0)


def compile_grammar(regex: str, tokenizer, vocabulary: outlines_core.Vocabulary | None = None, *,
                    max_states: int | None = None, max_device_bytes: int | None = None,
                    markers: bool = False) -> CompiledGrammar:
    """The automaton of ``regex`` over ``tokenizer``; GenerationError past a limit or for a regex outlines-core
    cannot compile. Counted repetitions are checked against ``max_states`` first: outlines-core would spend
    minutes on a ``maxLength`` of 10,000 before the states could be counted."""
    if max_states is not None and largest_repeat_count(regex) > max_states:
        raise GenerationError(f"structured output: a repetition count of {largest_repeat_count(regex)} (maxLength, "
                              f"maxItems or a pattern) needs more automaton states than the limit of {max_states}")
    start = time.perf_counter()
    vocabulary = vocabulary or outlines_vocabulary(tokenizer, markers)
    try:
        index = outlines_core.Index(end_marked(regex), vocabulary)
    except (ValueError, RuntimeError) as e:
        raise GenerationError(f"structured output: cannot compile the regex: {str(e).splitlines()[0]}") from e
    end_token = vocabulary.get(b"\x00")[0]
    tables = automaton_tables(index, tokenizer.vocab_size, tokenizer.eos_ids, end_token)
    compiled = CompiledGrammar(regex, tables, time.perf_counter() - start)
    if max_states is not None and compiled.num_states > max_states:
        raise GenerationError(f"structured output automaton has {compiled.num_states} states, over the limit of "
                              f"{max_states}; simplify the schema (fewer optional fields, shorter enums and bounds)")
    if max_device_bytes is not None and compiled.device_bytes > max_device_bytes:
        raise GenerationError(f"structured output tables take {compiled.device_bytes} device bytes "
                              f"({compiled.num_states} states x {compiled.num_classes} token classes), over the "
                              f"limit of {max_device_bytes}; simplify the schema")
    return compiled


class GrammarCache:
    """Compiled automata by (response format or regex text, tokenizer contents), least recently used dropped
    past ``max_entries``; ``max_states`` and ``max_device_bytes`` bound each automaton (GenerationError)."""

    def __init__(self, max_states: int = 20_000, max_device_bytes: int = 64 << 20, max_entries: int = 64):
        self.max_states, self.max_device_bytes, self.max_entries = max_states, max_device_bytes, max_entries
        self._entries: collections.OrderedDict[tuple[str, str], CompiledGrammar] = collections.OrderedDict()
        self._vocabularies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()      # the server's HTTP side compiles, its batcher thread reads

    def _vocabulary(self, tokenizer, markers: bool) -> tuple[str, outlines_core.Vocabulary]:
        if markers not in self._vocabularies.setdefault(tokenizer, {}):
            # The tokenizer's identity is its contents: two loads of one checkpoint share the compiled automata.
            digest = hashlib.sha256(repr((tokenizer.vocab_size, tokenizer.eos_ids, markers)).encode())
            for token_id in range(tokenizer.num_ranks):
                token = tokenizer.decode_bytes([token_id])
                digest.update(len(token).to_bytes(4, "little") + token)
            if markers:
                digest.update(repr(sorted(tokenizer.special_tokens.items())).encode())
            self._vocabularies[tokenizer][markers] = (digest.hexdigest(), outlines_vocabulary(tokenizer, markers))
        return self._vocabularies[tokenizer][markers]

    def get(self, tokenizer, response_format: dict | None = None, guided_regex: str | None = None,
            reply_regex: str | None = None) -> CompiledGrammar | None:
        """The automaton a request asks for (None: unconstrained), compiled on first use. ``reply_regex``: a
        whole chat reply with K2's markers as ``MARKER_CHARS`` (``kimi_jax.serving.tools``: strict tool calls),
        instead of the other two."""
        if reply_regex is not None and (response_format is not None or guided_regex is not None):
            raise GenerationError("a reply regex holds the reply's format itself: give it alone")
        regex = reply_regex or response_format_regex(response_format, guided_regex)
        if regex is None:
            return None
        with self._lock:
            return self._get(regex, tokenizer, reply_regex is not None)

    def _get(self, regex: str, tokenizer, markers: bool = False) -> CompiledGrammar:
        fingerprint, vocabulary = self._vocabulary(tokenizer, markers)
        key = (regex, fingerprint)
        if key not in self._entries:
            self._entries[key] = compile_grammar(regex, tokenizer, vocabulary, max_states=self.max_states,
                                                 max_device_bytes=self.max_device_bytes, markers=markers)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        self._entries.move_to_end(key)
        return self._entries[key]

    def report(self) -> list[dict[str, Any]]:
        """One line per cached automaton: its size on the device and what it cost to build."""
        return [{"regex_chars": len(c.regex), "states": c.num_states, "classes": c.num_classes,
                 "device_bytes": c.device_bytes, "compile_seconds": round(c.compile_seconds, 3)}
                for c in self._entries.values()]

    @property
    def device_bytes(self) -> int:
        return sum(c.device_bytes for c in self._entries.values())


# ----------------------------------------------------------------------------- device operations (jnp, jit-able)

def allowed(tables: GrammarTables, states):
    """bool ``[..., V]``: the tokens each state allows (none for DEAD_STATE). One ``C``-row gather per state, then
    the row spread over the vocabulary by ``token_class``."""
    rows = jnp.asarray(tables.next_state)[jnp.maximum(states, 0)] != DEAD_STATE          # [..., C]
    return jnp.take(rows, jnp.asarray(tables.token_class), axis=-1) & (states >= 0)[..., None]


def advance(tables: GrammarTables, states, tokens):
    """int32 ``[...]``: the state after ``tokens`` (DEAD_STATE for a token the state does not allow)."""
    token_class = jnp.asarray(tables.token_class)[tokens]
    nxt = jnp.asarray(tables.next_state)[jnp.maximum(states, 0), token_class]
    return jnp.where(states >= 0, nxt, DEAD_STATE)


def is_final(tables: GrammarTables, states):
    """bool ``[...]``: generation may stop here (the state allows eos)."""
    return jnp.asarray(tables.final)[jnp.maximum(states, 0)] & (states >= 0)
