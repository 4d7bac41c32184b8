"""The generation programs: prefill, the round, and the on-device multi-round loop.

Every method is the same round, written as five named steps:

    draft -> build_tree -> verify -> accept -> commit

``draft`` and ``build_tree`` are the method's own (``kimi_jax.decoding.methods``: ``ar`` drafts nothing and
verifies the root alone, ``dflash`` a chain, ``ddtree`` a best-first tree); verify, accept and commit are shared.
With ``Spec.widths`` (``budget="auto"``) each round is planned on the device by ``kimi_jax.decoding.auto``: a
plain AR step that skips the drafter, or a tree built once at the largest width of which one best-first prefix
is verified, picked with ``lax.switch`` over the compiled widths, so the choice costs no dispatch.

The root is the previous round's bonus token: emitted already, not yet in the cache. Verify runs the target
over [root] + nodes at positions P + depth with the ancestor-only mask, accept walks the tree along the target's
own choices (argmax, or one sample per node), commit moves the accepted rows into place and emits
``path_len`` tokens (accepted nodes plus the new bonus). ``generate_program`` runs prefill and all rounds
inside one ``lax.while_loop``: one dispatch per call. ``chunk_program`` runs a given number of rounds per
dispatch for streaming. A program's run-time inputs are one pytree (``Inputs``); what is fixed per compile is
the ``Spec`` and the layout (``max_new``: output slots per row, ``max_len``, ``pool_pages``). How many new tokens
a row may emit is a run-time input (``Inputs.max_tokens``, kept per row in ``State.limit``), so one program
serves every length up to its ``max_new`` (``kimi_jax.decoding.programs`` buckets it).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from kimi_jax import sharding
from kimi_jax.cache import KVCache, init_cache, init_paged_cache
from kimi_jax.cache import commit as commit_cache
from kimi_jax.config import ModelConfig, Runtime
from kimi_jax.decoding import auto, constrained, ddtree, methods, processors
from kimi_jax.decoding import drafter as dflash
from kimi_jax.fields import METHODS, GenerationError  # noqa: F401  (both are part of the engine's surface)
from kimi_jax.model import vocab
from kimi_jax.model.transformer import ForwardOut, chunked_forward, forward
from kimi_jax.text.grammar import GrammarTables


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
    # The logits processors (kimi_jax.decoding.processors) on: Inputs.sampling's per-row values, State.history.
    # Off, the program chooses as before (argmax, or a sample at the temperature) and carries neither.
    process: bool = False
    # Structured output (kimi_jax.decoding.constrained): every row's token automaton padded to (states, classes),
    # Inputs.grammar's tables, State.grammar; None: unconstrained.
    grammar: tuple[int, int] | None = None
    # Log-probabilities of every emitted token, and of the `logprobs` most likely tokens at its position, under
    # the target's raw distribution (before the grammar mask and the processors: vLLM's default); None: off.
    logprobs: int | None = None

    @property
    def steps(self):
        """The method's own steps (draft, build_tree) and shape (draft_len, taps): ``methods.BY_NAME``."""
        return methods.BY_NAME[self.method]


@flax.struct.dataclass
class Prefix:
    """Prompt pages computed by an earlier prefill (``kimi_jax.serving.prefix_cache``): the prefill copies them
    into its rows and computes only the rest of each prompt."""
    kv: jax.Array                 # [layers, store_pages, page, latent]: the store's latent rows
    k: jax.Array | None           # [draft_layers, store_pages, page, kv_heads, head_dim]: drafter context K (None: ar)
    v: jax.Array | None           # the same for V
    pages: jax.Array              # [b, n] int32: the store page of each row's first n prompt pages; store_pages = none
    length: jax.Array             # [b] int32: cached prefix tokens per row (whole pages)
    # [b, n * page] int32: the cached tokens (-1 past length), which the repetition penalty counts as prompt;
    # needed only by processing specs (Spec.process)
    tokens: jax.Array | None = None

    def rows(self, store):
        """The store's pages of every row, laid end to end: [store layers, b, n * page, ...] (zeros where none)."""
        got = store.at[:, self.pages].get(mode="fill", fill_value=0)         # [layers, b, n, page, ...]
        return got.reshape(got.shape[:2] + (-1,) + got.shape[4:])


