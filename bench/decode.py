"""Decode benchmark on held-out prompts: AR vs DFlash chain vs DDTree budgets, and HF transformers generate.

    python -m bench.decode [--prompts 8] [--new-tokens 64] [--budgets 4,8,16,32,64,128,256] [--no-hf]

Greedy, a fixed number of new tokens (stop tokens disabled so every method emits the same count), batch 1, one
prompt at a time; methods interleaved per prompt and repeated (--repeats, the order rotated each time), the
best time of each counts. Every method's tokens are compared with our AR tokens; HF transformers (PyTorch CPU,
run by bench/hf_generate.py under --hf-python) generates from the same weights exported to HF format, and its
tokens are compared too. Times exclude compilation (programs are compiled ahead of time). Also measures what a round
of the auto program that runs width 0 (a tapped AR step: the drafter on but idle) costs against a plain AR
step. Prints one table and writes bench/results/decode_<backend>.json, the source of the README table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_methods(model, prompts, new_tokens, configs, repeats):
    """Every (method, budget) on every prompt, interleaved (prompt by prompt, config by config) and repeated:
    the best time of each (config, prompt) counts, so a slow spell of a shared machine hits all methods alike.
    -> {config: (tokens per prompt, seconds, mean tau, widths chosen, {stats' drafter: prompts})}."""
    for p in prompts:                                                      # compile (cached per shape)
        for method, budget in configs:
            model.generate([p], new_tokens, method=method, budget=budget)
    best = {c: [float("inf")] * len(prompts) for c in configs}
    runs = {}
    for r in range(repeats):
        # Each repeat rotates the order, so no config always runs first or right after the same one (a bias of
        # position would otherwise fall on the same method every time).
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for i, p in enumerate(prompts):
            for c in order:
                g = model.generate([p], new_tokens, method=c[0], budget=c[1])
                best[c][i] = min(best[c][i], g.stats["seconds"])
                runs[c, i] = g
    out = {}
    for c in configs:
        gens = [runs[c, i] for i in range(len(prompts))]
        taus = [t for g in gens for t in g.stats["tau_per_round"][0]]
        drafter = [g.stats["drafter"] for g in gens]
        out[c] = ([g.tokens[0] for g in gens], sum(best[c]), float(np.mean(taus)),
                  [w for g in gens for w in g.stats["width_per_round"]], {d: drafter.count(d) for d in set(drafter)})
    return out


def round_costs(model, prompts, new_tokens, repeats):
    """ms per round of a plain AR step (the ar program) and of a width-0 round of the auto program (width forced
    to 0: what a round that picks width 0 runs while the drafter is on: the target's feature taps and the
    drafter's feature commit, no draft), measured as the cost table is: each generation program with two round
    limits (prefill and launch cancel out), best of ``repeats``, the two programs interleaved, first prompt."""
    ar = model.prepare([prompts[0]], new_tokens, "ar")
    auto = model.prepare([prompts[0]], new_tokens, "ddtree", "auto")
    runs = {"ar_step": (ar, None, -1), "width0_round": (auto, np.asarray(model.cost_table(auto), np.float32), 0)}
    limits = (max(1, new_tokens // 8), new_tokens - 2)      # rounds of one token each: neither limit finishes
    best, ran = {}, {}
    for _ in range(repeats):
        for name, (request, costs, force) in runs.items():
            program, _ = model.program(request)
            for limit in limits:
                t0 = time.perf_counter()
                state, _ = program(model.inputs(request, costs=costs, force=force, max_rounds=limit))
                ran[name, limit] = int(state.rounds)           # waits for the program
                best[name, limit] = min(best.get((name, limit), float("inf")), time.perf_counter() - t0)
    lo, hi = limits
    ms = {name: 1e3 * (best[name, hi] - best[name, lo]) / (ran[name, hi] - ran[name, lo]) for name in runs}
    return dict(ms, ratio=ms["width0_round"] / ms["ar_step"])


def prompt_windows(tok, path, n, length):
    """n evenly spaced windows of `length` tokens from a text file (held-out text of the user's choice)."""
    ids = tok.encode(pathlib.Path(path).read_text())
    if len(ids) < length + 1:
        raise SystemExit(f"{path} has {len(ids)} tokens, fewer than one prompt of {length}")
    step = max(1, (len(ids) - length) // n)
    return [ids[i * step:i * step + length] for i in range(n)]


def run_hf(model, prompts, new_tokens, python):
    """Export the weights to HF format and time transformers' greedy generate in a Python with torch."""
    from kimi_jax.model.params import dequantize_experts
    from kimi_jax.weights.export import export_hf
    with tempfile.TemporaryDirectory() as d:
        params, cfg = dequantize_experts(model.params, model.config)
        export_hf(params, cfg, d, int4=False, prefix="", dtype="float32")
        req = os.path.join(d, "request.json")
        with open(req, "w") as f:
            json.dump({"prompts": prompts, "new_tokens": new_tokens}, f)
        res = subprocess.run([python, str(ROOT / "bench" / "hf_generate.py"), d, req], capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"HF generate failed: {res.stderr.strip().splitlines()[-1:]}")
        return json.loads(res.stdout.strip().splitlines()[-1])


def project_auto(model, prompts):
    """The auto policy under roofline costs of full K2.6 (TP-8) with this drafter's measured prior outlook."""
    from kimi_jax.analysis.roofline import projected_costs
    from kimi_jax.decoding import auto
    request = model.prepare([prompts[0]], 64, "ddtree", "auto")
    spec = request.spec
    prior = model.cost_table(request)[1]
    out = {}
    for hw in ("h200", "b300"):
        seconds = projected_costs(hw, spec.widths)
        i = auto.best_width(np.stack([seconds, prior]))
        out[hw] = dict(width=spec.widths[i], seconds_per_round=seconds.tolist(),
                       speedup_vs_ar=float(prior[i] / seconds[i] * seconds[0]))
    return out


def main(argv=None):
    import kimi_jax
    p = argparse.ArgumentParser(prog="python -m bench.decode")
    p.add_argument("--target", default=str(ROOT / "checkpoints" / "target"))
    p.add_argument("--drafter", default=str(ROOT / "checkpoints" / "drafter"))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--budgets", default="4,8,16,32,64,128,256")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repetitions; the best time counts")
    p.add_argument("--prompt-file", default=None,
                   help="take the prompts from this text (default: held-out stdlib files, never trained on)")
    p.add_argument("--hf-python", default="/tmp/venv311/bin/python",
                   help="a Python with torch + transformers for the HF baseline")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    model = kimi_jax.load(a.target, drafter=a.drafter)
    model = kimi_jax.Model(model.config.replace(eos_token_ids=()), model.params, model.tokenizer, model.drafter)
    from kimi_jax.training.corpus import heldout_prompts
    if a.prompt_file:
        prompts, text = prompt_windows(model.tokenizer, a.prompt_file, a.prompts, a.prompt_len), a.prompt_file
    else:
        prompts, text = heldout_prompts(model.tokenizer, a.prompts, a.prompt_len), "held-out stdlib files"
    rows = []
    configs = [("ar", None), ("ddtree", "auto"), ("dflash", None)] + [("ddtree", int(b)) for b in a.budgets.split(",")]
    results = run_methods(model, prompts, a.new_tokens, configs, a.repeats)
    ar_toks, ar_s, _, _, _ = results[("ar", None)]
    n_tok = a.prompts * a.new_tokens
    rows.append(dict(method="ar", budget=0, tokens_per_s=n_tok / ar_s, tau=1.0, equal_to_ar=True))
    for method, budget in configs[1:]:
        toks, s, tau, widths, drafter = results[(method, budget)]
        row = dict(method=method, budget=budget if budget is not None else model.drafter.config.block_size - 1,
                   tokens_per_s=n_tok / s, tau=tau, equal_to_ar=toks == ar_toks)
        if budget == "auto":
            row["widths_chosen"] = {int(w): widths.count(w) for w in sorted(set(widths))}
            row["drafter"] = drafter
        rows.append(row)
        print(f"  {method:6s} budget {str(row['budget']):>4s}: {row['tokens_per_s']:8.1f} tok/s  tau {tau:.2f}",
              file=sys.stderr)
    hf = None
    if not a.no_hf and os.path.exists(a.hf_python):
        hf = run_hf(model, prompts, a.new_tokens, a.hf_python)
        hf["equal_to_ar"] = hf.pop("tokens") == ar_toks
        hf["tokens_per_s"] = n_tok / hf["seconds"]
    ar_tps = rows[0]["tokens_per_s"]
    print(f"\nprompts from {text}: {a.prompts} x {a.prompt_len} tokens, {a.new_tokens} new tokens each, greedy, "
          f"batch 1, {jax.default_backend()} ({os.cpu_count()} cores)")
    print(f"{'method':8s} {'budget':>6s} {'tok/s':>9s} {'tau':>6s} {'vs AR':>7s} {'vs HF':>7s}  tokens == AR")
    for r in rows:
        vs_hf = f"{r['tokens_per_s'] / hf['tokens_per_s']:6.2f}x" if hf else "    n/a"
        print(f"{r['method']:8s} {str(r['budget']):>6s} {r['tokens_per_s']:9.1f} {r['tau']:6.2f} "
              f"{r['tokens_per_s'] / ar_tps:6.2f}x {vs_hf}  {r['equal_to_ar']}")
    if hf:
        print(f"{'hf':8s} {'':6s} {hf['tokens_per_s']:9.1f} {'':6s} {hf['tokens_per_s'] / ar_tps:6.2f}x "
              f"{1.0:6.2f}x  {hf['equal_to_ar']}   (transformers {hf['transformers']}, torch {hf['torch']})")
    fixed = [r for r in rows if r["method"] == "ddtree" and r["budget"] != "auto"]
    best = max(fixed, key=lambda r: r["tokens_per_s"])
    auto = next(r for r in rows if r["budget"] == "auto")
    print(f"ddtree auto: {auto['tokens_per_s'] / ar_tps:.2f}x AR, "
          f"{auto['tokens_per_s'] / best['tokens_per_s']:.2f}x the best fixed budget ({best['budget']}); "
          f"widths chosen {auto['widths_chosen']}; drafter per prompt {auto['drafter']}")
    rounds = round_costs(model, prompts, a.new_tokens, a.repeats)
    print(f"a width-0 round of the auto program (drafter on) {rounds['width0_round']:.3f} ms vs a plain AR step "
          f"{rounds['ar_step']:.3f} ms: {rounds['ratio']:.2f}x")
    projection = project_auto(model, prompts)
    for hw, pr in projection.items():
        print(f"  same policy on 8x {hw} (roofline costs, this drafter's outlook): picks width {pr['width']}, "
              f"{pr['speedup_vs_ar']:.2f}x AR")
    out = a.out or str(ROOT / "bench" / "results" / f"decode_{jax.default_backend()}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"command": "python -m bench.decode " + " ".join(argv or sys.argv[1:]), "prompts": a.prompts,
                   "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "text": text, "rows": rows, "hf": hf,
                   "auto_vs_ar": auto["tokens_per_s"] / ar_tps, "auto_vs_best_fixed": auto["tokens_per_s"] /
                   best["tokens_per_s"], "round_ms": rounds, "projection": projection,
                   "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
