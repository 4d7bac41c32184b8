"""A benchmark-only program: rounds that all do the same work, for timing one round.

``steady_rounds_program`` runs ``rounds`` (traced) rounds, each from the same committed lengths, so the cache
never fills and no row finishes. ms per round is then (T(r2) - T(r1)) / (r2 - r1) with the prefill and the
launch cancelling out. Used by round_profile.py, long_context.py and gpu_check.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kimi_jax.decoding import engine


@functools.partial(jax.jit, static_argnames=("spec",))
def steady_rounds_program(params, drafter_params, state: engine.State, force, rounds, *, spec: engine.Spec):
    """``rounds`` rounds from ``state``'s committed lengths; ``force`` picks the width index (auto specs;
    -1 = plan). Returns the last bonus tokens (something to wait on)."""
    costs = jnp.ones((2, max(len(spec.widths), 1)), jnp.float32)

    def body(_, s):
        nxt, _ = engine.round_step(params, drafter_params, spec, s, costs, force)
        return nxt.replace(cache=nxt.cache.replace(lengths=s.cache.lengths), n_out=s.n_out, done=s.done,
                           rounds=s.rounds)

    return jax.lax.fori_loop(0, rounds, body, state).bonus
