"""What structured output costs the tree: mean tokens per round (tau) and tokens/s of DDTree with and without a
schema, on the embedded default.

    python -m bench.structured_tau [--prompts 8] [--new-tokens 64] [--budget 16]

Held-out prompts (64-token windows of text the embedded default never trained on,
``kimi_jax.training.corpus.heldout_prompts``), greedy, one batch; for each format (none, json_object, a tool's
arguments schema, an object of enums) the same prompts through ``Model.generate``, a warm-up call first so no
compile is timed. tau falls where the drafter's favourite continuations are ones the schema refuses (the tree
then spends its budget on the allowed ones, which the drafter ranks lower) and rises where the schema leaves one
choice (quotes, keys, braces the drafter needs not guess). One run on this machine; ratios within it only.
JSON goes to bench/results/structured_tau_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os

FORMATS = {
    "none": None,
    "json_object": {"type": "json_object"},
    "tool_arguments": {"type": "json_schema", "json_schema": {"name": "search", "schema": {
        "type": "object", "additionalProperties": False, "required": ["query"],
        "properties": {"query": {"type": "string", "maxLength": 40}, "limit": {"type": "integer"},
                       "recent": {"type": "boolean"}}}}},
    "enums": {"type": "json_schema", "json_schema": {"name": "entry", "schema": {
        "type": "object", "additionalProperties": False, "required": ["kind", "mode", "size"],
        "properties": {"kind": {"enum": ["file", "directory", "symlink"]}, "mode": {"enum": ["read", "write"]},
                       "size": {"enum": ["small", "medium", "large"]}}}}},
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=16)
    a = ap.parse_args(argv)
    import kimi_jax
    from kimi_jax.training.corpus import heldout_prompts
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    model = kimi_jax.load(os.path.join(root, "checkpoints", "target"), drafter=os.path.join(root, "checkpoints",
                                                                                               "drafter"))
    prompts = heldout_prompts(model.tokenizer, a.prompts, 64)
    rows = []
    for name, fmt in FORMATS.items():
        kw = dict(method="ddtree", budget=a.budget, response_format=fmt)
        model.generate(prompts, a.new_tokens, **kw)                       # compile, not timed
        out = model.generate(prompts, a.new_tokens, **kw)
        rows.append(dict(format=name, mean_tau=round(out.stats["mean_tau"], 3),
                         tokens_per_s=round(out.stats["tokens_per_s"], 1), new_tokens=out.stats["new_tokens"]))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    for r in rows:
        r["tau_vs_none"] = round(r["mean_tau"] / base["mean_tau"], 3)
        r["tokens_per_s_vs_none"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
    result = dict(rows=rows, prompts=f"heldout_prompts({a.prompts}, 64 tokens)", budget=a.budget,
                  new_tokens=a.new_tokens, greedy=True)
    print(json.dumps([{k: r[k] for k in ("format", "mean_tau", "tau_vs_none", "tokens_per_s_vs_none")}
                      for r in rows]))
    os.makedirs(os.path.join(root, "bench", "results"), exist_ok=True)
    with open(os.path.join(root, "bench", "results", "structured_tau_cpu.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
