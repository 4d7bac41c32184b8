"""argmax and top-k over a vocabulary split across devices (kimi_jax.model.vocab) against jnp.argmax and
jax.lax.top_k on one device: same indices, ties and -inf included, and all-reduces where the partitioner would
all-gather (8 CPU devices, tests/conftest.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from kimi_jax import sharding
from kimi_jax.config import Runtime
from kimi_jax.model import vocab

MESHES = {"tp": "tp=8", "ep": "ep=8", "tp_ep": "tp=4,ep=2"}


def _logits(seed, shape=(2, 5, 64)):
    """Small integers (many exact ties across shards) with some -inf, on the logits' usual split."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 4, shape).astype(np.float32)
    x[rng.random(shape) < 0.1] = -np.inf
    return x


def _on(mesh, strategy, x):
    spec = sharding.logical_to_spec((None,) * (x.ndim - 1) + ("vocab",), mesh, strategy)
    return jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))


@pytest.mark.parametrize("strategy", list(MESHES))
def test_argmax_and_top_k_match_one_device(strategy):
    mesh = sharding.make_mesh(MESHES[strategy])
    rt = Runtime(mesh=mesh, strategy=strategy)
    for seed in range(4):
        x = _logits(seed)
        xs = _on(mesh, strategy, x)
        with sharding.mesh_context(mesh):
            got = jax.jit(lambda a: vocab.argmax(a, rt))(xs)
            values, ids = jax.jit(lambda a: vocab.top_k(a, 8, rt))(xs)
        np.testing.assert_array_equal(np.asarray(got), np.argmax(x, axis=-1))
        want_values, want_ids = jax.lax.top_k(jnp.asarray(x), 8)
        np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))


def _collectives(fn, mesh, x):
    with sharding.mesh_context(mesh):
        text = jax.jit(fn).lower(x).compile().as_text()
    return text.count("all-reduce"), text.count("all-gather")


def test_the_choice_is_made_with_all_reduces():
    """The partitioner's form all-gathers every shard's candidates; this module's makes no all-gather."""
    mesh = sharding.make_mesh("tp=8")
    rt = Runtime(mesh=mesh, strategy="tp")
    xs = _on(mesh, "tp", _logits(0))
    for fn in (lambda a: vocab.argmax(a, rt), lambda a: vocab.top_k(a, 8, rt)):
        reduces, gathers = _collectives(fn, mesh, xs)
        assert reduces >= 1 and gathers == 0
    assert _collectives(lambda a: jax.lax.top_k(a, 8), mesh, xs)[1] >= 1      # what it replaces


def test_plain_calls_where_the_split_does_not_apply():
    """No mesh, k above a shard's size (8 of 64 over 8 devices), or a batch split too (dp_attn): jnp's own."""
    x = _logits(1)
    np.testing.assert_array_equal(vocab.argmax(jnp.asarray(x), Runtime()), np.argmax(x, -1))
    mesh = sharding.make_mesh("tp=8")
    rt = Runtime(mesh=mesh, strategy="tp")
    assert vocab._vocab_axes(rt, 8, 64) == ("tp",) and vocab._vocab_axes(rt, 9, 64) == ()
    dp = Runtime(mesh=sharding.make_mesh("dp=2,tp=4"), strategy="dp_attn")
    assert vocab._vocab_axes(dp, 1, 64) == ()
    xs = _on(mesh, "tp", x)
    with sharding.mesh_context(mesh):
        values, ids = jax.jit(lambda a: vocab.top_k(a, 9, rt))(xs)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(jax.lax.top_k(jnp.asarray(x), 9)[1]))


@pytest.mark.parametrize("strategy", ["tp", "tp_ep"])
def test_categorical_samples_what_one_device_samples(strategy):
    """vocab.categorical on a split vocabulary draws, for the same key, the token jax.random.categorical draws on
    one device (its Gumbel noise does not depend on the split), over many keys and rows with -inf entries."""
    mesh = sharding.make_mesh(MESHES[strategy])
    rt = Runtime(mesh=mesh, strategy=strategy)
    x = np.random.default_rng(3).normal(size=(4, 5, 64)).astype(np.float32)
    x[:, :, ::7] = -np.inf
    xs = _on(mesh, strategy, x)
    keys = jax.random.split(jax.random.key(0), 16)
    with sharding.mesh_context(mesh):
        got = jax.jit(jax.vmap(lambda k, a: vocab.categorical(k, a, rt), in_axes=(0, None)))(keys, xs)
    want = jax.vmap(lambda k: jax.random.categorical(k, jnp.asarray(x), axis=-1))(keys)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert len(np.unique(np.asarray(got))) > 20            # really sampled: many tokens, none at -inf
    assert not np.isin(np.asarray(got), np.arange(0, 64, 7)).any()


def test_processed_choice_is_made_with_all_reduces():
    """The processors' greedy and sampled choice (top_k, penalties) on a split vocabulary: one device's tokens.
    Greedy, and plain sampling, make no all-gather (the partitioner's argmax and categorical each do); a sampled
    program keeps the gathers of top_p's sort, a branch it holds whether or not a row asks for top_p
    (processors' module doc), and loses the rest."""
    from kimi_jax.decoding import processors

    mesh = sharding.make_mesh("tp=8")
    rt = Runtime(mesh=mesh, strategy="tp")
    b, vocab_size = 2, 64
    x = np.random.default_rng(4).normal(size=(b, 3, vocab_size)).astype(np.float32)
    xs = _on(mesh, "tp", x)
    history = processors.start_history(jnp.asarray([[1, 2, 3], [4, 5, 6]]), jnp.ones((b, 3), bool), vocab_size)
    temperature, key = jnp.full((b,), 0.8), jax.random.key(7)

    def choose(s, sample, rt):
        return lambda a: processors.choose(a, s, history, temperature, key, sample, None, rt)

    assert _collectives(lambda a: vocab.categorical(key, a, rt), mesh, xs)[1] == 0
    assert _collectives(lambda a: jax.random.categorical(key, a), mesh, xs)[1] > 0      # what it replaces
    for values, sample in [(dict(frequency_penalty=[0.5, 0.0]), False),
                           (dict(top_k=[5, 0], repetition_penalty=[1.3, 1.0]), True)]:
        s = processors.sampling(b, vocab_size, **values)
        with sharding.mesh_context(mesh):
            got = jax.jit(choose(s, sample, rt))(xs)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(choose(s, sample, Runtime())(jnp.asarray(x))))
        gathers, before = (_collectives(choose(s, sample, r), mesh, xs)[1] for r in (rt, Runtime()))
        assert gathers < before and (gathers == 0) == (not sample), (values, gathers, before)
