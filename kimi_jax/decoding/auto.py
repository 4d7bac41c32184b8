"""The ``budget="auto"`` policy: which width each round verifies, and whether a call runs its drafter at all.

With ``Spec.widths`` every round is planned on the device from a calibrated cost table [2, len(widths)]
(``kimi_jax.decoding.costs``: seconds per round at each width, widths[0] = 0 the AR step; prior expected tokens
per row): either a plain AR step that skips the drafter (``plan``), or a tree built once at the largest width of
which the best-first prefix with the most expected tokens per second is verified (``choose_width``, then
``lax.switch`` over the compiled widths in the engine, so the choice costs no dispatch). What it remembers
between rounds is ``Policy``. Where the calibrated table says no tree width can pay (``drafter_off``), the host
runs the ``ar`` program instead (``kimi_jax.api.Model.resolve``): no drafter at all for that call.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.decoding import ddtree

# Widths the auto policy chooses from (nodes beyond the root; 0 = a plain AR step that skips the drafter).
AUTO_WIDTHS = (0, 4, 8, 16, 32)
# While AR steps win, the drafter runs again (a probe, so the outlook cannot go stale) once the AR steps since
# the last draft took PROBE_RATIO times the cheapest tree round: probing costs at most ~1/PROBE_RATIO.
PROBE_RATIO = 10.0
# A call leaves the drafter off (it runs the ``ar`` program: no drafter prefill, no feature taps, no per-round
# plan) when even the calibrated prior outlook makes the best tree width this many times slower, in tokens per
# second, than the AR step. The margin is slack for a prior that undersells the text at hand: within it the
# drafter stays on and the per-round policy can still pick trees on text that drafts better than the prior. It
# is not the tax of staying on (a width-0 round of the auto program, with its taps and feature commit, costs
# more than a plain AR step: docs/round_cost.md), which a call within the margin pays while its AR steps win.
HOPELESS_MARGIN = 1.2


@flax.struct.dataclass
class Policy:
    """What the policy carries from round to round."""
    outlook: jax.Array            # [len(widths)] float32: the batch's expected tokens per width, from the last draft
    since_draft: jax.Array        # int32: rounds since the drafter last ran


def start(widths, costs, batch: int) -> Policy:
    """The first round's policy: the table's prior outlook (row 1, per row) for the batch; zeros without one."""
    outlook = jnp.zeros((max(len(widths), 1),), jnp.float32) if costs is None else costs[1] * batch
    return Policy(outlook=outlook, since_draft=jnp.int32(0))


def expected_tokens(tree: ddtree.Tree, widths) -> jax.Array:
    """[b, len(widths)]: tokens a round emits if it verifies the first w nodes of the best-first order.

    The DDTree surrogate: a node is accepted with the probability of its whole path under the drafter's
    marginals, exp(score); the bonus token always comes. Padding nodes score -inf and add nothing.
    """
    cum = jnp.cumsum(jnp.exp(tree.scores[:, 1:]), axis=1)
    return jnp.stack([1.0 + (cum[:, w - 1] if w else jnp.zeros(cum.shape[0])) for w in widths], axis=1)


def outlook(tree: ddtree.Tree, widths, done) -> jax.Array:
    """The batch's expected tokens per width [len(widths)] (rows still generating)."""
    return jnp.sum(jnp.where(done[:, None], 0.0, expected_tokens(tree, widths)), axis=0)


def plan(policy: Policy, costs, force) -> jax.Array:
    """Whether this round drafts: some tree width beats a plain AR step on the outlook, or it is time to probe;
    ``force`` (an index into widths, -1 = plan) overrides: > 0 drafts, 0 does not."""
    seconds = costs[0]
    rate = policy.outlook / seconds
    probe = policy.since_draft * seconds[0] >= PROBE_RATIO * seconds[1]
    return jnp.where(force >= 0, force > 0, (jnp.argmax(rate) > 0) | probe)


def choose_width(tree: ddtree.Tree, widths, done, costs, force) -> tuple[jax.Array, jax.Array]:
    """-> (index into widths of the tree width to verify, >= 1; the batch's outlook per width) for a tree built
    at the largest width: the most expected tokens per second, or ``force`` where it is > 0."""
    expect = outlook(tree, widths, done)
    choice = 1 + jnp.argmax(expect[1:] / costs[0, 1:]).astype(jnp.int32)
    return jnp.where(force > 0, force, choice), expect


def after_ar_step(policy: Policy) -> Policy:
    return policy.replace(since_draft=policy.since_draft + 1)


def after_tree(expect, done) -> Policy:
    """The policy after a drafted round: its outlook, the AR step's entry counting the rows still generating."""
    return Policy(outlook=expect.at[0].set(jnp.sum(~done)), since_draft=jnp.int32(0))


def drafter_off(table) -> bool:
    """Whether, by a cost table [2, n] (widths[0] = 0, the AR step), no tree width comes within
    HOPELESS_MARGIN of the AR step's expected tokens per second: then the call should not run the drafter."""
    table = np.asarray(table, np.float64)
    rate = table[1] / table[0]                    # prior expected tokens per row per second
    return bool(np.max(rate[1:]) * HOPELESS_MARGIN < rate[0])


def best_width(table) -> int:
    """Index of the width with the most expected tokens per second under a table [2, n]."""
    return int(np.argmax(np.asarray(table[1]) / np.asarray(table[0])))