@flax.struct.dataclass
class Inputs:
    """Everything a generation program reads at run time, as one pytree (numpy leaves travel with the launch)."""
    params: Any                   # the target's compute params (``kimi_jax.model.compute_layout``)
    drafter_params: Any           # the drafter's compute params, None for ar
    prompt: jax.Array             # [b, t] int32, right-padded
    lens: jax.Array               # [b] int32 prompt lengths
    temperature: jax.Array        # float32 scalar, or [b] one per row (> 0; used only by sampling specs)
    seed: jax.Array               # uint32 scalar
    costs: jax.Array | None = None   # auto: the cost table [2, len(widths)] (kimi_jax.decoding.costs); else None
    force: jax.Array = -1         # auto: a width index every round verifies (calibration), -1 = the policy plans
    max_rounds: jax.Array = 2 ** 30   # rounds to run at most (calibration times rounds with the serving program)
    max_tokens: jax.Array = 2 ** 30   # new tokens per row at most (the static max_new bounds it)
    prefix: Prefix | None = None  # cached pages the prompts continue (prompt/lens are then the rest of each prompt)
    sampling: processors.Sampling | None = None   # per-row processor values; required by (only) Spec.process
    grammar: GrammarTables | None = None  # per-row automata padded to Spec.grammar; required by (only) it


@flax.struct.dataclass
class Logprobs:
    """Spec.logprobs: per emitted token (the same slots as State.out) its log-probability and the top ones."""
    chosen: jax.Array             # [b, max_new] float32
    top_ids: jax.Array            # [b, max_new, n] int32: the n most likely tokens at that position
    top: jax.Array                # [b, max_new, n] float32: their log-probabilities


@flax.struct.dataclass
class Stats:
    """What a generation reports besides its tokens."""
    accepted: jax.Array           # [b, max_new] int32: path_len of each round (tau per round), 0 = no round
    width: jax.Array              # [max_new] int32: tree nodes verified in each round, -1 = no round


@flax.struct.dataclass
class State:
    """The decoding state carried from round to round, with the statistics and the auto policy's memory."""
    cache: KVCache
    drafter: dflash.FeatureCache | None   # drafter feature cache (None for ar)
    bonus: jax.Array              # [b] int32: emitted, not yet in the cache
    out: jax.Array                # [b, max_new] int32 emitted tokens
    n_out: jax.Array              # [b] int32
    limit: jax.Array              # [b] int32: new tokens the row may emit (a run-time input, <= out's width)
    done: jax.Array               # [b] bool
    rounds: jax.Array             # int32 scalar
    key: jax.Array
    temperature: jax.Array        # [b] float32: each row's own (a batch mixes them; the server's rows join with theirs)
    stats: Stats
    policy: auto.Policy
    # Spec.process only (else None); both per row, batch at axis 0
    sampling: processors.Sampling | None = None
    history: processors.History | None = None
    grammar: constrained.Grammar | None = None    # Spec.grammar: each row's automaton and its state
    logprobs: Logprobs | None = None              # Spec.logprobs


class Round(NamedTuple):
    """What the steps of one round hand each other."""
    tree: ddtree.Tree
    fwd: ForwardOut
    path: jax.Array               # [b, L + 1] node indices, -1 past path_len
    path_len: jax.Array           # [b]
    bonus: jax.Array              # [b]
    states: jax.Array | None = None   # [b, 1+N]: each node's automaton state (Spec.grammar), else None


def _choose(logits, spec: Spec, state: State, key, tree: ddtree.Tree | None = None):
    """The target's token at every position of logits [b, n, V]: argmax, or one independent sample from
    softmax(logits / T); with Spec.process, of the processed logits, each tree node with its own path's history."""
    if spec.process:
        return processors.choose(logits, state.sampling, state.history, state.temperature, key, spec.sample, tree,
                                 spec.rt)
    if not spec.sample:
        return vocab.argmax(logits, spec.rt)
    return vocab.categorical(key, logits / state.temperature[:, None, None], spec.rt)


