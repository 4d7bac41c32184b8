"""The DDTree engine on a tiny random target: tree verify exactness, losslessness, cache commit, dispatches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kimi_jax
from kimi_jax.cache import KVCache, init_cache
from kimi_jax.config import preset
from kimi_jax.decoding import auto, ddtree, engine
from kimi_jax.decoding import drafter as dflash
from kimi_jax.decoding.engine import GenerationError
from kimi_jax.model.params import init_params
from kimi_jax.model import compute_layout
from kimi_jax.model.transformer import forward, full_logits

CFG = preset("tiny").replace(eos_token_ids=())
DCFG = dflash.DrafterConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=64, vocab_size=256, block_size=5, mask_token_id=255,
                            target_layer_ids=(0, 2))
PROMPTS = [[5, 6, 7], list(range(20, 31))]
jit_forward = jax.jit(forward, static_argnums=(1,), static_argnames=("taps",))


@pytest.fixture(scope="module")
def target():
    return init_params(CFG, jax.random.key(0), scale=2.0)


@pytest.fixture(scope="module")
def model(target):
    return kimi_jax.Model(CFG, target, drafter=dflash.Drafter(DCFG, dflash.init_params(DCFG, jax.random.key(1))))


@pytest.fixture(scope="module")
def ar_tokens(model):
    return model.generate(PROMPTS, 24, method="ar").tokens


def oracle_draft(sequences, wrong_depths=()):
    """A drafter that knows the AR greedy continuation: peaked logits on the true next tokens, except at
    `wrong_depths`, where the top token is wrong and the true one ranks second (so trees must branch)."""
    table = jnp.asarray(sequences)

    def draft(p, c, target_params, cache, bonus, lengths, block_size, depth=None, rt=None):
        idx = lengths[:, None] + 1 + jnp.arange(block_size - 1 if depth is None else depth)[None, :]
        true = jnp.take_along_axis(table, jnp.minimum(idx, table.shape[1] - 1), axis=1)
        logits = 5.0 * jax.nn.one_hot(true, c.vocab_size)
        for d in wrong_depths:
            logits = logits.at[:, d].add(6.0 * jax.nn.one_hot((true[:, d] + 1) % c.vocab_size, c.vocab_size))
        return logits

    return draft


@pytest.mark.slow     # compiles a second generation program; the forward's equality is in the fast loop
def test_stacked_and_per_layer_weights_decode_alike(model, target, monkeypatch):
    """The generation programs run per-layer buffers on a small unsharded model and lax.scan over stacks on a
    large one: both are the same model, so DDTree emits the same tokens either way."""
    assert isinstance(model.compute_params["moe_layers"], tuple) and isinstance(model.drafter_params["layers"], tuple)
    split = model.generate(PROMPTS, 12, method="ddtree", budget=4)
    monkeypatch.setattr(compute_layout, "PER_LAYER_MAX_LAYERS", 0)
    stacked_model = kimi_jax.Model(CFG, target, drafter=model.drafter)
    assert not isinstance(stacked_model.compute_params["moe_layers"], tuple)
    assert not isinstance(stacked_model.drafter_params["layers"], tuple)
    stacked = stacked_model.generate(PROMPTS, 12, method="ddtree", budget=4)
    np.testing.assert_array_equal(split.tokens, stacked.tokens)
    assert split.stats["tau_per_round"] == stacked.stats["tau_per_round"]


@pytest.fixture
def patch_draft(monkeypatch):
    """Swap the drafter's forward for a test double; traced programs are cached, so clear them both ways."""
    def patch(fn):
        jax.clear_caches()
        monkeypatch.setattr(dflash, "draft", fn)
    yield patch
    monkeypatch.undo()
    jax.clear_caches()


def full_sequences(prompts, tokens, width=64):
    out = np.zeros((len(prompts), width), np.int32)
    for i, (p, t) in enumerate(zip(prompts, tokens)):
        s = p + t
        out[i, :len(s)] = s
    return out


@pytest.mark.parametrize("method,budget", [("ddtree", 8), pytest.param("dflash", None, marks=pytest.mark.slow),
                                           pytest.param("ddtree", 1, marks=pytest.mark.slow),
                                           pytest.param("ddtree", 40, marks=pytest.mark.slow)])
