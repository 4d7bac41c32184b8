"""The decoding methods, each as the two steps of a round that differ between them: ``draft`` and ``build_tree``.

Verify, accept and commit are the same for every method (``kimi_jax.decoding.engine``): a method is known by
which tree it hands them.

* ``ar``:     no drafter; the tree is the root alone, so a round is one ordinary decode step;
* ``dflash``: the DFlash drafter's argmax block as a single path (chain verification);
* ``ddtree``: the best-first tree of the most probable prefixes under the drafter's marginals (``spec.nodes``
  nodes; with ``spec.widths``, the auto policy verifies one of its best-first prefixes); under structured output
  only prefixes the row's automaton allows (``kimi_jax.decoding.constrained``). The ``dflash`` chain stays the
  drafter's argmax: a refused token there only ends the accepted path early.

A method reads from the program's static ``Spec`` (block size, nodes, drafter config) and from the round's
state (bonus token, committed lengths, drafter feature cache); it holds nothing itself.
"""

from __future__ import annotations

import functools

from kimi_jax.decoding import constrained, ddtree
from kimi_jax.decoding import drafter as dflash
from kimi_jax.model import vocab
from kimi_jax.model.compute_layout import program_platform


class AR:
    """Plain autoregressive decoding: one token per round, no drafter."""
    uses_drafter = False

    def draft_len(self, spec) -> int:
        """Draft positions a round can accept beyond the root."""
        return 0

    def taps(self, spec) -> tuple[int, ...]:
        """Target layers whose outputs the drafter reads (kept by every target forward)."""
        return ()

    def draft(self, params, drafter_params, spec, state):
        return None

    def build_tree(self, spec, state, draft_logits) -> ddtree.Tree:
        return ddtree.ar_tree(state.bonus, pads_one_row(spec, state.bonus.shape[0]))


def pads_one_row(spec, batch: int) -> bool:
    """Whether a plain step of ``batch`` rows verifies a padding row beside the root (``ddtree.ar_tree``): one row,
    in a program for a GPU (where XLA's one-row matmuls cost launches; elsewhere the second row is only work)."""
    return batch == 1 and program_platform(spec.rt) == "cuda"


class DFlash(AR):
    """The drafter's block, argmax at every position, verified as one chain."""
    uses_drafter = True

    def draft_len(self, spec) -> int:
        return spec.block_size - 1

    def taps(self, spec) -> tuple[int, ...]:
        return tuple(spec.drafter_cfg.target_layer_ids)

    def draft_depth(self, spec) -> int:
        return self.draft_len(spec)

    def draft(self, params, drafter_params, spec, state):
        """The drafter's logits [b, L, vocab] for the L tokens after each row's bonus."""
        return dflash.draft(drafter_params, spec.drafter_cfg, params, state.drafter, state.bonus,
                            state.cache.lengths, spec.block_size, depth=self.draft_depth(spec), rt=spec.rt)

    def build_tree(self, spec, state, draft_logits) -> ddtree.Tree:
        return ddtree.chain_tree(state.bonus, vocab.argmax(draft_logits, spec.rt))


class DDTree(DFlash):
    """The best-first tree of ``spec.nodes`` nodes under the drafter's per-position marginals."""

    def draft_depth(self, spec) -> int:
        # A tree of N nodes reaches depth N at most: deeper draft positions are never read.
        return min(self.draft_len(spec), spec.nodes)

    def build_tree(self, spec, state, draft_logits) -> ddtree.Tree:
        g = state.grammar
        top_k = functools.partial(vocab.top_k, rt=spec.rt)
        if g is None:
            return ddtree.build_tree(state.bonus, draft_logits, spec.nodes, top_k=top_k)
        # structured output: only prefixes the row's automaton allows (depth 1 among its state's allowed tokens)
        return ddtree.build_tree(state.bonus, draft_logits, spec.nodes, constrained.step(g.tables), g.state,
                                 constrained.allowed(g.tables, g.state[:, None])[:, 0], top_k=top_k)


BY_NAME = {"ar": AR(), "dflash": DFlash(), "ddtree": DDTree()}
