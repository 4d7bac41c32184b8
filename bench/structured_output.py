"""Compile time and device-table sizes of structured-output automata (kimi_jax.text.grammar), and the jitted
``allowed`` / ``advance`` time for a round's [batch, nodes] states.

    JAX_PLATFORMS=cpu python -m bench.structured_output [--tokenizer DIR | --ranks FILE] [--json out.json]

``--ranks`` takes a Kimi-format ranks file (``base64 rank`` lines) and builds a KimiTokenizer from it (163,584
ranks + 256 specials is K2's layout); docs/structured_output.md says which vocabularies the numbers are for.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import outlines_core

from kimi_jax.text import grammar
from kimi_jax.text.tokenizer import KimiTokenizer, load_tokenizer, read_ranks

TOOL_ARGS = {   # a web-search tool's "parameters", as agents send them
    "type": "object",
    "properties": {
        "query": {"type": "string", "description": "what to search for"},
        "num_results": {"type": "integer"},
        "recency": {"type": "string", "enum": ["day", "week", "month", "year", "any"]},
        "domains": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "safe_search": {"type": "boolean"},
    },
    "required": ["query"], "additionalProperties": False,
}
RECORD = {      # enums, arrays, a nested object
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                           "pattern": "[0-9]{5}"}},
                    "required": ["city", "zip"]},
        "scores": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags", "address"],
}


def sources() -> dict[str, str]:
    schema = lambda s: grammar.response_format_regex({"type": "json_schema", "json_schema": {"schema": s}})
    return {"tool_args": schema(TOOL_ARGS), "record": schema(RECORD),
            "json_object depth 2": grammar.json_object_regex(2),
            f"json_object depth {grammar.JSON_OBJECT_DEPTH} (default)": grammar.json_object_regex(),
            "regex": r"(yes|no): [a-z]{1,8}( [0-9]{1,3}){0,2}"}


def measure(name: str, regex: str, tokenizer, vocabulary) -> dict:
    start = time.perf_counter()
    index = outlines_core.Index(regex, vocabulary)
    index_seconds = time.perf_counter() - start
    compiled = grammar.compile_grammar(regex, tokenizer, vocabulary)
    row = {"name": name, "regex_chars": len(regex), "outlines_states": len(index.get_transitions()),
           "states": compiled.num_states, "classes": compiled.num_classes, "device_bytes": compiled.device_bytes,
           "index_seconds": round(index_seconds, 2), "compile_seconds": round(compiled.compile_seconds, 2)}
    print(json.dumps(row), flush=True)
    return row, compiled


def time_round(tables, vocab: int, batch: int, nodes: int, iters: int = 20) -> dict:
    """ms per jitted call of allowed (and of advance) on [batch, nodes] states, on this backend."""
    tables = jax.tree.map(jnp.asarray, tables)
    states = jnp.asarray(np.random.default_rng(0).integers(0, tables.next_state.shape[0], (batch, nodes)), jnp.int32)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, vocab, (batch, nodes)), jnp.int32)
    out = {}
    for name, fn, args in [("allowed_ms", jax.jit(grammar.allowed), (tables, states)),
                           ("advance_ms", jax.jit(grammar.advance), (tables, states, tokens))]:
        jax.block_until_ready(fn(*args))
        t0 = time.perf_counter()
        for _ in range(iters):
            jax.block_until_ready(fn(*args))
        out[name] = round(1e3 * (time.perf_counter() - t0) / iters, 3)
    return {"batch": batch, "nodes": nodes, **out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default="checkpoints/target")
    ap.add_argument("--ranks", default=None, help="a Kimi-format ranks file (overrides --tokenizer)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tokenizer = KimiTokenizer(read_ranks(args.ranks)) if args.ranks else load_tokenizer(args.tokenizer)
    start = time.perf_counter()
    vocabulary = grammar.outlines_vocabulary(tokenizer)
    print(f"{tokenizer!r}; outlines vocabulary in {time.perf_counter() - start:.2f} s", flush=True)
    rows, last = [], None
    for name, regex in sources().items():
        row, compiled = measure(name, regex, tokenizer, vocabulary)
        rows.append(row)
        last = last or compiled
    rounds = [time_round(last.tables, tokenizer.vocab_size, b, n) for b, n in [(1, 64), (8, 64)]]
    print(json.dumps(rounds))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"tokenizer": repr(tokenizer), "automata": rows, "rounds": rounds}, fh, indent=1)


if __name__ == "__main__":
    main()