def _recorded(state: State, new_tokens, n_out):
    """The processors' history after ``_emit`` took new_tokens [b, w] to n_out tokens (None without processors)."""
    if state.history is None:
        return None
    return processors.record(state.history, new_tokens, n_out - state.n_out)


def _start_history(inputs: Inputs, spec: Spec):
    """The processors' history of the prompts (with a cached prefix, its tokens too), or None without them."""
    if not spec.process:
        return None
    if inputs.sampling is None:
        raise ValueError("a processing spec (Spec.process) needs Inputs.sampling (kimi_jax.decoding.processors)")
    tokens = inputs.prompt
    known = jnp.arange(tokens.shape[1])[None, :] < inputs.lens[:, None]      # not padding
    if inputs.prefix is not None:
        if inputs.prefix.tokens is None:
            raise ValueError("the repetition penalty counts a cached prefix's tokens: give Prefix.tokens")
        tokens = jnp.concatenate([inputs.prefix.tokens, tokens], axis=1)
        known = jnp.concatenate([inputs.prefix.tokens >= 0, known], axis=1)
    return processors.start_history(tokens, known, spec.cfg.vocab_size)


def _start_grammar(inputs: Inputs, spec: Spec, b: int):
    """Every row's automaton at its initial state (Spec.grammar), or None."""
    if spec.grammar is None:
        return None
    if inputs.grammar is None:
        raise ValueError("a constrained spec (Spec.grammar) needs Inputs.grammar (kimi_jax.decoding.constrained)")
    return constrained.Grammar(tables=inputs.grammar, state=jnp.zeros((b,), jnp.int32))


def _allowed(logits, state: State, states):
    """logits [b, n, V] with what each node's automaton state (``states`` [b, n]) refuses at -inf (Spec.grammar)."""
    return logits if state.grammar is None else constrained.mask(logits, state.grammar.tables, states)


def _advanced(state: State, states, bonus, last):
    """The rows' automata after their accepted path (``states`` [b, 1+N], the path's last node index ``last`` [b])
    and the bonus; rows already done keep theirs. None without Spec.grammar."""
    if state.grammar is None:
        return None
    at = jnp.take_along_axis(states, last[:, None], axis=1)
    new = constrained.step(state.grammar.tables)(at, bonus[:, None])[:, 0]
    return state.grammar.replace(state=jnp.where(state.done, state.grammar.state, new))


def _start_logprobs(spec: Spec, b: int, max_new: int):
    if spec.logprobs is None:
        return None
    n = spec.logprobs
    return Logprobs(chosen=jnp.zeros((b, max_new), jnp.float32), top_ids=jnp.zeros((b, max_new, n), jnp.int32),
                    top=jnp.zeros((b, max_new, n), jnp.float32))


def _recorded_logprobs(state: State, logits, new_tokens, n_out, rt):
    """State.logprobs with the tokens ``_emit`` just took (new_tokens [b, w] to n_out) recorded at their output
    slots; ``logits`` [b, w, V]: the raw logits each of them was chosen from. None without Spec.logprobs.
    Reductions over the vocabulary only (the chosen token's entry as a masked sum, the top by ``vocab.top_k``):
    all-reduces where ``rt``'s mesh splits it, no all-gather."""
    lp = state.logprobs
    if lp is None:
        return None
    log_p = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    ids = jax.lax.broadcasted_iota(jnp.int32, log_p.shape, log_p.ndim - 1)
    chosen = jnp.sum(jnp.where(ids == new_tokens[..., None], log_p, 0.0), axis=-1)
    top, top_ids = vocab.top_k(log_p, lp.top.shape[-1], rt)
    b, w = new_tokens.shape
    j = jnp.arange(w)[None, :]
    dst = jnp.where(j < (n_out - state.n_out)[:, None], state.n_out[:, None] + j, lp.chosen.shape[1])
    rows = jnp.arange(b)[:, None]
    put = lambda a, v: a.at[rows, dst].set(v, mode="drop")  # noqa: E731
    return Logprobs(chosen=put(lp.chosen, chosen), top_ids=put(lp.top_ids, top_ids), top=put(lp.top, top))


