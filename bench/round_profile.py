"""Where a decoding round's time goes: each stage inside the compiled round, per budget, on this backend.

    python -m bench.round_profile [--budgets 1,4,16,64,256] [--widths 1,2,4,...,257] [--tag before]

Method (XLA's profiler, not stage-subset programs): the round's steps run under ``jax.named_scope``
(draft, build_tree, verify, accept, commit, choose_width). For each budget this script compiles
``bench.steady.steady_rounds_program`` (rounds from fixed committed lengths, so every round does the same work),
times R1 and R2 rounds to get the round's wall time, then records one run with ``jax.profiler`` and sums the
*self* time of every executed HLO instruction, mapped to its stage through the ``op_name`` metadata of the
compiled HLO. Stage milliseconds = the stage's share of profiled self time x the measured round time (the
profiler adds a little time per op, so shares are used, not its absolute durations).

The verify forward alone is timed at each width (a tree of that many tokens: causal mask, taps on) in a
fori_loop whose inputs are made loop-variant so XLA cannot hoist the work out of the loop.

Prompt: a 64-token held-out window (kimi_jax.training.corpus.heldout_prompts), cache sized as bench.decode sizes it
for 64 new tokens. Writes bench/results/round_profile_<backend>[_tag].json and docs/round_profile[_tag].png.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import os
import pathlib
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
STAGES = ("draft", "build_tree", "choose_width", "verify", "accept", "commit")


def _best_time(fn, repeats=5):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def stage_of_instructions(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the first stage scope in its op_name metadata (``thunks.scopes``, the one
    reader of scope paths). Instructions that XLA created without metadata (rewritten dots, copies) take the
    most common stage of their computation."""
    from kimi_jax.analysis.thunks import scopes
    named = scopes(hlo_text, STAGES)
    stage, comp_of, votes = {}, {}, collections.defaultdict(collections.Counter)
    comp = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            comp = head.group(1)
            continue
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        if not m:
            continue
        name = m.group(1)
        comp_of[name] = comp
        if name in named:
            stage[name] = named[name].split("/")[0] or "other"
            votes[comp][stage[name]] += 1
    for name, c in comp_of.items():
        if name not in stage:
            stage[name] = votes[c].most_common(1)[0][0] if votes[c] else "other"
    return stage


def self_times(trace_dir: str) -> dict[str, float]:
    """Self time (us) of every complete event name in the newest trace: duration minus nested events."""
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))[-1]
    events = [e for e in json.load(gzip.open(path))["traceEvents"] if e.get("ph") == "X"]
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    totals = collections.Counter()
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []   # [end, name, duration, time of nested events]
        for e in evs:
            start, end = e["ts"], e["ts"] + e["dur"]
            while stack and stack[-1][0] <= start:
                s_end, s_name, s_dur, s_child = stack.pop()
                totals[s_name] += s_dur - s_child
            if stack:
                stack[-1][3] += e["dur"]
            stack.append([end, e["name"], e["dur"], 0.0])
        while stack:
            s_end, s_name, s_dur, s_child = stack.pop()
            totals[s_name] += s_dur - s_child
    return totals


def profile_round(model, spec, state, dparams, rounds=(5, 25)) -> dict:
    from bench.steady import steady_rounds_program
    force = np.int32(len(spec.widths) - 1 if spec.widths else -1)
    lowered = steady_rounds_program.lower(model.compute_params, dparams, state, force, np.int32(1), spec=spec)
    compiled = lowered.compile()
    run = lambda r: compiled(model.compute_params, dparams, state, force, np.int32(r))
    run(1)
    t1, t2 = (_best_time(lambda r=r: run(r)) for r in rounds)
    round_ms = (t2 - t1) / (rounds[1] - rounds[0]) * 1e3
    stage_of = stage_of_instructions(compiled.as_text())
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        jax.block_until_ready(run(rounds[1]))
        jax.profiler.stop_trace()
        totals = self_times(d)
    per_stage = collections.Counter()
    for name, us in totals.items():
        base = name.split(" ")[0]
        if base in stage_of:
            per_stage[stage_of[base]] += us
    total = sum(per_stage.values()) or 1.0
    return dict(round_ms=round_ms, stages_ms={s: round_ms * per_stage[s] / total for s in STAGES + ("other",)})


