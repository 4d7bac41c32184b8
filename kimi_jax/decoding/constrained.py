"""Structured output inside the round: each row's token automaton (``kimi_jax.text.grammar``) on the device.

A constrained program (``Spec.grammar = (S, C)``, static) carries every row's own tables, padded to ``S`` states
and ``C`` token classes, and the row's state after its emitted tokens (the bonus included). A row without a
grammar gets a one-state automaton that allows every token, so one program serves a batch that mixes them.
In a round (``kimi_jax.decoding.engine``):

- build_tree: the draft tree keeps only prefixes the row's automaton allows (``ddtree.build_tree``'s ``step``;
  depth 1 among the root state's allowed tokens);
- accept: every node's state (``ddtree.node_states``) masks the target's logits at that node before the logits
  processors and the choice, so the target's token is always one the grammar allows and the walk stays exact:
  accepted tokens are distributed as plain AR decoding under the same mask;
- commit: the row's state moves along the accepted path and the bonus.

Eos is allowed only in the automaton's final states, so a constrained reply ends with a complete match (or at
its length limit, as any reply).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.text import grammar
from kimi_jax.text.grammar import GrammarTables


@flax.struct.dataclass
class Grammar:
    """Every row's automaton: tables (token_class [b, V], next_state [b, S, C], final [b, S]) and state [b]."""
    tables: GrammarTables
    state: jax.Array              # [b] int32: the state after the row's emitted tokens (-1: dead, never reached)


def shape_of(tables: GrammarTables) -> tuple[int, int]:
    """(states, classes) of one automaton's tables."""
    return tuple(np.shape(tables.next_state))


def bucket(shape: tuple[int, int]) -> tuple[int, int]:
    """The padded (S, C) a program compiles for: powers of two (>= 8), so a handful of programs serve all
    schemas; one extra class is kept for the model's ids past the tokenizer's (never allowed)."""
    return tuple(max(8, 1 << (n - 1).bit_length()) for n in (shape[0], shape[1] + 1))


def row_tables(tables: GrammarTables | None, vocab: int, shape: tuple[int, int]) -> GrammarTables:
    """One row's tables (numpy) padded to ``shape`` over the model's ``vocab``: padding states and classes are
    refused, ids past the tokenizer's vocabulary are a refused class; None: the automaton that allows
    everything (one state, final)."""
    states, classes = shape
    token_class = np.full(vocab, classes - 1, np.int32)
    next_state = np.full((states, classes), -1, np.int32)
    final = np.zeros(states, bool)
    if tables is None:
        token_class[:] = 0
        next_state[0, 0], final[0] = 0, True
        return GrammarTables(token_class, next_state, final)
    s, c = shape_of(tables)
    if s > states or c >= classes:
        raise ValueError(f"an automaton of {s} states x {c} classes does not fit the program's {shape}")
    n = min(vocab, len(tables.token_class))
    token_class[:n] = np.asarray(tables.token_class)[:n]
    next_state[:s, :c] = tables.next_state
    final[:s] = tables.final
    return GrammarTables(token_class, next_state, final)


def stack(rows: list[GrammarTables]) -> GrammarTables:
    """Rows' padded tables as one batch (numpy, batch at axis 0)."""
    return GrammarTables(*(np.stack(parts) for parts in zip(*rows)))


def step(tables: GrammarTables):
    """``(states [b, n], tokens [b, n]) -> states``: each row advanced by its own automaton (-1 stays -1)."""
    return lambda states, tokens: jax.vmap(grammar.advance)(tables, states, tokens)


def allowed(tables: GrammarTables, states) -> jax.Array:
    """bool [b, n, V]: the tokens each row's states allow (a dead state allows none)."""
    return jax.vmap(grammar.allowed)(tables, states)


def mask(logits, tables: GrammarTables, states) -> jax.Array:
    """logits [b, n, V] with the tokens each node's state refuses at -inf. A dead node (one the grammar refuses,
    which no walk can reach) keeps its logits: an all -inf row would only make NaNs."""
    keep = allowed(tables, states) | (states < 0)[..., None]
    return jnp.where(keep, logits, -jnp.inf)
