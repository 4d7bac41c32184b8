"""Logits processors on the device: what a request may ask of the target's distribution besides a temperature.

One pipeline, applied to the target's logits wherever the engine chooses a token: the first token after the
prompt (``engine.prefill_rows``) and every node of every round's tree (``engine.accept``; an AR step is the
root-only tree). Every value is a per-row run-time input (``Sampling``, arrays [b]), so one batch mixes
requests with different settings in one compiled program.

Order (vLLM v1's sampler: the server speaks OpenAI's API, as vLLM does, so a request means the same there)::

    logit_bias -> repetition_penalty -> frequency/presence penalties -> temperature -> min_p -> top_k -> top_p

``logit_bias`` comes first because OpenAI defines it on the model's raw logits (a bias of -100 bans a token
whatever the penalties say). Penalties come before the temperature as in both vLLM and HF (they edit the
model's scores; the temperature then shapes the distribution). The three truncations come last; among them
min_p first, then top_k, then top_p over what top_k kept (renormalised), as vLLM does. HF's order differs only
there (top_k, top_p, min_p): min_p's kept set (p >= min_p * p_max) does not depend on which smaller tokens
were cut before it, but top_p's mass does, so the two agree except when min_p and top_p are both on.

Semantics, each the reference's:

* ``logit_bias``: OpenAI's. logit[t] += bias[t]; up to ``LOGIT_BIAS_ENTRIES`` (token, bias) pairs per row.
* ``repetition_penalty`` r: HF's (CTRL), over the prompt and the generated tokens: a seen token's logit is
  divided by r where positive, multiplied by r otherwise. vLLM applies it the same way.
* ``presence_penalty`` a / ``frequency_penalty`` f: OpenAI's, over the generated tokens only:
  logit[t] -= a * (count[t] > 0) + f * count[t].
* temperature: logits / T (sampling programs only).
* ``min_p``: drop tokens whose probability is below min_p times the most probable one's (HF's MinP).
* ``top_k``: keep tokens whose logit is at least the k-th largest (ties at the k-th kept, like HF's TopK).
* ``top_p``: keep the smallest set of most probable tokens whose mass reaches top_p (HF's TopP, computed as HF
  does: ascending sort, a token is dropped where the cumulative mass up to it is <= 1 - top_p, the most
  probable always kept); ties at the cut are all kept (HF cuts inside a tie by its sort's order).

Greedy programs (``Spec.sample`` False) take the argmax of the biased, penalised logits: the temperature and
the truncations never change the argmax, so they are not computed at all.

Each node sees its own history (what makes DDTree sampling lossless: every node's distribution must be the one
AR decoding would sample from after that node's path). History = prompt + generated tokens (``History``: a
[b, V] count of the emitted tokens and a [b, V] prompt mask, updated as tokens are emitted) + the tokens on the
node's path in the tree (its ancestors below the root, and itself: node i's logits predict the token after
node i; the root is the previous bonus, already emitted and counted). The whole [b, nodes, V] is penalised
with the row's counts, then, for every (node i, path node j) pair, the logit of j's token at node i is
recomputed with the count plus the path's own count of that token and written over it (``_path_penalties``): a
[b, nodes, nodes] gather and scatter, no [b, nodes, V] count tensor. Duplicate tokens on one path write equal
values.

Programs: one static flag (``engine.Spec.process``) turns the pipeline on. Off, the programs are today's
(argmax, or a sample at the batch's temperature) at today's cost. On, every combination of values shares the
program, the sampling flag (greedy or not) being the only other static choice; min_p's softmax and the sort
top_k/top_p need run only in rounds where some row asks for them (``lax.cond``), and never in greedy programs.
A round whose rows ask for top_k (all at most ``TOP_K_FAST``) but no top_p takes the k-th largest value from
``lax.top_k`` instead of a sort: the same value, so the same result.

Cost at K2.6 (V = 163840, up to 16 rows x 65 nodes = 1040 distributions per round): bias and penalties are
O(V) elementwise passes over each distribution (~170M elements: ~0.7 GB of float32 per pass, ~0.2 ms of HBM
time each on an H100, about a millisecond for the few passes), plus the [b, 65, 65] path correction
(negligible). min_p is a
softmax pass. top_k/top_p sort every distribution: 1040 sorts of 163840 floats per round, the one costly step
(on the order of milliseconds on a GPU, unmeasured here); only rounds with a top_p row (or a top_k above
``TOP_K_FAST``) pay it. An exact top_p fast path (cut inside a lax.top_k prefix, sort as the fallback) is not
done: its cumulative sums would differ from the sort's by rounding, so a node's distribution would depend on
which path its batch took.

On a mesh that splits the vocabulary (``rt``) the argmax, the sample and top_k's k-th value are made by
all-reduces (``kimi_jax.model.vocab``); top_p's sort is the partitioner's, which gathers the whole vocabulary.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax import fields
from kimi_jax.config import Runtime
from kimi_jax.decoding import ddtree
from kimi_jax.model import vocab as model_vocab
from kimi_jax.fields import LOGIT_BIAS_ENTRIES, GenerationError


@flax.struct.dataclass
class Sampling:
    """The processors' values, per row (every leaf has the batch at axis 0)."""
    top_k: jax.Array              # [b] int32; 0 = off
    top_p: jax.Array              # [b] float32; 1 = off
    min_p: jax.Array              # [b] float32; 0 = off
    presence: jax.Array           # [b] float32
    frequency: jax.Array          # [b] float32
    repetition: jax.Array         # [b] float32; 1 = off
    bias_ids: jax.Array           # [b, LOGIT_BIAS_ENTRIES] int32; -1 = an unused slot
    bias: jax.Array               # [b, LOGIT_BIAS_ENTRIES] float32