def verify_width_ms(model, widths, max_len: int, taps) -> dict[int, float]:
    """Target forward alone over `w` new tokens at each width (causal mask, taps), ms per forward."""
    from kimi_jax.cache import init_cache
    from kimi_jax.model.transformer import forward
    cfg = model.config
    cache = init_cache(cfg, 1, max_len, jnp.float32).replace(lengths=jnp.asarray([64], jnp.int32))

    @functools.partial(jax.jit, static_argnames=("w",))
    def loop(params, cache, n, w):
        def body(i, acc):
            z = (acc > 1e30).astype(jnp.int32)       # always 0, unknown to XLA: keeps the forward in the loop
            toks = jnp.zeros((1, w), jnp.int32) + z
            out = forward(params, cfg, toks, cache, taps=taps)
            return acc + jnp.sum(out.logits[:, -1]) + jnp.sum(out.taps)
        return jax.lax.fori_loop(0, n, body, jnp.float32(0))

    out = {}
    for w in widths:
        loop(model.compute_params, cache, 1, w=w).block_until_ready()
        t1 = _best_time(lambda: loop(model.compute_params, cache, 2, w=w))
        t2 = _best_time(lambda: loop(model.compute_params, cache, 12, w=w))
        out[w] = (t2 - t1) / 10 * 1e3
    return out


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = result["rounds"]
    labels = [r["label"] for r in rows]
    bottom = np.zeros(len(rows))
    for s in STAGES + ("other",):
        vals = np.array([r["stages_ms"][s] for r in rows])
        ax.bar(labels, vals, bottom=bottom, label=s)
        bottom += vals
    ax.set_ylabel("ms per round")
    ax.set_title(f"round by stage ({result['backend']}, {result.get('tag') or 'current'})")
    ax.legend(fontsize=8)
    w = sorted(int(k) for k in result["verify_ms"])
    bx.plot(w, [result["verify_ms"][str(k)] for k in w], "o-")
    bx.set_xscale("log", base=2)
    bx.set_xlabel("verify width (tokens)")
    bx.set_ylabel("ms per target forward")
    bx.set_title("verify forward alone")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None):
    import kimi_jax
    from kimi_jax.training.corpus import heldout_prompts
    p = argparse.ArgumentParser(prog="python -m bench.round_profile")
    p.add_argument("--target", default=str(ROOT / "checkpoints" / "target"))
    p.add_argument("--drafter", default=str(ROOT / "checkpoints" / "drafter"))
    p.add_argument("--budgets", default="1,4,16,64,256")
    p.add_argument("--widths", default="1,2,4,8,16,32,64,128,257")
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    model = kimi_jax.load(a.target, drafter=a.drafter)
    model = kimi_jax.Model(model.config.replace(eos_token_ids=()), model.params, model.tokenizer, model.drafter)
    prompt = heldout_prompts(model.tokenizer, 1, 64)[0]
    dparams = model.drafter_params
    rows = []
    for method, budget in [("ar", 0)] + [("ddtree", int(b)) for b in a.budgets.split(",")]:
        request = model.prepare([prompt], 64, method, budget if method == "ddtree" else None)
        state, _ = model.prefill(request)
        res = profile_round(model, request.spec, state, dparams)
        res.update(label="ar" if method == "ar" else f"B={budget}", method=method, budget=budget,
                   max_len=request.max_len)
        rows.append(res)
        print(f"{res['label']:>6s}: {res['round_ms']:6.2f} ms/round  " +
              "  ".join(f"{s} {v:.2f}" for s, v in res["stages_ms"].items()), flush=True)
    taps = tuple(model.drafter.config.target_layer_ids)
    verify = verify_width_ms(model, [int(w) for w in a.widths.split(",")], 512, taps)
    for w, ms in verify.items():
        print(f"verify width {w:4d}: {ms:6.2f} ms", flush=True)
    suffix = f"_{a.tag}" if a.tag else ""
    result = dict(command="python -m bench.round_profile " + " ".join(argv or []), backend=jax.default_backend(),
                  cores=os.cpu_count(), tag=a.tag, prompt="64-token held-out window (corpus.heldout_prompts seed 0)",
                  rounds=rows, verify_ms={str(k): v for k, v in verify.items()}, date=time.strftime("%Y-%m-%d"))
    out = ROOT / "bench" / "results" / f"round_profile_{jax.default_backend()}{suffix}.json"
    out.write_text(json.dumps(result, indent=1))
    plot(result, ROOT / "docs" / f"round_profile{suffix}.png")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