def _check_logits(logits):
    # NaN logits would silently emit token 0; make them loud instead (checked on the host after the call).
    return jnp.any(jnp.isnan(logits))


def _emit(state: State, new_tokens, count, eos_ids):
    """Append new_tokens[:, :count] to the output, stopping at the first eos or at the row's limit."""
    b, width = new_tokens.shape
    max_new = state.out.shape[1]
    j = jnp.arange(width)[None, :]
    valid = j < count[:, None]
    is_eos = jnp.zeros_like(valid)
    for e in eos_ids:
        is_eos |= new_tokens == e
    first_eos = jnp.min(jnp.where(valid & is_eos, j, width), axis=1)
    count = jnp.minimum(count, first_eos + 1)                         # keep the stop token itself
    count = jnp.minimum(count, state.limit - state.n_out)
    count = jnp.where(state.done, 0, count)
    dst = jnp.where(j < count[:, None], state.n_out[:, None] + j, max_new)
    out = state.out.at[jnp.arange(b)[:, None], dst].set(new_tokens, mode="drop")
    n_out = state.n_out + count
    done = state.done | (first_eos < count) | (n_out >= state.limit)
    return out, n_out, done


def row_capacity(prompt_lens, max_new: int, spec: Spec):
    """Cache slots a row can touch: its prompt, every new token, and one round's tree rows past the last."""
    return prompt_lens + max_new + spec.nodes + 1


def prefill(inputs: Inputs, *, spec: Spec, max_new: int, max_len: int, pool_pages: int = 0) -> tuple[State, jax.Array]:
    """Run the prompt [b, t] (right-padded; true lengths ``inputs.lens``), emit the first token.

    With ``spec.rt.page_size`` the latent cache is paged (kimi_jax.cache): a pool of ``pool_pages`` pages
    (static; ``kimi_jax.cache.pool_size`` of the rows' ``row_capacity``), each row owning its own pages.
    With ``inputs.prefix`` each prompt continues cached pages (contiguous cache only).
    The auto policy plans the first round on the cost table's prior outlook (``auto.start``).
    """
    state, nan, _ = prefill_rows(inputs, spec=spec, max_new=max_new, max_len=max_len, pool_pages=pool_pages)
    return state, nan