@flax.struct.dataclass
class History:
    """What the penalties count, per row (batch at axis 0): the prompt's tokens and the emitted ones."""
    counts: jax.Array             # [b, V] int32: occurrences of each token among the emitted tokens
    in_prompt: jax.Array          # [b, V] bool: the token occurs in the prompt


TOP_K_FAST = 1024   # rounds whose rows ask for top_k <= this and no top_p take lax.top_k instead of a full sort

_SCALARS = {"top_k": np.int32, "top_p": np.float32, "min_p": np.float32, "presence_penalty": np.float32,
            "frequency_penalty": np.float32, "repetition_penalty": np.float32}


def requested(**values) -> bool:
    """Whether any processor value (fields.PROCESSORS, scalar or per row) differs from its default."""
    def off(name, v):
        return v is None or all(x is None or x == fields.FIELDS[name].default for x in _per_row(v))
    return not all(off(name, v) for name, v in values.items())


def _per_row(value):
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _rows_of(name, value, rows: int) -> list:
    """A scalar for every row, or one value per row; each checked against fields.FIELDS (None: the default)."""
    values = _per_row(value)
    if len(values) == 1:
        values = values * rows
    if len(values) != rows:
        raise GenerationError(f"{name} has {len(values)} values for {rows} rows: give one value or one per row")
    for v in values:
        fields.check(**{name: v})
    return [fields.FIELDS[name].default if v is None else v for v in values]


def sampling(rows: int, vocab: int, **values) -> Sampling:
    """The ``Sampling`` of ``rows`` rows from Python values (numpy leaves): each of fields.PROCESSORS a scalar for
    every row or a list with one value per row; ``logit_bias`` a {token id: bias} map (or one per row). Raises
    GenerationError naming the field and its range."""
    unknown = set(values) - set(fields.PROCESSORS)
    if unknown:
        raise TypeError(f"unknown logits processors {sorted(unknown)}; known: {', '.join(fields.PROCESSORS)}")
    cols = {name: np.asarray(_rows_of(name, values.get(name), rows), dtype) for name, dtype in _SCALARS.items()}
    bias_ids = np.full((rows, LOGIT_BIAS_ENTRIES), -1, np.int32)
    bias = np.zeros((rows, LOGIT_BIAS_ENTRIES), np.float32)
    for r, m in enumerate(_rows_of("logit_bias", values.get("logit_bias"), rows)):
        for slot, (key, value) in enumerate(m.items()):
            token = fields.token_id(key)
            if token >= vocab:
                raise GenerationError(f"logit_bias token id {token} is outside the vocabulary [0, {vocab})")
            bias_ids[r, slot], bias[r, slot] = token, value
    return Sampling(top_k=cols["top_k"], top_p=cols["top_p"], min_p=cols["min_p"],
                    presence=cols["presence_penalty"], frequency=cols["frequency_penalty"],
                    repetition=cols["repetition_penalty"], bias_ids=bias_ids, bias=bias)


