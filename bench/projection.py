"""K2.6 DDTree at C=1 projected on public acceptance numbers: tok/s per dataset at the best verify width.

    python -m bench.projection [--allreduce one_shot|nccl] [--target 500]
                               [--ops-per-layer X] [--drafter-layer-ops Y] [--round-ops Z] [--host-launches N]

The roofline (kimi_jax.analysis.roofline) times one round on 8x H200 and 8x B300 (TP-8, batch 1, 4096 context,
DFlash drafter, ``DesignOverhead()``'s measured op counts) for every width of ``DESIGN_WIDTHS``, under uniform
routing (the upper bound on routed bytes) and correlated routing (the lower bound); kimi_jax.analysis.projection
gives tau per width from the public K2.5 DFlash acceptance with a low and a high DDTree gain. Prints markdown
tables (tau per width, the best width per dataset under both all-reduce implementations, the round's time split,
the gap to ``--target`` tok/s on 8x H200), writes bench/results/projection.json and docs/round_split.png (``--json``,
``--plot``). The op count flags project the same tables at other counts too ("before / after" a change to the
compiled round); without them only ``DesignOverhead()``'s defaults are used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from kimi_jax.analysis import projection as pj
from kimi_jax.analysis.roofline import (ALLREDUCE_IMPLS, DESIGN_WIDTHS, MS, TIME_SPLIT, DesignOverhead,
                                        RoundEstimate)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARDWARE = ("h200", "b300")
SPLIT_LABELS = {"weights": "weight bytes", "kv_cache": "latent KV bytes", "flops_over_bytes": "FLOPs beyond bytes",
                "collectives": "all-reduces", "overhead": "op tails + host submissions"}


def tau_table(widths=DESIGN_WIDTHS) -> str:
    lines = ["| dataset (chain tau) | gain | " + " | ".join(f"w{w}" for w in widths) + " |",
             "|---|---|" + "---|" * len(widths)]
    for name, chain in pj.CHAIN_TAU.items():
        for g, gain in pj.GAINS.items():
            lines.append(f"| {name} ({chain}) | {g} | " + " | ".join(f"{pj.tau(w, chain, gain):.2f}" for w in widths)
                         + " |")
    return "\n".join(lines)


def best_markdown(best: dict) -> str:
    """Rows: dataset; columns: hardware x routing x gain; cells: tok/s at the best width (width)."""
    keys = list(next(iter(best.values())))
    lines = ["| dataset (chain tau) | " + " | ".join(f"{hw} {routing} {g}" for hw, routing, g in keys) + " |",
             "|---|" + "---|" * len(keys)]
    for name, row in best.items():
        cells = " | ".join(f"{row[k].tokens_per_s:.0f} (w{row[k].width})" for k in keys)
        lines.append(f"| {name} ({pj.CHAIN_TAU[name]}) | {cells} |")
    return "\n".join(lines)


def split_markdown(uniform: list[RoundEstimate], correlated: list[RoundEstimate], widths=DESIGN_WIDTHS) -> str:
    """The round's time split per width (ms) under uniform routing; correlated routing moves only the routed
    expert bytes, so its weight time and round time close each row."""
    head = " | ".join(SPLIT_LABELS[k] for k in TIME_SPLIT)
    lines = [f"| width | {head} | round | weights, correlated | round, correlated |", "|---|" + "---|" * 8]
    for w, u, c in zip(widths, uniform, correlated):
        cells = " | ".join(f"{v / MS:.2f}" for v in u.time_split().values())
        lines.append(f"| {w} | {cells} | {u.total_s / MS:.2f} | {c.time_split()['weights'] / MS:.2f} | "
                     f"{c.total_s / MS:.2f} |")
    return "\n".join(lines)


def goal_markdown(best: dict, target: float, overhead: DesignOverhead) -> str:
    """8x H200, uniform routing, best width: tok/s against ``target``, what a round would have to lose (ms, GPU
    ops at the assumed tail) or what tau it would need at the same width."""
    lines = ["| dataset | gain | width | tau | round ms | tok/s | ms to cut | ops to cut | tau needed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, row in best.items():
        by_gain = {g: row[("h200", "uniform", g)] for g in pj.GAINS}
        if len({(b.width, b.tau) for b in by_gain.values()}) == 1:    # the bounds agree: one row
            by_gain = {" = ".join(by_gain): next(iter(by_gain.values()))}
        for g, b in by_gain.items():
            ops = pj.ops_to_cut(b.round, b.tau, target, overhead.op_tail_s)
            lines.append(f"| {name} | {g} | {b.width} | {b.tau:.2f} | {b.round.total_s / MS:.2f} | "
                         f"{b.tokens_per_s:.0f} | {ops * overhead.op_tail_s / MS:.2f} | {ops:.0f} | "
                         f"{target * b.round.total_s:.2f} |")
    return "\n".join(lines)


def plot_split(rounds: dict, path: str, widths=DESIGN_WIDTHS) -> None:
    """Stacked bars of the round's time split per width: one panel per hardware, the uniform-routing bar beside
    the correlated-routing one (hatched)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(HARDWARE), figsize=(11, 3.8), sharey=True)
    colors = dict(zip(TIME_SPLIT, ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974")))
    for ax, hw in zip(axes, HARDWARE):
        for offset, routing, hatch in ((-0.2, "uniform", None), (0.2, "correlated", "//")):
            bottom = [0.0] * len(widths)
            for key in TIME_SPLIT:
                ms = [est.time_split()[key] / MS for est in rounds[(hw, routing)]]
                ax.bar([i + offset for i in range(len(widths))], ms, 0.38, bottom=bottom, color=colors[key],
                       hatch=hatch, edgecolor="white", linewidth=0.3,
                       label=SPLIT_LABELS[key] if (hw, routing) == (HARDWARE[0], "uniform") else None)
                bottom = [b + m for b, m in zip(bottom, ms)]
        ax.set_xticks(range(len(widths)), [str(w) for w in widths])
        ax.set_xlabel("verify width (plain bars: uniform routing; hatched: correlated)")
        ax.set_title(f"8x {hw.upper()}, TP-8, C=1, 4096 context")
    axes[0].set_ylabel("ms per round")
    fig.legend(loc="upper center", ncol=len(TIME_SPLIT), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(path, dpi=80)
    plt.close(fig)


def describe(o: DesignOverhead) -> str:
    return (f"{o.ops_per_layer:g} ops per layer, {o.ops_per_drafter_layer:g} per drafter layer, {o.round_ops:g} "
            f"round ops, {o.host_launches:g} host submissions")


def projection(overhead: DesignOverhead, allreduce: str) -> tuple[dict, dict]:
    rounds = pj.rounds_by_routing(HARDWARE, allreduce=allreduce, overhead=overhead)
    return rounds, pj.best_table(rounds)


def to_json(rounds: dict, best: dict) -> dict:
    return dict(
        rounds={f"{hw} {routing}": [dict(width=w, total_s=e.total_s, split_s=e.time_split())
                                    for w, e in zip(DESIGN_WIDTHS, rows)] for (hw, routing), rows in rounds.items()},
        best={name: {" ".join(k): dict(width=b.width, tau=b.tau, tokens_per_s=b.tokens_per_s)
                     for k, b in row.items()} for name, row in best.items()})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.projection", description=__doc__.splitlines()[0])
    p.add_argument("--allreduce", default="one_shot", choices=ALLREDUCE_IMPLS)
    p.add_argument("--target", type=float, default=500.0, help="tok/s to compare 8x H200 with")
    for flag, field in (("--ops-per-layer", "ops_per_layer"), ("--drafter-layer-ops", "ops_per_drafter_layer"),
                        ("--round-ops", "round_ops"), ("--host-launches", "host_launches")):
        p.add_argument(flag, dest=field, type=float, default=None, help=f"other DesignOverhead.{field}")
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "projection.json"))
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "round_split.png"))
    p.add_argument("--no-plot", action="store_true")
    a = p.parse_args(argv)
    now = DesignOverhead()
    other = {f.name: getattr(a, f.name) for f in dataclasses.fields(now) if getattr(a, f.name, None) is not None}
    rounds, best = projection(now, a.allreduce)
    print(f"## tau per verify width\n\n{tau_table()}\n")
    print(f"## tok/s at the best width, all-reduce {a.allreduce}, {describe(now)}\n\n{best_markdown(best)}\n")
    out = dict(overhead=dataclasses.asdict(now), allreduce=a.allreduce, **to_json(rounds, best))
    for impl in ALLREDUCE_IMPLS:
        if impl != a.allreduce:
            impl_rounds, impl_best = projection(now, impl)
            out[f"best_{impl}"] = to_json(impl_rounds, impl_best)["best"]
            print(f"## the same, all-reduce {impl}\n\n{best_markdown(impl_best)}\n")
    for hw in HARDWARE:
        print(f"## 8x {hw.upper()}: the round's time split (ms)\n\n"
              f"{split_markdown(rounds[(hw, 'uniform')], rounds[(hw, 'correlated')])}\n")
    print(f"## 8x H200, uniform routing, against {a.target:g} tok/s\n\n{goal_markdown(best, a.target, now)}\n")
    if other:
        alt = dataclasses.replace(now, **other)
        alt_rounds, alt_best = projection(alt, a.allreduce)
        print(f"## tok/s at the best width, {describe(alt)}\n\n{best_markdown(alt_best)}\n")
        print(f"## 8x H200, uniform routing, against {a.target:g} tok/s, {describe(alt)}\n\n"
              f"{goal_markdown(alt_best, a.target, alt)}\n")
        out["other"] = dict(overhead=dataclasses.asdict(alt), **to_json(alt_rounds, alt_best))
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    if not a.no_plot:
        plot_split(rounds, a.plot)
    print(f"wrote {a.json}" + ("" if a.no_plot else f" and {a.plot}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
