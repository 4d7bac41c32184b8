"""The generation programs: prefill, the jitted round of each method, and the on-device multi-round loop.

Every method is the same round, written as five named steps:

    draft -> build_tree -> verify -> accept -> commit

* ``ar``:     no drafter; the tree is the root alone, so a round is one ordinary decode step;
* ``dflash``: the DFlash drafter's argmax block as a single path (chain verification);
* ``ddtree``: the best-first tree of the most probable prefixes under the drafter's marginals. With a fixed
  ``budget`` the tree has that many nodes; with ``widths`` (the ``budget="auto"`` policy) every round is
  planned on the device from a calibrated cost table (kimi_jax.decoding.costs): either a plain AR step that skips the
  drafter (``plan``), or a tree built once at the largest width of which the best-first prefix with the most
  expected tokens per second is verified, picked with ``lax.switch`` over the compiled widths, so the choice
  costs no dispatch. Where the calibrated table says no tree width can pay (``costs.drafter_off``), the host
  runs the ``ar`` program instead (``kimi_jax.api.Model.resolve``): no drafter at all for that call.

The root is the previous round's bonus token: emitted already, not yet in the cache. Verify runs the target
over [root] + nodes at positions P + depth with the ancestor-only mask, accept walks the tree along the target's
own choices (argmax, or one sample per node), commit moves the accepted rows into place and emits
``path_len`` tokens (accepted nodes plus the new bonus). ``generate_program`` runs prefill and all rounds
inside one ``lax.while_loop``: one dispatch per call. ``chunk_program`` runs a fixed number of rounds per
dispatch for streaming.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from kimi_jax import sharding
from kimi_jax.cache import KVCache, init_cache, init_paged_cache
from kimi_jax.cache import commit as commit_cache
from kimi_jax.config import ModelConfig, Runtime
from kimi_jax.decoding import ddtree
from kimi_jax.decoding import drafter as dflash
from kimi_jax.fields import METHODS, GenerationError  # noqa: F401  (both are part of the engine's surface)
from kimi_jax.model.transformer import ForwardOut, chunked_forward, forward


@flax.struct.dataclass
class State:
    cache: KVCache
    drafter: dflash.FeatureCache | None   # drafter feature cache (None for ar)
    bonus: jax.Array              # [b] int32: emitted, not yet in the cache
    out: jax.Array                # [b, max_new] int32 emitted tokens
    n_out: jax.Array              # [b] int32
    done: jax.Array               # [b] bool
    accepted: jax.Array           # [b, max_new] int32: path_len of each round (tau per round), 0 = no round
    width: jax.Array              # [max_new] int32: tree nodes verified in each round, -1 = no round
    outlook: jax.Array            # [len(widths)] float32: expected tokens per width, from the last draft (auto)
    since_draft: jax.Array        # int32: rounds since the drafter last ran (auto)
    rounds: jax.Array             # int32 scalar
    key: jax.Array
    temperature: jax.Array        # float32 scalar


class Spec(NamedTuple):
    """The static description of a generation program (hashable: a jit static argument)."""
    cfg: ModelConfig
    method: str = "ar"
    # Nodes verified beyond the root per round: ddtree's tree budget (with `widths`, the largest width),
    # dflash's chain (block_size - 1), 0 for ar.
    nodes: int = 0
    sample: bool = False          # False: greedy argmax; True: one sample per node at `temperature`
    drafter_cfg: dflash.DrafterConfig | None = None
    block_size: int = 0
    widths: tuple[int, ...] = ()  # ddtree auto: candidate widths, ascending (0 = root only); () = fixed budget
    rt: Runtime = Runtime()       # kernels and mesh the target runs with


class Round(NamedTuple):
    """What the steps of one round hand each other."""
    tree: ddtree.Tree
    fwd: ForwardOut
    path: jax.Array               # [b, L + 1] node indices, -1 past path_len
    path_len: jax.Array           # [b]
    bonus: jax.Array              # [b]


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


def _draft_len(spec: Spec) -> int:
    return 0 if spec.method == "ar" else spec.block_size - 1


def _taps(spec: Spec):
    return () if spec.method == "ar" else tuple(spec.drafter_cfg.target_layer_ids)


def row_capacity(prompt_lens, max_new: int, spec: Spec):
    """Cache slots a row can touch: its prompt, every new token, and one round's tree rows past the last."""
    return prompt_lens + max_new + spec.nodes + 1