def test_random_drafter_is_lossless(model, ar_tokens, method, budget):
    out = model.generate(PROMPTS, 24, method=method, budget=budget)
    assert out.tokens == ar_tokens
    assert out.stats["drafter"] == "on"


@pytest.mark.parametrize("method,budget,wrong", [("dflash", None, ()), ("ddtree", 8, ()), ("ddtree", 12, (1,)),
                                                  ("dflash", None, (2,))])
@pytest.mark.slow
def test_oracle_and_adversarial_drafters_are_lossless(model, ar_tokens, patch_draft, method, budget, wrong):
    patch_draft(oracle_draft(full_sequences(PROMPTS, ar_tokens), wrong))
    model = kimi_jax.Model(CFG, model.params, drafter=model.drafter)       # no programs compiled before the patch
    out = model.generate(PROMPTS, 24, method=method, budget=budget)
    assert out.tokens == ar_tokens
    if method == "ddtree" or not wrong:
        assert out.stats["mean_tau"] > 2.0            # long paths really were accepted


@pytest.mark.slow
def test_tree_verify_equals_causal_forward_over_each_path(target):
    """Logits and taps at every tree node equal a plain causal forward over prefix + that node's root path."""
    prefix = jnp.asarray([[3, 9, 27, 81, 5]])
    logits = jax.random.normal(jax.random.key(5), (1, 3, CFG.vocab_size)) * 3
    tree = ddtree.build_tree(jnp.asarray([7]), logits, 10)
    cache = init_cache(CFG, 1, 32)
    pre = jit_forward(target, CFG, prefix, cache)
    cache = KVCache(pre.cache.kv, jnp.asarray([5]))
    out = forward(target, CFG, tree.tokens, cache, positions=5 + tree.depths, new_mask=ddtree.ancestor_mask(tree),
                  taps=(0, 1, 2))
    parents = np.asarray(tree.parents[0])
    for i in range(tree.tokens.shape[1]):
        path, j = [], i
        while j >= 0:
            path.append(int(tree.tokens[0, j])); j = parents[j]
        seq = jnp.asarray([[3, 9, 27, 81, 5] + path[::-1]])
        ref = jit_forward(target, CFG, seq, init_cache(CFG, 1, seq.shape[1]), taps=(0, 1, 2))
        np.testing.assert_allclose(out.logits[0, i], ref.logits[0, -1], rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(out.taps[:, 0, i], ref.taps[:, 0, -1], rtol=2e-4, atol=2e-4)


@pytest.mark.slow
def test_caches_after_every_round(model, ar_tokens, patch_draft):
    """Target cache == a fresh prefill of the committed tokens; drafter cache rows == recomputed features. The
    fresh prefill runs the committed tokens right-padded to one width (causal: the padding after them changes
    none of their cache rows or taps), so one program serves every length."""
    patch_draft(oracle_draft(full_sequences(PROMPTS, ar_tokens), (1,)))
    request = model.prepare(PROMPTS, 24, "ddtree", 8)
    state, _ = model.prefill(request)
    width = 64
    fresh_prefill = jax.jit(lambda tokens: jit_forward(model.params, CFG, tokens, init_cache(CFG, 1, width),
                                                       taps=DCFG.target_layer_ids))
    drafter_kv = jax.jit(lambda taps: dflash.context_kv(model.drafter.params, DCFG, dflash.context_features(
        model.drafter.params, DCFG, taps), jnp.arange(width)[None]))
    for _ in range(4):
        state, _ = engine.chunk_program(model.params, model.drafter_params, state, rounds=1, spec=request.spec)
        lengths = np.asarray(state.cache.lengths)
        for b in range(len(PROMPTS)):
            n = lengths[b]
            committed = (PROMPTS[b] + ar_tokens[b])[:n]
            assert committed[-1] != -1 and len(committed) == n
            fresh = fresh_prefill(jnp.asarray([committed + [0] * (width - n)]))
            np.testing.assert_allclose(state.cache.kv[:, b, :n], fresh.cache.kv[:, 0, :n], rtol=2e-4, atol=2e-4)
            k, v = drafter_kv(fresh.taps)
            np.testing.assert_allclose(state.drafter.k[:, b, :n], k[:, 0, :n], rtol=2e-4, atol=2e-4)
            np.testing.assert_allclose(state.drafter.v[:, b, :n], v[:, 0, :n], rtol=2e-4, atol=2e-4)


def _greedy_without_cache(params, prompt, n, width=64):
    """Plain greedy decoding by brute force: a causal forward over the whole sequence per token (no cache, no
    engine), padded to one width so one program serves every step."""
    run = jax.jit(lambda tokens: full_logits(params, CFG, tokens))
    seq = list(prompt)
    for _ in range(n):
        padded = np.zeros((1, width), np.int32)
        padded[0, :len(seq)] = seq
        seq.append(int(np.argmax(run(padded)[0, len(seq) - 1])))
    return seq[len(prompt):]


def test_a_new_length_compiles_nothing(target, caplog):
    """Lengths are run-time inputs: after a first call, another max_new_tokens and other prompt lengths (on either
    side of the old power-of-two buckets: 3 -> 9 and 11 -> 17 prompt tokens) run the same program: compile_s 0.0,
    no compile log line, and exactly the tokens of greedy decoding by brute force."""
    m = kimi_jax.Model(CFG, target)
    reference = [_greedy_without_cache(target, p, 24) for p in PROMPTS]
    with caplog.at_level("INFO", logger="kimi_jax"):
        first = m.generate(PROMPTS, 20, method="ar")
    assert first.stats["compile_s"] > 0
    context = CFG.max_position_embeddings
    assert [r.getMessage() for r in caplog.records] == [
        f"compiled generate ar batch 2 prompt {context} max_new {context} cache {context} in "
        f"{first.stats['compile_s']:.1f}s"]
    caplog.clear()
    with caplog.at_level("INFO", logger="kimi_jax"):
        second = m.generate(PROMPTS, 17, method="ar")
        longer = m.generate([p + r[:6] for p, r in zip(PROMPTS, reference)], 18, method="ar")
    assert second.stats["compile_s"] == longer.stats["compile_s"] == 0.0 and not caplog.records
    assert first.tokens == [r[:20] for r in reference] and second.tokens == [r[:17] for r in reference]
    assert longer.tokens == [r[6:] for r in reference]
    assert (second.stats["rounds"], longer.stats["rounds"]) == (16, 17)     # prefill emits one, each AR round one


@pytest.mark.slow
def test_mask_token_survives_in_output(target):
    """A genuine output token equal to the drafter's mask id is kept (the output tracks lengths, not masks)."""
    first = kimi_jax.Model(CFG, target).generate([[5, 6, 7]], 6, method="ar").tokens[0]
    dcfg = DCFG.replace(mask_token_id=first[2])
    m = kimi_jax.Model(CFG, target, drafter=dflash.Drafter(dcfg, dflash.init_params(dcfg, jax.random.key(1))))
    assert m.generate([[5, 6, 7]], 6, method="ddtree", budget=6).tokens[0] == first


@pytest.mark.slow
def test_one_dispatch_per_generate(model, monkeypatch):
    """Count compiled-program executions: the fast path is disabled so every launch goes through Python."""
    from jax._src import pjit
    from jax._src.interpreters import pxla
    model.generate(PROMPTS, 8, method="ddtree", budget=4)           # compile outside the count
    jax.clear_caches()
    calls = []
    real = pxla.ExecuteReplicated.__call__
    monkeypatch.setattr(pjit, "_get_fastpath_data", lambda *a, **k: None)
    monkeypatch.setattr(pxla.ExecuteReplicated, "__call__", lambda self, *a: (calls.append(self.name), real(self, *a))[1])
    out = model.generate(PROMPTS, 8, method="ddtree", budget=4)
    assert out.stats["dispatches"] == 1
    assert len(calls) == 1, calls


def test_bad_arguments(model, target):
    for bad in (-1, "wide", 2.5):
        with pytest.raises(GenerationError, match="budget must be 'auto' or an integer >= 0"):
            model.generate(PROMPTS, 4, method="ddtree", budget=bad)
    with pytest.raises(GenerationError, match="block_size 9 exceeds the drafter's 5"):
        model.generate(PROMPTS, 4, method="ddtree", block_size=9)
    with pytest.raises(GenerationError, match="needs a drafter"):
        kimi_jax.Model(CFG, target).generate(PROMPTS, 4, method="dflash")
    short = kimi_jax.Model(CFG.replace(max_position_embeddings=16), target, drafter=model.drafter)
    with pytest.raises(GenerationError, match="no room .* shorten it or lower the budget$"):
        short.generate([list(range(14))], 4, method="ddtree", budget=8)
    with pytest.raises(GenerationError, match="no room for a new token .* shorten it$"):     # ar has no budget
        short.generate([list(range(15))], 4, method="ar")
    for bad, msg in [(dict(hidden_size=32, head_dim=8), "hidden_size 32"), (dict(vocab_size=300), "vocab_size 300")]:
        with pytest.raises(dflash.DrafterError, match=msg):
            DCFG.replace(**{**bad, "target_layer_ids": (0, 2)}).check_target(CFG)


@pytest.mark.slow
def test_pallas_tree_attention_in_the_engine(model, ar_tokens):
    """attn_impl="pallas" routes verify attention through the Pallas kernel (interpret mode on CPU)."""
    pallas = kimi_jax.Model(CFG, model.params, drafter=model.drafter, runtime=kimi_jax.Runtime(attn_impl="pallas"))
    assert pallas.generate(PROMPTS, 24, method="ddtree", budget=8).tokens == ar_tokens


# ---- budget="auto": the cost-model width ----------------------------------------------------------------

def _auto_program(model, prompts, max_new):
    request = model.prepare(prompts, max_new, "ddtree", "auto")
    return request, model.program(request)[0]


def _tokens(state):
    n_out, out = jax.device_get((state.n_out, state.out))
    return [out[i, :n_out[i]].tolist() for i in range(out.shape[0])]


def test_drafter_off_rule():
    """auto.drafter_off compares the best tree width's prior tokens/s with the AR step's, with HOPELESS_MARGIN
    of slack for the tree."""
    seconds = [1.0, 2.0, 4.0]                       # AR: 1 token/s; width 1: prior / 2 tokens/s (the best tree)
    edge = 2.0 / auto.HOPELESS_MARGIN
    for prior, off in ((2.5, False), (1.01 * edge, False), (0.99 * edge, True), (1.0, True)):
        assert auto.drafter_off([seconds, [1.0, prior, prior]]) == off, prior


def test_auto_runs_the_ar_program_where_trees_lose(model, ar_tokens, monkeypatch):
    """Where the calibrated table says no tree can pay, generate and stream run the ar request's very program:
    no drafter prefill or state, AR's tokens, and stats that say so. A table where trees can pay keeps the
    request as it is."""
    n = len(auto.AUTO_WIDTHS)
    hopeless = np.stack([[1.0] + [100.0] * (n - 1), np.ones(n)])
    monkeypatch.setattr(model, "cost_table", lambda request: hopeless)
    ar = model.prepare(PROMPTS, 24, "ar")
    resolved = model.resolve(model.prepare(PROMPTS, 24))
    assert resolved.drafter_off and resolved.spec == ar.spec and resolved.layout == ar.layout
    assert model.prefill(resolved)[0].drafter is None
    ran, program = [], model.program
    monkeypatch.setattr(model, "program", lambda request: (ran.append(request.spec), program(request))[1])
    out = model.generate(PROMPTS, 24)
    assert ran == [ar.spec] and out.tokens == ar_tokens
    assert out.stats["drafter"] == "off (calibrated)" and set(out.stats["width_per_round"]) == {0}
    assert model.generate(PROMPTS, 24, method="ar").stats["drafter"] == "none"
    *chunks, final = model.stream(PROMPTS, 24)
    assert final.stats["drafter"] == "off (calibrated)" and final.tokens == ar_tokens
    assert [sum((c[i] for c in chunks), []) for i in range(len(PROMPTS))] == ar_tokens
    hopeful = np.stack([[1.0] + [1.1] * (n - 1), np.asarray([1.0] + [2.0] * (n - 1))])
    monkeypatch.setattr(model, "cost_table", lambda request: hopeful)
    request = model.prepare(PROMPTS, 24)
    assert model.resolve(request) is request


def test_stream_times_decoding_not_compiling(target, ar_tokens):
    """stream compiles its prefill and chunk programs before its clock starts and reports that as compile_s,
    once per shape, as generate does: a second call compiles nothing."""
    m = kimi_jax.Model(CFG, target)
    *_, cold = m.stream(PROMPTS, 8, method="ar")
    *_, warm = m.stream(PROMPTS, 8, method="ar")
    assert cold.tokens == warm.tokens == [t[:8] for t in ar_tokens]
    assert cold.stats["compile_s"] > 0 and warm.stats["compile_s"] == 0.0
    # Not a timing test: compiling two programs takes seconds, 4 dispatches of 8 tokens milliseconds, so the
    # cold call's seconds can only stay under its compile_s if the compile is outside them.
    assert cold.stats["seconds"] < cold.stats["compile_s"]


@pytest.mark.slow
@pytest.mark.parametrize("oracle", [False, True])
def test_every_auto_width_gives_ar_tokens(model, ar_tokens, patch_draft, monkeypatch, oracle):
    """Each width the policy can pick (forced), and the policy itself under opposite cost tables, emits AR's
    exact greedy tokens; the widths it reports are the ones the tables make it pick."""
    if oracle:
        patch_draft(oracle_draft(full_sequences(PROMPTS, ar_tokens), (1,)))
    model = kimi_jax.Model(CFG, model.params, drafter=model.drafter)
    request, program = _auto_program(model, PROMPTS, 24)
    spec = request.spec
    assert spec.widths == auto.AUTO_WIDTHS and spec.nodes == max(auto.AUTO_WIDTHS)
    n = len(spec.widths)
    flat = np.ones((2, n), np.float32)
    for force in range(n):
        state, _ = program(model.inputs(request, costs=flat, force=force))
        assert _tokens(state) == ar_tokens, f"width {spec.widths[force]}"
        widths = np.asarray(state.stats.width)[:int(state.rounds)]
        assert set(widths.tolist()) == {spec.widths[force]}
    # Trees nearly free: after the first (prior-planned) round every round drafts and verifies a tree.
    cheap = np.stack([np.asarray([1.0] + [0.01] * (n - 1)), np.asarray([1.0] + [2.0] * (n - 1))]).astype(np.float32)
    state, _ = program(model.inputs(request, costs=cheap))
    assert _tokens(state) == ar_tokens
    assert (np.asarray(state.stats.width)[:int(state.rounds)] > 0).all()
    # Trees far dearer than AR, and a prior that says so: AR steps, a probe only every PROBE_RATIO x cost.
    dear = np.stack([np.asarray([1.0] + [100.0] * (n - 1)), np.ones(n)]).astype(np.float32)
    state, _ = program(model.inputs(request, costs=dear))
    assert _tokens(state) == ar_tokens
    assert (np.asarray(state.stats.width)[:int(state.rounds)] == 0).all()
    # Trees slightly dearer (a probe after 11 AR steps): generate with a prior within HOPELESS_MARGIN keeps the
    # drafter on and probes; with one beyond it, the call runs the AR program (no drafter, no probe).
    for prior, probes in ((0.95 * 1.1, True), (0.6 * 1.1, False)):
        table = np.stack([np.asarray([1.0] + [1.1] * (n - 1)), np.asarray([1.0] + [prior] * (n - 1))])
        assert auto.drafter_off(table) != probes
        monkeypatch.setattr(model, "cost_table", lambda request, table=table: table)
        out = model.generate(PROMPTS, 24)
        assert out.tokens == ar_tokens
        assert out.stats["drafter"] == ("on" if probes else "off (calibrated)")
        assert any(out.stats["width_per_round"]) == probes, prior


@pytest.mark.slow
def test_cost_table_is_monotone_and_reloads_from_cache(model, monkeypatch, tmp_path):
    from kimi_jax.decoding import costs
    monkeypatch.setenv("KIMI_JAX_CACHE", str(tmp_path))
    m = kimi_jax.Model(CFG, model.params, drafter=model.drafter)
    request, _ = _auto_program(m, PROMPTS[:1], 24)
    table = m.cost_table(request)
    assert table.shape == (2, len(request.spec.widths))
    assert (table[0] > 0).all() and (np.diff(table[0]) >= 0).all()             # seconds: monotone in width
    assert table[1][0] == 1.0 and (np.diff(table[1]) >= -1e-6).all()          # expected tokens grow with width
    assert len(list(tmp_path.glob("costs/*.json"))) == 1

    def no_measuring(*a, **k):
        raise AssertionError("the table should have come from the disk cache")
    monkeypatch.setattr(costs, "measure", no_measuring)
    again = kimi_jax.Model(CFG, model.params, drafter=model.drafter)
    np.testing.assert_allclose(again.cost_table(request), table, rtol=1e-6)
    assert again.generate(PROMPTS[:1], 8).stats["width_per_round"]             # auto by default, widths reported


def test_calibration_runs_each_measurement_the_configured_number_of_times(monkeypatch):
    """Per width: one warm-up run, then each of the two round limits ``repeats`` times ($KIMI_JAX_CALIBRATION_REPEATS,
    3 by default or when unreadable); the seconds are the best runs' difference over the rounds' difference."""
    from kimi_jax.decoding import costs
    calls = []

    def run(force, limit):
        calls.append((force, limit))
        return limit, np.ones(3)          # the outlook: expected tokens at each of the 3 widths

    for value, repeats in (("2", 2), ("0", 1), ("many", 3), (None, 3)):
        if value is None:
            monkeypatch.delenv("KIMI_JAX_CALIBRATION_REPEATS")
        else:
            monkeypatch.setenv("KIMI_JAX_CALIBRATION_REPEATS", value)
        calls.clear()
        table = costs.measure(run, 3, rounds=(1, 5))
        assert calls == [c for force in range(3) for c in [(force, 1)] + [(force, 1)] * repeats
                         + [(force, 5)] * repeats], value
        assert table.shape == (2, 3) and (table[0] > 0).all()


@pytest.mark.slow
def test_expected_tokens_is_the_surrogate_sum():
    logits = jax.random.normal(jax.random.key(3), (2, 4, 7)) * 2
    tree = ddtree.build_tree(jnp.asarray([1, 2]), logits, 9)
    got = np.asarray(auto.expected_tokens(tree, (0, 1, 5, 9)))
    p = np.exp(np.asarray(tree.scores[:, 1:], np.float64))
    want = np.stack([np.ones(2), 1 + p[:, :1].sum(1), 1 + p[:, :5].sum(1), 1 + p[:, :9].sum(1)], 1)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # A truncated best-first tree is the best tree of that width: same nodes as building it at that width.
    small = ddtree.build_tree(jnp.asarray([1, 2]), logits, 5)
    for a, b in zip(ddtree.truncate(tree, 5), small):
        np.testing.assert_array_equal(a, b)


def test_every_request_method_has_its_round_steps():
    """The methods a request may name (``fields.METHODS``: API, CLI, server) are exactly those with steps."""
    from kimi_jax.decoding import methods
    from kimi_jax.fields import METHODS
    assert set(methods.BY_NAME) == set(METHODS)
    for name, method in methods.BY_NAME.items():
        spec = engine.Spec(CFG, name, 0 if name == "ar" else 7, drafter_cfg=DCFG, block_size=8)
        assert method.uses_drafter == (name != "ar") and method.draft_len(spec) == (0 if name == "ar" else 7)


def test_a_one_row_step_on_a_gpu_verifies_a_padding_row(target, ar_tokens, monkeypatch):
    """``methods.pads_one_row``: a one-row plain step in a GPU program verifies the root and one invalid padding row
    repeating its token (ddtree.ar_tree); it emits the unpadded step's tokens. Forced here on the CPU."""
    from kimi_jax.decoding import methods
    tree = ddtree.ar_tree(jnp.asarray([7]), pad=True)
    assert tree.tokens.tolist() == [[7, 7]] and tree.valid.tolist() == [[True, False]]
    assert ddtree.ar_tree(jnp.asarray([7, 8]), pad=False).tokens.shape == (2, 1)
    pads = []
    monkeypatch.setattr(methods, "program_platform", lambda rt: "cuda")
    real = ddtree.ar_tree
    monkeypatch.setattr(ddtree, "ar_tree", lambda root, pad: (pads.append(pad), real(root, pad))[1])
    model = kimi_jax.Model(CFG, target)
    assert model.generate([PROMPTS[1]], 23, method="ar").tokens == [ar_tokens[1][:23]]
    assert pads and all(pads)