def prefill_rows(inputs: Inputs, *, spec: Spec, max_new: int, max_len: int, pool_pages: int = 0):
    """``prefill``, also returning the drafter's context rows (k, v) [draft_layers, b, t, kv_heads, head_dim] of
    the prompt positions it computed (None for ar): what a prefix cache keeps of the pages it stores."""
    cfg, params, prompt, prompt_lens, prefix = spec.cfg, inputs.params, inputs.prompt, inputs.lens, inputs.prefix
    key = jax.random.key(inputs.seed)
    b = prompt.shape[0]
    if spec.rt.page_size:
        if pool_pages < 1:
            raise ValueError("a paged cache (Runtime.page_size) needs pool_pages (kimi_jax.cache.pool_size)")
        if prefix is not None:
            raise ValueError("a cached prefix is copied into a contiguous cache; this one is paged")
        # the pages a row can touch: up to its own new-token limit, not the program's output slots
        capacity = row_capacity(prompt_lens, jnp.minimum(inputs.max_tokens, max_new), spec)
        cache = init_paged_cache(cfg, capacity, max_len, spec.rt.page_size, pool_pages, params["embed"].dtype)
    else:
        cache = init_cache(cfg, b, max_len, params["embed"].dtype)
    start = jnp.zeros((b,), jnp.int32)
    if prefix is not None:              # the cached rows at slots 0..; the prompt's rest is computed after them
        cache = cache.replace(kv=jax.lax.dynamic_update_slice_in_dim(cache.kv, prefix.rows(prefix.kv), 0, 2),
                              lengths=prefix.length)
        start = prefix.length
    if spec.rt.mesh is not None:        # the cache's layout is the strategy's (dcp splits it by position)
        cache = jax.lax.with_sharding_constraint(cache, sharding.cache_sharding(cfg, spec.rt.mesh, spec.rt.strategy))
    chunk = spec.rt.prefill_chunk
    taps = spec.steps.taps(spec)
    # The prompt attends in MLA's full (non-absorbed) form: many queries per key, where expanding per-head K/V
    # costs less than the 576-wide latent dot per (query, key) pair (1.4-1.5x faster prefill on the CPU).
    if prompt.shape[1] > chunk and prompt.shape[1] % chunk == 0:    # prompt widths are powers of two
        fwd = chunked_forward(params, cfg, prompt, cache, chunk, last=prompt_lens - 1, taps=taps,
                              attn_form="full", rt=spec.rt)
        last = fwd.logits[:, 0]
    else:
        fwd = forward(params, cfg, prompt, cache, taps=taps, attn_form="full", rt=spec.rt)
        last = jnp.take_along_axis(fwd.logits, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    cache = fwd.cache.replace(lengths=(start + prompt_lens).astype(jnp.int32))
    key, sub = jax.random.split(key)
    drafter = rows = None
    if spec.steps.uses_drafter:
        earlier = None if prefix is None else (prefix.rows(prefix.k), prefix.rows(prefix.v))
        drafter, rows = dflash.prefill_features(inputs.drafter_params, spec.drafter_cfg, params, fwd.taps,
                                                prompt_lens, max_len, start, earlier)
        drafter = _placed_features(drafter, spec)
    state = State(cache=cache, drafter=drafter, bonus=jnp.zeros((b,), jnp.int32),     # the bonus: `first` below
                  out=jnp.zeros((b, max_new), jnp.int32), n_out=jnp.zeros((b,), jnp.int32), done=jnp.zeros((b,), bool),
                  limit=jnp.full((b,), jnp.minimum(inputs.max_tokens, max_new), jnp.int32), rounds=jnp.int32(0),
                  key=key, temperature=jnp.broadcast_to(jnp.asarray(inputs.temperature, jnp.float32), (b,)),
                  stats=Stats(accepted=jnp.zeros((b, max_new), jnp.int32), width=jnp.full((max_new,), -1, jnp.int32)),
                  policy=auto.start(spec.widths, inputs.costs, b), sampling=inputs.sampling if spec.process else None,
                  history=_start_history(inputs, spec), grammar=_start_grammar(inputs, spec, b),
                  logprobs=_start_logprobs(spec, b, max_new))
    start_states = None if state.grammar is None else state.grammar.state[:, None]
    first = _choose(_allowed(last[:, None], state, start_states), spec, state, sub)   # [b, 1]: the prompt is
    out, n_out, done = _emit(state, first, jnp.ones((b,), jnp.int32), cfg.eos_token_ids)   # the whole history
    state = state.replace(bonus=first[:, 0], out=out, n_out=n_out, done=done, history=_recorded(state, first, n_out),
                          grammar=_advanced(state, start_states, first[:, 0], jnp.zeros((b,), jnp.int32)),
                          logprobs=_recorded_logprobs(state, last[:, None], first, n_out, spec.rt))
    return state, _check_logits(last), rows


# ---- the five steps of a round ---------------------------------------------------------------------------

def draft(params, drafter_params, spec: Spec, state: State):
    """The drafter's logits [b, L, vocab] for the L tokens after each row's bonus (None for ar)."""
    return spec.steps.draft(params, drafter_params, spec, state)


def build_tree(spec: Spec, state: State, draft_logits) -> ddtree.Tree:
    """The tree to verify, rooted at the bonus token: root only (ar), the argmax chain (dflash), or the
    best-first tree of spec.nodes nodes (ddtree; with widths, its best-first prefixes are verified)."""
    return spec.steps.build_tree(spec, state, draft_logits)


def verify(params, spec: Spec, state: State, tree: ddtree.Tree) -> ForwardOut:
    """The whole tree in one target forward, each node at position P + depth, seeing only its ancestors."""
    positions = state.cache.lengths[:, None] + tree.depths
    return forward(params, spec.cfg, tree.tokens, state.cache, positions=positions,
                   new_mask=ddtree.ancestor_mask(tree), taps=spec.steps.taps(spec), rt=spec.rt)


def accept(spec: Spec, state: State, tree: ddtree.Tree, fwd: ForwardOut, key) -> Round:
    """The target's own token at every node (argmax or one sample each), then the walk along them."""
    draft_len = spec.steps.draft_len(spec)
    depth = min(draft_len, tree.tokens.shape[1] - 1)
    states = None if state.grammar is None else ddtree.node_states(
        tree, constrained.step(state.grammar.tables), state.grammar.state, depth)
    target_tokens = _choose(_allowed(fwd.logits, state, states), spec, state, key, tree)
    path, path_len, bonus = ddtree.walk(tree, target_tokens, depth)
    path = jnp.pad(path, ((0, 0), (0, draft_len + 1 - path.shape[1])), constant_values=-1)
    return Round(tree, fwd, path, jnp.where(state.done, 0, path_len), bonus, states)


def _placed_features(cache: dflash.FeatureCache, spec: Spec) -> dflash.FeatureCache:
    """The drafter's feature cache split over the mesh as its weights are (``drafter.feature_sharding``), where
    the partitioner might otherwise keep a whole copy on every device."""
    if spec.rt.mesh is None or spec.rt.mesh.size == 1:
        return cache
    return jax.lax.with_sharding_constraint(cache, dflash.feature_sharding(spec.drafter_cfg, spec.rt.mesh,
                                                                           spec.rt.strategy))


def commit(params, drafter_params, spec: Spec, state: State, r: Round, key, width) -> State:
    """Accepted rows into place, their features into the drafter cache, tokens to the output."""
    cache = commit_cache(r.fwd.cache, r.path, r.path_len)
    drafter = state.drafter
    if spec.steps.uses_drafter:
        drafter = _placed_features(dflash.commit_features(drafter_params, spec.drafter_cfg, params, drafter,
                                                          r.fwd.taps, r.path, r.path_len, state.cache.lengths), spec)
    accepted_tokens = jnp.take_along_axis(r.tree.tokens, jnp.maximum(r.path[:, 1:], 0), axis=1)
    new_tokens = jnp.concatenate([accepted_tokens, r.bonus[:, None]], axis=1)
    # Place the bonus right after the accepted nodes: new_tokens[path_len - 1] = bonus.
    j = jnp.arange(new_tokens.shape[1])[None, :]
    new_tokens = jnp.where(j == (r.path_len - 1)[:, None], r.bonus[:, None], new_tokens)
    out, n_out, done = _emit(state, new_tokens, r.path_len, spec.cfg.eos_token_ids)
    i = jnp.minimum(state.rounds, state.stats.accepted.shape[1] - 1)
    stats = Stats(accepted=state.stats.accepted.at[:, i].set(jnp.where(state.done, 0, r.path_len)),
                  width=state.stats.width.at[i].set(width))
    last = jnp.take_along_axis(r.path, jnp.maximum(r.path_len - 1, 0)[:, None], axis=1)[:, 0]
    # new token k was chosen at path node k (the root's choice first, the bonus at the last node's)
    chosen_at = None if state.logprobs is None else jnp.take_along_axis(
        r.fwd.logits, jnp.maximum(r.path, 0)[:, :, None], axis=1)
    return state.replace(cache=cache, drafter=drafter, bonus=r.bonus, out=out, n_out=n_out, done=done,
                         stats=stats, rounds=state.rounds + 1, key=key, history=_recorded(state, new_tokens, n_out),
                         grammar=_advanced(state, r.states, r.bonus, jnp.maximum(last, 0)),
                         logprobs=_recorded_logprobs(state, chosen_at, new_tokens, n_out, spec.rt))


# ---- the round -------------------------------------------------------------------------------------------

def _drafted(params, drafter_params, spec: Spec, state: State) -> ddtree.Tree:
    with jax.named_scope("draft"):
        logits = draft(params, drafter_params, spec, state)
    with jax.named_scope("build_tree"):
        return build_tree(spec, state, logits)


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
        tree = methods.BY_NAME["ar"].build_tree(spec, state, None)       # the ar method's own step
        new, nan = _finish(params, drafter_params, spec, state, tree, 0, keys)
        return new.replace(policy=auto.after_ar_step(state.policy)), nan

    def tree_round(state):
        tree = _drafted(params, drafter_params, spec, state)
        with jax.named_scope("choose_width"):
            choice, expect = auto.choose_width(tree, widths, state.done, costs, force)
        branches = [functools.partial(lambda t, w: _finish(params, drafter_params, spec, state, ddtree.truncate(t, w),
                                                           w, keys), w=w) for w in widths[1:]]
        new, nan = jax.lax.switch(choice - 1, branches, tree)
        return new.replace(policy=auto.after_tree(expect, state.done)), nan

    with jax.named_scope("choose_width"):
        go = auto.plan(state.policy, costs, force)
    return jax.lax.cond(go, tree_round, ar_step, state)


def round_step(params, drafter_params, spec: Spec, state: State, costs=None, force=-1) -> tuple[State, jax.Array]:
    """One round: draft, build tree, verify, accept, commit. Returns the new state and a NaN flag.

    With spec.widths (budget="auto") the round is planned from the cost table ``costs``; ``force`` (an
    index into spec.widths, -1 = plan) overrides the plan, which is how the cost table is calibrated."""
    keys = jax.random.split(state.key)
    if spec.widths:
        return _auto_round(params, drafter_params, spec, state, costs, force, keys)
    tree = _drafted(params, drafter_params, spec, state)
    return _finish(params, drafter_params, spec, state, tree, tree.tokens.shape[1] - 1, keys)


def run_rounds(params, drafter_params, spec: Spec, state: State, max_rounds, costs=None, force=-1):
    """Rounds in a lax.while_loop until every row is done or max_rounds more rounds ran.

    Whether an auto request runs at all with its drafter is the host's decision (``auto.drafter_off``, applied
    by ``kimi_jax.api.Model.resolve``): a call whose calibrated table makes trees hopeless runs the ``ar``
    spec's program, so nothing here tests for it."""
    stop_at = state.rounds + max_rounds

    def cond(carry):
        s, _ = carry
        return jnp.any(~s.done) & (s.rounds < stop_at)

    def body(carry):
        s, nan = carry
        s, bad = round_step(params, drafter_params, spec, s, costs, force)
        return s, nan | bad

    return jax.lax.while_loop(cond, body, (state, jnp.bool_(False)))


STATICS = ("spec", "max_new", "max_len", "pool_pages")


@functools.partial(jax.jit, static_argnames=STATICS)
def generate_program(inputs: Inputs, *, spec: Spec, max_new: int, max_len: int, pool_pages: int = 0):
    """Prefill and every round: the whole generation as one XLA program -> (final state, NaN flag).

    ``inputs.max_rounds`` stops early and ``inputs.force`` fixes the auto width, so calibration can time rounds
    with the very program that serves requests."""
    state, nan = prefill(inputs, spec=spec, max_new=max_new, max_len=max_len, pool_pages=pool_pages)
    state, nan_rounds = run_rounds(inputs.params, inputs.drafter_params, spec, state, inputs.max_rounds,
                                   inputs.costs, inputs.force)
    return state, nan | nan_rounds


prefill_program = jax.jit(prefill, static_argnames=STATICS)
prefill_rows_program = jax.jit(prefill_rows, static_argnames=STATICS)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def chunk_program(params, drafter_params, state: State, costs=None, rounds=4, *, spec: Spec):
    """Up to ``rounds`` rounds in one dispatch (streaming; a run-time value, so one program serves every count);
    the state (and its caches) is donated."""
    return run_rounds(params, drafter_params, spec, state, rounds, costs)