# ---- history -------------------------------------------------------------------------------------------------

def start_history(tokens, known, vocab: int) -> History:
    """The history of prompts ``tokens`` [b, t] (``known`` [b, t]: False for padding) before any token is emitted."""
    at = jnp.where(known, tokens, vocab)                                          # padding: dropped
    b = tokens.shape[0]
    return History(counts=jnp.zeros((b, vocab), jnp.int32),
                   in_prompt=jnp.zeros((b, vocab), bool).at[jnp.arange(b)[:, None], at].set(True, mode="drop"))


def record(history: History, tokens, count) -> History:
    """``history`` after emitting tokens[:, :count] (tokens [b, w], count [b])."""
    vocab = history.counts.shape[1]
    at = jnp.where(jnp.arange(tokens.shape[1])[None, :] < count[:, None], tokens, vocab)
    return history.replace(counts=history.counts.at[jnp.arange(tokens.shape[0])[:, None], at].add(1, mode="drop"))


# ---- the pipeline --------------------------------------------------------------------------------------------

def _col(x, ndim):
    """Per-row values [b] (or a scalar) shaped to broadcast against [b, ...] arrays of ``ndim`` dims."""
    x = jnp.asarray(x)
    return x.reshape(x.shape + (1,) * (ndim - x.ndim))


def _biased(logits, s: Sampling):
    """logits [b, n, V] + each row's logit_bias."""
    b, _, vocab = logits.shape
    at = jnp.where(s.bias_ids >= 0, s.bias_ids, vocab)                          # unused slots: dropped
    bias = jnp.zeros((b, vocab), jnp.float32).at[jnp.arange(b)[:, None], at].add(s.bias, mode="drop")
    return logits.astype(jnp.float32) + bias[:, None, :]