def prefill(params, drafter_params, prompt, prompt_lens, temperature, seed, costs=None, *, spec: Spec,
            max_new: int, max_len: int, pool_pages: int = 0) -> tuple[State, jax.Array]:
    """Run the prompt [b, t] (right-padded; true lengths prompt_lens), emit the first token.

    With ``spec.rt.page_size`` the latent cache is paged (kimi_jax.cache): a pool of ``pool_pages`` pages
    (static; ``kimi_jax.cache.pool_size`` of the rows' ``row_capacity``), each row owning its own pages.

    costs (auto only): the cost table [2, len(widths)]; its second row, expected tokens per row, is the outlook
    the first round is planned on.

    Every input is a plain array (the key is made from ``seed`` here), so the host launches nothing else.
    """
    cfg = spec.cfg
    key = jax.random.key(seed)
    b = prompt.shape[0]
    if spec.rt.page_size:
        if pool_pages < 1:
            raise ValueError("a paged cache (Runtime.page_size) needs pool_pages (kimi_jax.cache.pool_size)")
        cache = init_paged_cache(cfg, row_capacity(prompt_lens, max_new, spec), max_len, spec.rt.page_size,
                                 pool_pages, params["embed"].dtype)
    else:
        cache = init_cache(cfg, b, max_len, params["embed"].dtype)
    if spec.rt.mesh is not None:        # the cache's layout is the strategy's (dcp splits it by position)
        cache = jax.lax.with_sharding_constraint(cache, sharding.cache_sharding(cfg, spec.rt.mesh, spec.rt.strategy))
    chunk = spec.rt.prefill_chunk
    # The prompt attends in MLA's full (non-absorbed) form: many queries per key, where expanding per-head K/V
    # costs less than the 576-wide latent dot per (query, key) pair (1.4-1.5x faster prefill on the CPU).
    if prompt.shape[1] > chunk and prompt.shape[1] % chunk == 0:    # prompt widths are powers of two
        fwd = chunked_forward(params, cfg, prompt, cache, chunk, last=prompt_lens - 1, taps=_taps(spec),
                              attn_form="full", rt=spec.rt)
        last = fwd.logits[:, 0]
    else:
        fwd = forward(params, cfg, prompt, cache, taps=_taps(spec), attn_form="full", rt=spec.rt)
        last = jnp.take_along_axis(fwd.logits, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    cache = fwd.cache.replace(lengths=prompt_lens.astype(jnp.int32))
    key, sub = jax.random.split(key)
    first = _choose(last, spec, temperature, sub)
    drafter = None
    if spec.method != "ar":
        drafter = dflash.prefill_features(drafter_params, spec.drafter_cfg, params, fwd.taps, prompt_lens,
                                          max_len)
    state = State(cache=cache, drafter=drafter, bonus=first, out=jnp.zeros((b, max_new), jnp.int32),
                  n_out=jnp.zeros((b,), jnp.int32), done=jnp.zeros((b,), bool),
                  accepted=jnp.zeros((b, max_new), jnp.int32), width=jnp.full((max_new,), -1, jnp.int32),
                  outlook=jnp.zeros((max(len(spec.widths), 1),), jnp.float32) if costs is None else costs[1] * b,
                  since_draft=jnp.int32(0),
                  rounds=jnp.int32(0), key=key, temperature=jnp.asarray(temperature, jnp.float32))
    out, n_out, done = _emit(state, first[:, None], jnp.ones((b,), jnp.int32), cfg.eos_token_ids, max_new)
    return state.replace(out=out, n_out=n_out, done=done), _check_logits(last)


# ---- the five steps of a round ---------------------------------------------------------------------------

def draft(params, drafter_params, spec: Spec, state: State):
    """The drafter's logits [b, L, vocab] for the L tokens after each row's bonus (None for ar)."""
    if spec.method == "ar":
        return None
    # A tree of N nodes reaches depth N at most: deeper draft positions are never read.
    depth = min(_draft_len(spec), spec.nodes) if spec.method == "ddtree" else _draft_len(spec)
    return dflash.draft(drafter_params, spec.drafter_cfg, params, state.drafter, state.bonus,
                        state.cache.lengths, spec.block_size, depth=depth)


def build_tree(spec: Spec, state: State, draft_logits) -> ddtree.Tree:
    """The tree to verify, rooted at the bonus token: root only (ar), the argmax chain (dflash), or the
    best-first tree of spec.nodes nodes (ddtree; with widths, its best-first prefixes are verified)."""
    if spec.method == "ar":
        return ddtree.root_only(state.bonus, 0)
    if spec.method == "dflash":
        return ddtree.chain_tree(state.bonus, jnp.argmax(draft_logits, -1).astype(jnp.int32))
    return ddtree.build_tree(state.bonus, draft_logits, spec.nodes)


def verify(params, spec: Spec, state: State, tree: ddtree.Tree) -> ForwardOut:
    """The whole tree in one target forward, each node at position P + depth, seeing only its ancestors."""
    positions = state.cache.lengths[:, None] + tree.depths
    return forward(params, spec.cfg, tree.tokens, state.cache, positions=positions,
                   new_mask=ddtree.ancestor_mask(tree), taps=_taps(spec), rt=spec.rt)


def accept(spec: Spec, state: State, tree: ddtree.Tree, fwd: ForwardOut, key) -> Round:
    """The target's own token at every node (argmax or one sample each), then the walk along them."""
    target_tokens = _choose(fwd.logits, spec, state.temperature, key)
    path, path_len, bonus = ddtree.walk(tree, target_tokens, min(_draft_len(spec), tree.tokens.shape[1] - 1))
    path = jnp.pad(path, ((0, 0), (0, _draft_len(spec) + 1 - path.shape[1])), constant_values=-1)
    return Round(tree, fwd, path, jnp.where(state.done, 0, path_len), bonus)


def commit(params, drafter_params, spec: Spec, state: State, r: Round, key, width) -> State:
    """Accepted rows into place, their features into the drafter cache, tokens to the output."""
    cache = commit_cache(r.fwd.cache, r.path, r.path_len)
    drafter = state.drafter
    if spec.method != "ar":
        drafter = dflash.commit_features(drafter_params, spec.drafter_cfg, params, drafter, r.fwd.taps, r.path,
                                         r.path_len, state.cache.lengths)
    accepted_tokens = jnp.take_along_axis(r.tree.tokens, jnp.maximum(r.path[:, 1:], 0), axis=1)
    new_tokens = jnp.concatenate([accepted_tokens, r.bonus[:, None]], axis=1)
    # Place the bonus right after the accepted nodes: new_tokens[path_len - 1] = bonus.
    j = jnp.arange(new_tokens.shape[1])[None, :]
    new_tokens = jnp.where(j == (r.path_len - 1)[:, None], r.bonus[:, None], new_tokens)
    out, n_out, done = _emit(state, new_tokens, r.path_len, spec.cfg.eos_token_ids, state.out.shape[1])
    i = jnp.minimum(state.rounds, state.accepted.shape[1] - 1)
    accepted = state.accepted.at[:, i].set(jnp.where(state.done, 0, r.path_len))
    return state.replace(cache=cache, drafter=drafter, bonus=r.bonus, out=out, n_out=n_out, done=done,
                         accepted=accepted, width=state.width.at[i].set(width), rounds=state.rounds + 1, key=key)


# ---- the cost-model width --------------------------------------------------------------------------------

# Widths the auto policy chooses from (nodes beyond the root; 0 = a plain AR step that skips the drafter).
AUTO_WIDTHS = (0, 4, 8, 16, 32)
# While AR steps win, the drafter runs again (a probe, so the outlook cannot go stale) once the AR steps since
# the last draft took PROBE_RATIO times the cheapest tree round: probing costs at most ~1/PROBE_RATIO.
PROBE_RATIO = 10.0


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


def plan(state: State, costs) -> jax.Array:
    """Whether this round drafts: some tree width beats a plain AR step on the outlook, or it is time to
    probe. costs [2, len(widths)]: seconds per round (widths[0] = 0 is the AR step) and expected tokens per
    row (the prior outlook, used before the first draft)."""
    seconds = costs[0]
    rate = state.outlook / seconds
    probe = state.since_draft * seconds[0] >= PROBE_RATIO * seconds[1]
    return (jnp.argmax(rate) > 0) | probe


def _finish(params, drafter_params, spec: Spec, state: State, tree: ddtree.Tree, width,
            keys) -> tuple[State, jax.Array]:
    """verify -> accept -> commit for a built tree."""
    key, sub = keys
    with jax.named_scope("verify"):
        fwd = verify(params, spec, state, tree)
    with jax.named_scope("accept"):
        r = accept(spec, state, tree, fwd, sub)
    with jax.named_scope("commit"):
        return commit(params, drafter_params, spec, state, r, key, width), _check_logits(fwd.logits)


def _auto_round(params, drafter_params, spec: Spec, state: State, costs, force, keys):
    """budget="auto": a plain AR step, or draft + build at the largest width + verify the best prefix."""
    widths = spec.widths

    def ar_step(state):
        new, nan = _finish(params, drafter_params, spec, state, ddtree.root_only(state.bonus, 0), 0, keys)
        return new.replace(since_draft=state.since_draft + 1), nan

    def tree_round(state):
        with jax.named_scope("draft"):
            logits = draft(params, drafter_params, spec, state)
        with jax.named_scope("build_tree"):
            tree = build_tree(spec, state, logits)
        with jax.named_scope("choose_width"):
            expect = outlook(tree, widths, state.done)
            choice = 1 + jnp.argmax(expect[1:] / costs[0, 1:]).astype(jnp.int32)
            choice = jnp.where(force > 0, force, choice)
        branches = [functools.partial(lambda t, w: _finish(params, drafter_params, spec, state, ddtree.truncate(t, w),
                                                           w, keys), w=w) for w in widths[1:]]
        new, nan = jax.lax.switch(choice - 1, branches, tree)
        return new.replace(outlook=expect.at[0].set(jnp.sum(~state.done)), since_draft=jnp.int32(0)), nan

    with jax.named_scope("choose_width"):
        go = jnp.where(force >= 0, force > 0, plan(state, costs))
    return jax.lax.cond(go, tree_round, ar_step, state)


def round_step(params, drafter_params, spec: Spec, state: State, costs=None, force=-1) -> tuple[State, jax.Array]:
    """One round: draft, build tree, verify, accept, commit. Returns the new state and a NaN flag.

    With spec.widths (budget="auto") the round is planned from the cost table ``costs``; ``force`` (an
    index into spec.widths, -1 = plan) overrides the plan, which is how the cost table is calibrated."""
    keys = jax.random.split(state.key)
    if spec.widths:
        return _auto_round(params, drafter_params, spec, state, costs, force, keys)
    with jax.named_scope("draft"):
        logits = draft(params, drafter_params, spec, state)
    with jax.named_scope("build_tree"):
        tree = build_tree(spec, state, logits)
    return _finish(params, drafter_params, spec, state, tree, tree.tokens.shape[1] - 1, keys)


def run_rounds(params, drafter_params, spec: Spec, state: State, max_rounds, costs=None, force=-1):
    """Rounds in a lax.while_loop until every row is done or max_rounds more rounds ran.

    Whether an auto request runs at all with its drafter is the host's decision (``kimi_jax.decoding.costs.
    drafter_off``, applied by ``kimi_jax.api.Model.resolve``): a call whose calibrated table makes trees hopeless
    runs the ``ar`` spec's program, so nothing here tests for it."""
    stop_at = state.rounds + max_rounds

    def cond(carry):
        s, _ = carry
        return jnp.any(~s.done) & (s.rounds < stop_at)

    def body(carry):
        s, nan = carry
        s, bad = round_step(params, drafter_params, spec, s, costs, force)
        return s, nan | bad

    return jax.lax.while_loop(cond, body, (state, jnp.bool_(False)))


@functools.partial(jax.jit, static_argnames=("spec", "max_new", "max_len", "pool_pages"))
def generate_program(params, drafter_params, prompt, prompt_lens, temperature, seed, costs=None, force=-1,
                     max_rounds=None, *, spec: Spec, max_new: int, max_len: int, pool_pages: int = 0):
    """Prefill and every round: the whole generation as one XLA program.

    costs/force: the auto policy's cost table and calibration override; max_rounds (traced, default max_new)
    stops early, so calibration can time rounds with the very program that serves requests."""
    state, nan = prefill(params, drafter_params, prompt, prompt_lens, temperature, seed, costs, spec=spec,
                         max_new=max_new, max_len=max_len, pool_pages=pool_pages)
    state, nan_rounds = run_rounds(params, drafter_params, spec, state, max_new if max_rounds is None else max_rounds,
                                   costs, force)
    return state, nan | nan_rounds


prefill_program = jax.jit(prefill, static_argnames=("spec", "max_new", "max_len", "pool_pages"))


@functools.partial(jax.jit, static_argnames=("spec", "rounds"), donate_argnames=("state",))
def chunk_program(params, drafter_params, state: State, costs=None, *, spec: Spec, rounds: int):
    """A fixed number of rounds per dispatch (streaming); the state (and its caches) is donated."""
    return run_rounds(params, drafter_params, spec, state, rounds, costs)


# ---- continuous batching: rows join and leave a running batch between dispatches --------------------------------

@functools.partial(jax.jit, donate_argnames=("state",))
def join(state: State, row: State, slot) -> State:
    """Batch row ``slot`` of ``state`` becomes the one-row state ``row`` (a fresh prefill with the same max_len
    and max_new): its caches, bonus and output. The batch-wide fields (round counter, key, temperature, the auto
    policy's outlook) stay the batch's."""
    def put(a, r, axis):
        return jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), slot, axis)

    drafter = None if state.drafter is None else dflash.FeatureCache(k=put(state.drafter.k, row.drafter.k, 1),
                                                                     v=put(state.drafter.v, row.drafter.v, 1))
    return state.replace(cache=KVCache(kv=put(state.cache.kv, row.cache.kv, 1),
                                       lengths=put(state.cache.lengths, row.cache.lengths, 0)),
                         drafter=drafter, bonus=put(state.bonus, row.bonus, 0), out=put(state.out, row.out, 0),
                         n_out=put(state.n_out, row.n_out, 0), done=put(state.done, row.done, 0),
                         accepted=put(state.accepted, row.accepted, 0))


@functools.partial(jax.jit, donate_argnames=("state",))
def retire(state: State, rows) -> State:
    """Mark rows [b] (bool) done: their slots stop emitting, and a batch with every row done runs no round."""
    return state.replace(done=state.done | rows)


@functools.partial(jax.jit, static_argnames=("spec",))
def steady_rounds_program(params, drafter_params, state: State, force, rounds, *, spec: Spec):
    """``rounds`` (traced) rounds, each from the same committed lengths so the cache never fills and no row
    finishes: every round does the same work. ``force`` picks the width index (auto specs; -1 = plan).
    For bench/round_profile.py."""
    costs = jnp.ones((2, max(len(spec.widths), 1)), jnp.float32)

    def body(_, s):
        nxt, _ = round_step(params, drafter_params, spec, s, costs, force)
        return nxt.replace(cache=nxt.cache.replace(lengths=s.cache.lengths), n_out=s.n_out, done=s.done,
                           rounds=s.rounds)

    return jax.lax.fori_loop(0, rounds, body, state).bonus
