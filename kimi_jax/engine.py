"""The generation programs: prefill, the jitted round of each method, and the on-device multi-round loop.

Every method is the same round — draft, build tree, verify, accept, commit — with a different proposal:

* ``ar``:     no drafter; the tree is the root alone, so a round is one ordinary decode step;
* ``dflash``: the DFlash drafter's argmax block as a single path (chain verification);
* ``ddtree``: the best-first tree of the ``budget`` most probable prefixes under the drafter's marginals.

The root is the previous round's bonus token: emitted already, not yet in the cache. Verify runs the target
over [root] + nodes at positions P + depth with the ancestor-only mask, accept walks the tree along the target's
own choices (argmax, or one sample per node), commit moves the accepted rows into place and emits
``path_len`` tokens (accepted nodes plus the new bonus). ``generate`` runs prefill and all rounds inside one
``lax.while_loop``: one dispatch per call. ``generate_chunk`` runs a fixed number of rounds per dispatch for
streaming.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from kimi_jax import ddtree
from kimi_jax.cache import KVCache, commit, init_cache
from kimi_jax.config import ModelConfig
from kimi_jax.model.transformer import forward

METHODS = ("ar", "dflash", "ddtree")


class GenerationError(ValueError):
    """Bad generation arguments (lengths, budget, token ids); the message names the fix."""


@flax.struct.dataclass
class Sampling:
    temperature: jax.Array        # float32 scalar; only read when sampling
    key: jax.Array


@flax.struct.dataclass
class State:
    cache: KVCache
    drafter: object               # drafter feature cache (None for ar)
    bonus: jax.Array              # [b] int32: emitted, not yet in the cache
    out: jax.Array                # [b, max_new] int32 emitted tokens
    n_out: jax.Array              # [b] int32
    done: jax.Array               # [b] bool
    accepted: jax.Array           # [b, max_new] int32: path_len of each round (tau per round), 0 = no round
    rounds: jax.Array             # int32 scalar
    key: jax.Array
    temperature: jax.Array        # float32 scalar


class Spec(NamedTuple):
    """The static description of a generation program (hashable: a jit static argument)."""
    cfg: ModelConfig
    method: str = "ar"
    budget: int = 0               # tree nodes beyond the root (ddtree); dflash uses block_size - 1
    sample: bool = False          # False: greedy argmax; True: one sample per node at `temperature`
    drafter_cfg: object = None
    block_size: int = 0


def _choose(logits, spec: Spec, temperature, key):
    """The target's token at every position: argmax, or one independent sample from softmax(logits / T)."""
    if not spec.sample:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


def _check_logits(logits):
    # NaN logits would silently emit token 0; make them loud instead (checked on the host after the call).
    return jnp.any(jnp.isnan(logits))


def _emit(state: State, new_tokens, count, eos_ids, max_new):
    """Append new_tokens[:, :count] to the output, stopping at the first eos or at max_new."""
    b, width = new_tokens.shape
    j = jnp.arange(width)[None, :]
    valid = j < count[:, None]
    is_eos = jnp.zeros_like(valid)
    for e in eos_ids:
        is_eos |= new_tokens == e
    first_eos = jnp.min(jnp.where(valid & is_eos, j, width), axis=1)
    count = jnp.minimum(count, first_eos + 1)                         # keep the stop token itself
    count = jnp.minimum(count, max_new - state.n_out)
    count = jnp.where(state.done, 0, count)
    dst = jnp.where(j < count[:, None], state.n_out[:, None] + j, max_new)
    out = state.out.at[jnp.arange(b)[:, None], dst].set(new_tokens, mode="drop")
    n_out = state.n_out + count
    done = state.done | (first_eos < count) | (n_out >= max_new)
    return out, n_out, done


