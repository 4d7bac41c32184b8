"""Single-stream K2.6 DDTree speed projected on public acceptance numbers (pure Python, no jax).

tau per verify width (``width`` = root + tree nodes = budget + 1, as in the roofline) comes from three named
assumptions, each with a tag in docs/sources.md:

* the chain: the public DFlash drafter's acceptance at block 8 ([kimi-dflash], ``CHAIN_TAU``) is the tau of a
  width-8 round (the anchor plus 7 drafted tokens);
* narrower rounds: a chain cut to ``width`` tokens under an i.i.d. per-position acceptance ``alpha`` fitted to
  that tau ([spec-geometric]): tau = 1 + alpha + ... + alpha^(width-1);
* wider rounds: DDTree multiplies the chain's tau by a gain that grows with log2(width / 8), a low and a high
  bound from public tree-vs-chain measurements ([ddtree-gain], ``GAINS``), capped at the block: a tree of the
  block-8 drafter is at most 7 deep, so a round accepts at most 8 tokens.

The round time is the roofline's (``design_projection``: this design's op tails, uniform or correlated routing,
an all-reduce implementation), tokens/s = tau / round time, and the best width maximises it.
bench/projection.py prints the tables and draws the round's time split.
"""

from __future__ import annotations

import dataclasses
import math

from kimi_jax.analysis.roofline import (DESIGN_WIDTHS, KIMI_DFLASH, DesignOverhead, RoundEstimate,
                                        design_projection)

BLOCK = KIMI_DFLASH.block_size       # 8: the chain's width and one more than a tree's deepest node

# [kimi-dflash]: z-lab/Kimi-K2.5-DFlash acceptance length at block 8, thinking on (SGLang)
CHAIN_TAU = {"MT-Bench": 3.7, "MBPP": 4.5, "GSM8K": 5.3, "HumanEval": 5.3, "Math500": 5.5}
ROUTINGS = {"uniform": False, "correlated": True}     # design_projection's correlated_routing


@dataclasses.dataclass(frozen=True)
class TreeGain:
    """DDTree's tau over the chain of the same drafter: ``1 + per_doubling * min(log2(width / BLOCK), doublings)``
    for widths above the chain's."""
    per_doubling: float
    doublings: float = math.inf

    def factor(self, width: int) -> float:
        if width <= BLOCK:
            return 1.0
        return 1.0 + self.per_doubling * min(math.log2(width / BLOCK), self.doublings)


GAINS = {
    # [ddtree-gain]: branching adds +3.5-4% accepted tokens and saturates at 2 siblings per depth (a tree of
    # 2 x 7 nodes, width ~16); nothing more after one doubling
    "low": TreeGain(0.04, doublings=1.0),
    # [ddtree-gain]: +22% accept length at budget 32 and tau x1.38 at budget 128 over the chain, i.e. ~+10% per
    # doubling of the width; tau keeps rising with the budget (DDTree paper, Fig. 3)
    "high": TreeGain(0.10),
}


def per_token_acceptance(chain_tau: float, block: int = BLOCK) -> float:
    """alpha with 1 + alpha + ... + alpha^(block-1) = chain_tau (bisection; the sum rises with alpha)."""
    if not 1.0 <= chain_tau <= block:
        raise ValueError(f"a block-{block} chain accepts 1 to {block} tokens a round, got tau {chain_tau}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(block)) < chain_tau else (lo, mid)
    return (lo + hi) / 2


def tau(width: int, chain_tau: float, gain: TreeGain) -> float:
    """Accepted tokens per round (bonus included) at a verify width, under the module's three assumptions."""
    if width <= BLOCK:
        alpha = per_token_acceptance(chain_tau)
        return sum(alpha**i for i in range(width))
    return min(chain_tau * gain.factor(width), BLOCK)


@dataclasses.dataclass(frozen=True)
class Best:
    """The width with the most tokens/s for one dataset, gain bound and set of rounds."""
    width: int
    tau: float
    tokens_per_s: float
    round: RoundEstimate


def best_width(rounds: list[RoundEstimate], widths, chain_tau: float, gain: TreeGain) -> Best:
    """argmax over ``widths`` of tau(width) / round time; the narrower width on a tie."""
    points = []
    for w, est in zip(widths, rounds):
        t = tau(w, chain_tau, gain)
        points.append(Best(w, t, t / est.total_s, est))
    return max(points, key=lambda b: b.tokens_per_s)


def rounds_by_routing(hardware, widths=DESIGN_WIDTHS, *, allreduce: str = "one_shot",
                      overhead: DesignOverhead = DesignOverhead()) -> dict[tuple[str, str], list[RoundEstimate]]:
    """{(hardware, routing): round estimates per width} for C=1 (batch 1, 4096 context, TP-8, DFlash drafter)."""
    out = {}
    for routing, correlated in ROUTINGS.items():
        proj = design_projection(hardware, widths, correlated_routing=correlated, allreduce=allreduce,
                                 overhead=overhead)
        out.update({(hw, routing): rows for hw, rows in proj.items()})
    return out


def best_table(rounds: dict[tuple[str, str], list[RoundEstimate]], widths=DESIGN_WIDTHS,
               chain_tau: dict[str, float] = CHAIN_TAU) -> dict[str, dict[tuple[str, str, str], Best]]:
    """{dataset: {(hardware, routing, gain): Best}}."""
    return {name: {(hw, routing, g): best_width(rows, widths, t, gain)
                   for (hw, routing), rows in rounds.items() for g, gain in GAINS.items()}
            for name, t in chain_tau.items()}


def ops_to_cut(est: RoundEstimate, accepted: float, target_tokens_per_s: float, op_tail_s: float) -> float:
    """GPU ops per round to remove, at ``op_tail_s`` each, for ``accepted`` tokens per round to reach the target
    tokens/s (0 where it is met)."""
    return max(0.0, est.total_s - accepted / target_tokens_per_s) / op_tail_s