def _penalised(logits, s: Sampling, seen, count):
    """Repetition (where ``seen``: in the prompt or generated), then frequency and presence (``count``: times
    generated) on biased logits; every argument broadcasts against logits [b, ...]."""
    rep = _col(s.repetition, logits.ndim)
    logits = jnp.where(seen | (count > 0), jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - _col(s.presence, logits.ndim) * (count > 0) - _col(s.frequency, logits.ndim) * count


def _path_penalties(biased, penalised, s: Sampling, history: History, tree):
    """``penalised`` [b, 1+N, V] with each node's path tokens penalised by their full count (row + path).

    For node i and path node j (an ancestor of i below the root, or i itself), j's token t gets the count
    history.counts[t] + (t's occurrences on i's path), and is recomputed from the biased logit at (i, t)."""
    b, size = tree.tokens.shape
    vocab = biased.shape[-1]
    on_path = ddtree.ancestor_mask(tree) & (jnp.arange(size) >= 1)[None, None, :] & tree.valid[:, None, :]
    same = tree.tokens[:, :, None] == tree.tokens[:, None, :]                    # [b, j, k]
    path_count = jnp.einsum("bik,bjk->bij", on_path.astype(jnp.int32), same.astype(jnp.int32))
    rows = jnp.arange(b)[:, None]
    count = jnp.take_along_axis(history.counts, tree.tokens, axis=1)[:, None, :] + path_count   # [b, i, j]
    tokens = jnp.broadcast_to(tree.tokens[:, None, :], (b, size, size))
    value = _penalised(jnp.take_along_axis(biased, tokens, axis=2), s, True, count)
    at = jnp.where(on_path, tokens, vocab)                                       # off the path: dropped
    return penalised.at[rows[:, :, None], jnp.arange(size)[None, :, None], at].set(value, mode="drop")


def penalise(logits, s: Sampling, history: History, tree=None):
    """Biased and penalised logits [b, n, V] (float32) of nodes whose history is ``history`` plus, with a tree
    (n = 1 + N nodes), each node's own path; without one, every position has the row's history alone."""
    biased = _biased(logits, s)
    out = _penalised(biased, s, history.in_prompt[:, None, :], history.counts[:, None, :])
    if tree is None or tree.tokens.shape[1] == 1:         # root only: the root is counted in history already
        return out
    return _path_penalties(biased, out, s, history, tree)


def truncate(logits, s: Sampling, rt: Runtime = Runtime()):
    """min_p, then top_k, then top_p (module doc) on temperature-scaled logits [b, n, V]: the dropped -> -inf.
    ``rt``: where its mesh splits the vocabulary, top_k's k-th value comes by all-reduces (``vocab.top_k``); the
    sort top_p needs gathers the whole vocabulary (module doc)."""
    nd = logits.ndim

    def min_p_cut(logits):
        probs = jax.nn.softmax(logits, axis=-1)
        return jnp.where(probs < _col(s.min_p, nd) * jnp.max(probs, axis=-1, keepdims=True), -jnp.inf, logits)

    def sorted_cut(logits):
        asc = jnp.sort(logits, axis=-1)                    # ascending, as HF's TopP: its cumsum adds the tail first
        vocab = logits.shape[-1]
        k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
        kth = jnp.take_along_axis(asc, _col(vocab - k, nd), axis=-1)            # [b, n, 1]: the k-th largest
        asc = jnp.where(asc < kth, -jnp.inf, asc)
        mass_below = jnp.cumsum(jax.nn.softmax(asc, axis=-1), axis=-1)          # including the token itself
        cut_off = jnp.sum(mass_below <= 1 - _col(s.top_p, nd), axis=-1, keepdims=True)
        smallest_kept = jnp.take_along_axis(asc, jnp.minimum(cut_off, vocab - 1), axis=-1)
        return jnp.where(logits < jnp.maximum(kth, smallest_kept), -jnp.inf, logits)

    def top_k_cut(logits):
        # top_k alone, from lax.top_k: the k-th largest value is the very value the sort finds, so this is exact.
        # Rows flattened to 2-D: XLA:CPU lowers a 3-D top_k to a full sort (as in ddtree.build_tree).
        vocab = logits.shape[-1]
        width = min(TOP_K_FAST, vocab)
        top = model_vocab.top_k(logits.reshape(-1, vocab), width, rt)[0].reshape(logits.shape[:-1] + (width,))
        kth = jnp.take_along_axis(top, _col(jnp.clip(s.top_k, 1, width) - 1, nd), axis=-1)
        return jnp.where((logits < kth) & (_col(s.top_k, nd) > 0), -jnp.inf, logits)

    # each pass only in rounds where some row asks for it (the sort is the pipeline's one costly step)
    logits = jax.lax.cond(jnp.any(s.min_p > 0), min_p_cut, lambda x: x, logits)
    cut = jnp.any(s.top_k > 0) | jnp.any(s.top_p < 1)
    top_k_only = jnp.all(s.top_p >= 1) & jnp.all(s.top_k <= min(TOP_K_FAST, logits.shape[-1]))
    return jax.lax.switch(jnp.where(cut, jnp.where(top_k_only, 1, 2), 0),
                          [lambda x: x, top_k_cut, sorted_cut], logits)


def process(logits, s: Sampling, history: History, temperature, sample: bool, tree=None, rt: Runtime = Runtime()):
    """The whole pipeline on logits [b, n, V]: the distribution (as logits) each position samples from, or, when
    not ``sample``, logits whose argmax is the greedy token (the temperature and truncations are skipped)."""
    out = penalise(logits, s, history, tree)
    if not sample:
        return out
    return truncate(out / _col(temperature, out.ndim), s, rt)


def choose(logits, s: Sampling, history: History, temperature, key, sample: bool, tree=None,
           rt: Runtime = Runtime()):
    """The token [b, n] at every position: the processed argmax, or one independent sample each
    (``jax.random.categorical``'s); by all-reduces where ``rt``'s mesh splits the vocabulary (``model.vocab``)."""
    out = process(logits, s, history, temperature, sample, tree, rt)
    if not sample:
        return model_vocab.argmax(out, rt)
    return model_vocab.categorical(key, out, rt)