def prefill(params, drafter_params, prompt, prompt_lens, temperature, seed, *, spec: Spec, max_new: int,
            max_len: int) -> tuple[State, jax.Array]:
    """Run the prompt [b, t] (right-padded; true lengths prompt_lens), emit the first token.

    Every input is a plain array (the key is made from ``seed`` here), so the host launches nothing else.
    """
    cfg = spec.cfg
    key = jax.random.key(seed)
    b = prompt.shape[0]
    cache = init_cache(cfg, b, max_len, params["embed"].dtype)
    taps = _taps(spec)
    fwd = forward(params, cfg, prompt, cache, taps=taps)
    cache = KVCache(kv=fwd.cache.kv, lengths=prompt_lens.astype(jnp.int32))
    last = jnp.take_along_axis(fwd.logits, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    key, sub = jax.random.split(key)
    first = _choose(last, spec, temperature, sub)
    drafter = None
    if spec.method != "ar":
        from kimi_jax import drafter as dflash
        drafter = dflash.prefill_features(drafter_params, spec.drafter_cfg, params, fwd.taps, prompt_lens,
                                          max_len)
    state = State(cache=cache, drafter=drafter, bonus=first, out=jnp.zeros((b, max_new), jnp.int32),
                  n_out=jnp.zeros((b,), jnp.int32), done=jnp.zeros((b,), bool),
                  accepted=jnp.zeros((b, max_new), jnp.int32), rounds=jnp.int32(0), key=key,
                  temperature=jnp.asarray(temperature, jnp.float32))
    out, n_out, done = _emit(state, first[:, None], jnp.ones((b,), jnp.int32), cfg.eos_token_ids, max_new)
    return state.replace(out=out, n_out=n_out, done=done), _check_logits(last)


def _draft_len(spec: Spec) -> int:
    return 0 if spec.method == "ar" else spec.block_size - 1


def _taps(spec: Spec):
    return () if spec.method == "ar" else tuple(spec.drafter_cfg.target_layer_ids)


def propose(params, drafter_params, spec: Spec, state: State) -> ddtree.Tree:
    """Draft and build the tree to verify; its root is the bonus token."""
    if spec.method == "ar":
        return ddtree.chain_tree(state.bonus, jnp.zeros((state.bonus.shape[0], 0), jnp.int32))
    from kimi_jax import drafter as dflash
    draft_logits = dflash.draft(drafter_params, spec.drafter_cfg, params, state.drafter, state.bonus,
                                state.cache.lengths, spec.block_size)
    if spec.method == "dflash":
        return ddtree.chain_tree(state.bonus, jnp.argmax(draft_logits, -1).astype(jnp.int32))
    return ddtree.build_tree(state.bonus, draft_logits, spec.budget)


def round_step(params, drafter_params, spec: Spec, state: State) -> tuple[State, jax.Array]:
    """One round: draft, build tree, verify, accept, commit. Returns the new state and a NaN flag."""
    cfg = spec.cfg
    tree = propose(params, drafter_params, spec, state)
    # Verify: the whole tree in one forward, each node at position P + depth, seeing only its ancestors.
    positions = state.cache.lengths[:, None] + tree.depths
    fwd = forward(params, cfg, tree.tokens, state.cache, positions=positions,
                  new_mask=ddtree.ancestor_mask(tree), taps=_taps(spec))
    key, sub = jax.random.split(state.key)
    # Accept: the target's own token at every node, then walk the tree along them.
    target_tokens = _choose(fwd.logits, spec, state.temperature, sub)
    path, path_len, bonus = ddtree.walk(tree, target_tokens, _draft_len(spec))
    path_len = jnp.where(state.done, 0, path_len)
    # Commit: accepted rows into place, their features into the drafter cache, tokens to the output.
    cache = commit(fwd.cache, path, path_len)
    drafter = state.drafter
    if spec.method != "ar":
        from kimi_jax import drafter as dflash
        drafter = dflash.commit_features(drafter_params, spec.drafter_cfg, params, drafter, fwd.taps, path,
                                         path_len, state.cache.lengths)
    accepted_tokens = jnp.take_along_axis(tree.tokens, jnp.maximum(path[:, 1:], 0), axis=1)
    new_tokens = jnp.concatenate([accepted_tokens, bonus[:, None]], axis=1)
    # Place the bonus right after the accepted nodes: new_tokens[path_len - 1] = bonus.
    j = jnp.arange(new_tokens.shape[1])[None, :]
    new_tokens = jnp.where(j == (path_len - 1)[:, None], bonus[:, None], new_tokens)
    out, n_out, done = _emit(state, new_tokens, path_len, cfg.eos_token_ids, state.out.shape[1])
    r = jnp.minimum(state.rounds, state.accepted.shape[1] - 1)
    accepted = state.accepted.at[:, r].set(jnp.where(state.done, 0, path_len))
    new_state = state.replace(cache=cache, drafter=drafter, bonus=bonus, out=out, n_out=n_out, done=done,
                              accepted=accepted, rounds=state.rounds + 1, key=key)
    return new_state, _check_logits(fwd.logits)


def run_rounds(params, drafter_params, spec: Spec, state: State, max_rounds) -> tuple[State, jax.Array]:
    """Rounds in a lax.while_loop until every row is done or max_rounds more rounds ran."""
    stop_at = state.rounds + max_rounds

    def cond(carry):
        s, _ = carry
        return jnp.any(~s.done) & (s.rounds < stop_at)

    def body(carry):
        s, nan = carry
        s, bad = round_step(params, drafter_params, spec, s)
        return s, nan | bad

    return jax.lax.while_loop(cond, body, (state, jnp.bool_(False)))


@functools.partial(jax.jit, static_argnames=("spec", "max_new", "max_len"))
def generate_program(params, drafter_params, prompt, prompt_lens, temperature, seed, *, spec: Spec, max_new: int,
                     max_len: int):
    """Prefill and every round: the whole generation as one XLA program."""
    state, nan = prefill(params, drafter_params, prompt, prompt_lens, temperature, seed, spec=spec,
                         max_new=max_new, max_len=max_len)
    state, nan_rounds = run_rounds(params, drafter_params, spec, state, max_new)
    return state, nan | nan_rounds


prefill_program = jax.jit(prefill, static_argnames=("spec", "max_new", "max_len"))


@functools.partial(jax.jit, static_argnames=("spec", "rounds"), donate_argnames=("state",))
def chunk_program(params, drafter_params, state: State, *, spec: Spec, rounds: int):
    """A fixed number of rounds per dispatch (streaming); the state (and its caches) is donated."""
    return run_rounds(params, drafter_params, spec, state, rounds)
