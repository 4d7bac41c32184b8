"""The logits processors (kimi_jax.decoding.processors): each against an independent reference, each tree node
with its own history, DDTree sampling lossless under every processor, and greedy DDTree == greedy AR on the
tiny model with penalties and logit_bias on.

References: HF transformers' own warpers and repetition processor, run once into tests/fixtures/processors_hf.npz
(tests/fixtures/make_processors_fixtures.py; the project's environment has no torch), and plain numpy for
OpenAI's presence/frequency penalties and logit_bias. The numpy pipeline ``ref_process`` below, whose pieces
are checked against those, is the reference for combinations and for the chi-square tests.
"""

import collections
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import kimi_jax
from kimi_jax.config import preset
from kimi_jax.decoding import constrained, ddtree, engine, processors
from kimi_jax.decoding import drafter as dflash
from kimi_jax.decoding.engine import GenerationError
from kimi_jax.fields import LOGIT_BIAS_ENTRIES
from kimi_jax.model.params import init_params
from kimi_jax.text.grammar import GrammarTables

HF = np.load(os.path.join(os.path.dirname(__file__), "fixtures", "processors_hf.npz"))
HF_NAMES = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


# ---- the numpy reference pipeline (HF's algorithms transcribed; OpenAI's formulas) ---------------------------

def _softmax(x):
    e = np.exp(x - np.max(x))
    return e / e.sum()


def ref_top_k(l, k):
    if k == 0:
        return l
    kth = np.sort(l)[::-1][min(k, len(l)) - 1]
    return np.where(l < kth, -np.inf, l)


def ref_top_p(l, p):
    order = np.argsort(l, kind="stable")                 # ascending, as HF's TopPLogitsWarper
    cum = np.cumsum(_softmax(l[order]))
    remove = cum <= 1 - p
    remove[-1] = False
    out = l.copy()
    out[order[remove]] = -np.inf
    return out


def ref_min_p(l, m):
    probs = _softmax(l)
    return np.where(probs < m * probs.max(), -np.inf, l)


def ref_penalties(l, rep, presence, frequency, prompt, generated):
    out = l.copy()
    for t in set(prompt) | set(generated):                     # HF: over input_ids
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t, c in collections.Counter(generated).items():       # OpenAI: over the generated tokens
        out[t] -= presence + frequency * c
    return out


def ref_process(l, v, prompt, generated, temperature=1.0, sample=True):
    """bias -> repetition -> frequency/presence -> temperature -> min_p -> top_k -> top_p, one position."""
    out = np.asarray(l, np.float64).copy()
    for t, b in v.get("logit_bias", {}).items():
        out[t] += b
    out = ref_penalties(out, v.get("repetition_penalty", 1.0), v.get("presence_penalty", 0.0),
                        v.get("frequency_penalty", 0.0), prompt, generated)
    if not sample:
        return out
    out = ref_min_p(out / temperature, v.get("min_p", 0.0))
    return ref_top_p(ref_top_k(out, v.get("top_k", 0)), v.get("top_p", 1.0))


def history_of(prompts, generated, vocab):
    """processors.History of explicit token lists per row."""
    counts = np.zeros((len(prompts), vocab), np.int32)
    in_prompt = np.zeros((len(prompts), vocab), bool)
    for r, (p, g) in enumerate(zip(prompts, generated)):
        in_prompt[r, p] = True
        np.add.at(counts[r], g, 1)
    return processors.History(counts=jnp.asarray(counts), in_prompt=jnp.asarray(in_prompt))


def assert_same_logits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


# ---- each processor against its reference --------------------------------------------------------------------

def test_the_numpy_reference_is_hf():
    """ref_top_k / ref_top_p / ref_min_p / the repetition part of ref_penalties reproduce HF's processors."""
    logits, ids = HF["logits"], HF["ids"]
    for r in range(len(logits)):
        assert_same_logits(ref_top_k(logits[r], int(HF["value_top_k"][r])), HF["hf_top_k"][r])
        assert_same_logits(ref_top_p(logits[r], float(HF["value_top_p"][r])), HF["hf_top_p"][r])
        assert_same_logits(ref_min_p(logits[r], float(HF["value_min_p"][r])), HF["hf_min_p"][r])
        rep = float(HF["value_repetition_penalty"][r])
        assert_same_logits(ref_penalties(logits[r], rep, 0.0, 0.0, ids[r].tolist(), []),
                           HF["hf_repetition_penalty"][r])


@pytest.mark.parametrize("name", HF_NAMES)
def test_each_processor_matches_hf_with_a_value_per_row(name):
    logits, ids = HF["logits"], HF["ids"]
    rows, vocab = logits.shape
    values = HF[f"value_{name}"]
    temperature = values if name == "temperature" else 1.0
    s = processors.sampling(rows, vocab, **({} if name == "temperature" else {name: values.tolist()}))
    # the repetition penalty's tokens split between the prompt and the generated tokens: HF counts both
    history = history_of(ids[:, :5], ids[:, 5:], vocab)
    got = processors.process(jnp.asarray(logits)[:, None], s, history, jnp.asarray(temperature), True)[:, 0]
    if name != "repetition_penalty":     # the others ignore any history
        assert_same_logits(got, processors.process(jnp.asarray(logits)[:, None], s, history_of(
            [[]] * rows, [[]] * rows, vocab), jnp.asarray(temperature), True)[:, 0])
    assert_same_logits(got, HF[f"hf_{name}"])


def test_presence_frequency_and_logit_bias_match_openai():
    rng = np.random.default_rng(1)
    rows, vocab = 3, 40
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 2
    prompts = [[1, 2, 3], [4], [5, 5, 6]]
    generated = [[3, 3, 7, 9, 3], [], [5, 8, 8]]
    values = [dict(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={7: -100, 0: 3.5, 39: 0.5}),
              dict(presence_penalty=-1.0, frequency_penalty=2.0, logit_bias={}),
              dict(presence_penalty=2.0, frequency_penalty=-0.75, logit_bias={"8": 100, 5: -2})]
    s = processors.sampling(rows, vocab, **{k: [v[k] for v in values] for k in values[0]})
    got = processors.process(jnp.asarray(logits)[:, None], s, history_of(prompts, generated, vocab), 1.0, False)
    for r in range(rows):
        want = logits[r].astype(np.float64).copy()
        for t, b in values[r]["logit_bias"].items():
            want[int(t)] += b
        for t in range(vocab):
            c = generated[r].count(t)
            want[t] -= values[r]["presence_penalty"] * (c > 0) + values[r]["frequency_penalty"] * c
        np.testing.assert_allclose(got[r, 0], want, rtol=1e-5, atol=1e-5)


def test_the_whole_pipeline_matches_the_reference_in_order():
    rng = np.random.default_rng(2)
    rows, vocab = 4, 50
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 3
    prompts = [rng.integers(0, vocab, 6).tolist() for _ in range(rows)]
    generated = [rng.integers(0, vocab, 8).tolist() for _ in range(rows)]
    values = dict(top_k=[0, 10, 3, 25], top_p=[0.8, 1.0, 0.95, 0.5], min_p=[0.02, 0.1, 0.0, 0.05],
                  presence_penalty=[0.3, 0.0, -0.5, 1.0], frequency_penalty=[0.2, 0.5, 0.0, -0.3],
                  repetition_penalty=[1.2, 0.9, 1.0, 2.0], logit_bias=[{1: 2.0}, {}, {4: -100}, {7: 5, 8: -5}])
    temperature = np.float32([0.7, 1.3, 1.0, 0.5])
    s = processors.sampling(rows, vocab, **values)
    history = history_of(prompts, generated, vocab)
    for sample in (True, False):
        got = processors.process(jnp.asarray(logits)[:, None], s, history, jnp.asarray(temperature), sample)
        for r in range(rows):
            row = {k: v[r] for k, v in values.items()}
            assert_same_logits(got[r, 0], ref_process(logits[r], row, prompts[r], generated[r], temperature[r],
                                                      sample))


@pytest.mark.parametrize("top_k", [[0, 3, 8, 1], [0, 3, 9, 1]])
def test_top_k_fast_path_and_the_sort_agree(monkeypatch, top_k):
    """top_k <= TOP_K_FAST (here 8) without top_p takes lax.top_k; 9 takes the sort; both are HF's TopK."""
    monkeypatch.setattr(processors, "TOP_K_FAST", 8)
    logits = np.random.default_rng(4).standard_normal((4, 50)).astype(np.float32)
    logits[3, :3] = logits[3].max()                              # a tie at the top_k = 1 cut: all kept
    s = processors.sampling(4, 50, top_k=top_k)
    got = jax.jit(processors.truncate)(jnp.asarray(logits)[:, None], s)[:, 0]
    for r in range(4):
        assert_same_logits(got[r], ref_top_k(logits[r], top_k[r]))


# ---- each tree node with its own history ---------------------------------------------------------------------

def hand_tree():
    """Root 3 -> 3 -> 5 -> 3, root -> 5 -> 5, root -> 3 -> 7, one padding slot; token 3 repeats on paths."""
    tokens = [[3, 3, 5, 5, 3, 5, 7, 0], [9, 9, 2, 9, 9, 2, 1, 0]]
    parents = [[-1, 0, 0, 1, 2, 3, 1, 0]] * 2
    depths = [[0, 1, 1, 2, 2, 3, 2, 0]] * 2
    valid = [[True] * 7 + [False]] * 2
    return ddtree.Tree(tokens=jnp.asarray(tokens, jnp.int32), parents=jnp.asarray(parents, jnp.int32),
                       depths=jnp.asarray(depths, jnp.int32), scores=jnp.zeros((2, 8), jnp.float32),
                       valid=jnp.asarray(valid))


def test_each_node_is_processed_with_its_own_path_as_history():
    tree = hand_tree()
    vocab = 12
    prompts, generated = [[1, 5], [2, 2, 9]], [[3, 7, 3], [9, 4, 9]]   # generated ends with the root
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.standard_normal((2, 8, vocab)).astype(np.float32) * 2)
    s = processors.sampling(2, vocab, presence_penalty=[0.7, -0.4], frequency_penalty=[0.3, 1.1],
                            repetition_penalty=[1.5, 0.6], logit_bias=[{3: 1.0}, {9: -2.0, 2: 0.5}])
    got = processors.process(logits, s, history_of(prompts, generated, vocab), 1.0, False, tree)
    parents = np.asarray(tree.parents[0])
    for r in range(2):
        for i in range(7):                        # valid nodes: history = generated + the path below the root
            path, j = [], i
            while j > 0:
                path.append(int(tree.tokens[r, j])); j = parents[j]
            one = history_of([prompts[r]], [generated[r] + path[::-1]], vocab)
            want = processors.process(logits[r:r + 1, i:i + 1], jax.tree.map(lambda a: a[r:r + 1], s), one, 1.0,
                                      False)
            np.testing.assert_allclose(got[r, i], want[0, 0], rtol=1e-6, atol=1e-6)
            ref = ref_process(np.asarray(logits[r, i]), dict(
                presence_penalty=[0.7, -0.4][r], frequency_penalty=[0.3, 1.1][r], repetition_penalty=[1.5, 0.6][r],
                logit_bias=[{3: 1.0}, {9: -2.0, 2: 0.5}][r]), prompts[r], generated[r] + path[::-1], sample=False)
            np.testing.assert_allclose(got[r, i], ref, rtol=1e-5, atol=1e-5)


def test_history_counts_the_prompt_and_the_emitted_tokens():
    h = processors.start_history(jnp.asarray([[4, 4, 2, 0], [1, 0, 0, 0]]), jnp.asarray([[True] * 3 + [False],
                                                                                         [True] + [False] * 3]), 6)
    h = processors.record(h, jnp.asarray([[5, 5, 1], [3, 2, 2]]), jnp.asarray([2, 3]))
    np.testing.assert_array_equal(h.in_prompt, [[0, 0, 1, 0, 1, 0], [0, 1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(h.counts, [[0, 0, 0, 0, 0, 2], [0, 0, 2, 1, 0, 0]])


def test_a_cached_prefix_counts_as_prompt():
    """With a prefix cache the prompt input is only the uncached rest: the prefix's tokens (Prefix.tokens) join
    the repetition penalty's prompt set; a processing spec without them, or without Sampling, is refused."""
    spec = engine.Spec(preset("tiny"), process=True)
    zero = jnp.zeros((1, 1), jnp.int32)
    prefix = engine.Prefix(kv=zero, k=None, v=None, pages=zero, length=jnp.asarray([2]),
                           tokens=jnp.asarray([[4, 9, -1, -1]]))
    inputs = engine.Inputs(params=None, drafter_params=None, prompt=jnp.asarray([[2, 3, 0, 0]]), lens=jnp.asarray([1]),
                           temperature=1.0, seed=0, prefix=prefix, sampling=processors.sampling(1, 256))
    seen = engine._start_history(inputs, spec).in_prompt[0]
    assert np.flatnonzero(seen).tolist() == [2, 4, 9]
    with pytest.raises(ValueError, match="Prefix.tokens"):
        engine._start_history(inputs.replace(prefix=prefix.replace(tokens=None)), spec)
    with pytest.raises(ValueError, match="Inputs.sampling"):
        engine._start_history(inputs.replace(sampling=None), spec)


# ---- lossless sampling: DDTree with the pipeline at every node vs AR under the processed conditionals ---------

V, L, ROWS = 3, 2, 20000
# test_sampling's chain without ties inside a row: top_k/top_p keep every token tied at their cut, HF cuts inside
P = np.array([[[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.15, 0.05, 0.8]],
              [[0.35, 0.25, 0.4], [0.7, 0.2, 0.1], [0.2, 0.55, 0.25]],
              [[0.5, 0.1, 0.4], [0.12, 0.8, 0.08], [0.3, 0.6, 0.1]]], np.float32)
Q = np.array([[0.1, 0.2, 0.7], [0.8, 0.1, 0.1]], np.float32)      # drafter marginals for depths 1..L
PROMPT, ROOT = [0], 1                                              # the root: the first token, emitted already
CONFIGS = {
    "temperature": (dict(), 0.6),
    "top_k": (dict(top_k=2), 1.0),
    "top_p": (dict(top_p=0.65), 1.0),           # values away from the table's exact boundaries
    "min_p": (dict(min_p=0.45), 1.0),
    "presence_frequency": (dict(presence_penalty=1.5, frequency_penalty=0.8), 1.0),
    "repetition": (dict(repetition_penalty=2.5), 1.0),
    "logit_bias": (dict(logit_bias={2: 1.5, 0: -1.0}), 1.0),
    "combination": (dict(top_k=2, top_p=0.95, min_p=0.05, presence_penalty=0.6, frequency_penalty=0.4,
                         repetition_penalty=1.3, logit_bias={1: 0.7}), 1.3),
    "combination_without_top_k": (dict(top_p=0.9, min_p=0.1, presence_penalty=0.6, frequency_penalty=0.4,
                                       repetition_penalty=1.3, logit_bias={1: 0.7}), 1.2),
}


# A schema on the toy vocabulary: the automaton's state is the last token; 0 may not follow 1, 2 may not follow 2
REFUSED = {(1, 0), (2, 2)}
NEXT = np.array([[c if (s, c) not in REFUSED else -1 for c in range(V)] for s in range(V)], np.int32)


def ar_distribution(values, temperature, schema=False):
    """P(first three tokens after the root) under the processed conditionals (with ``schema``: the target's
    logits masked by the automaton first, as the engine does), by brute force."""
    def cond(seq):                                  # seq: the generated tokens so far (root first)
        prev2 = (PROMPT + seq)[-2]
        logits = np.log(P[prev2, seq[-1]])
        if schema:
            logits = np.where(NEXT[seq[-1]] >= 0, logits, -np.inf)
        out = ref_process(logits, values, PROMPT, seq, temperature)
        return np.exp(out - np.logaddexp.reduce(out))

    dist = np.zeros((V,) * 3)
    for a in range(V):
        for b in range(V):
            for c in range(V):
                dist[a, b, c] = cond([ROOT])[a] * cond([ROOT, a])[b] * cond([ROOT, a, b])[c]
    return dist


@functools.partial(jax.jit, static_argnames="schema")
def tree_round(key, prev2, root, s, history, temperature, schema=False):
    """One DDTree round on the toy chain; with ``schema``, under the automaton through the engine's pieces: the
    tree keeps only allowed prefixes, every node's state masks the target's logits there (``constrained.mask``)
    before the processors."""
    rows = root.shape[0]
    draft = jnp.broadcast_to(jnp.log(jnp.asarray(Q)), (rows, L, V))
    if schema:
        tables = GrammarTables(jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), (rows, V)),
                               jnp.broadcast_to(jnp.asarray(NEXT), (rows, V, V)), jnp.ones((rows, V), bool))
        step = constrained.step(tables)
        tree = ddtree.build_tree(root, draft, 6, step, root, constrained.allowed(tables, root[:, None])[:, 0])
    else:
        tree = ddtree.build_tree(root, draft, 6)
    parent_tok = jnp.where(tree.parents >= 0, jnp.take_along_axis(tree.tokens, jnp.maximum(tree.parents, 0), 1),
                           prev2[:, None])
    logits = jnp.log(jnp.asarray(P)[parent_tok, tree.tokens])                          # [rows, 1+N, V]
    if schema:
        logits = constrained.mask(logits, tables, ddtree.node_states(tree, step, root, L))
    target = processors.choose(logits, s, history, temperature, key, True, tree)
    path, path_len, bonus = ddtree.walk(tree, target, L)
    tokens = jnp.take_along_axis(tree.tokens, jnp.maximum(path, 0), 1)
    emitted = jnp.where(jnp.arange(L + 1) == (path_len - 1)[:, None], bonus[:, None],
                        jnp.concatenate([tokens[:, 1:], tokens[:, :1]], 1))
    return emitted, path_len


def first_three(values, temperature, seed=0, schema=False):
    s = processors.sampling(ROWS, V, **values)
    seq = np.zeros((ROWS, 2 + 3 * (L + 1)), np.int32)       # prompt, root, then what the rounds emit
    seq[:, 0], seq[:, 1] = PROMPT[0], ROOT
    n = np.full(ROWS, 2)
    counts = np.zeros((ROWS, V), np.int32)
    counts[:, ROOT] = 1
    in_prompt = np.zeros((ROWS, V), bool)
    in_prompt[:, PROMPT] = True
    key = jax.random.key(seed)
    rows = np.arange(ROWS)
    while n.min() < 5:
        key, sub = jax.random.split(key)
        history = processors.History(counts=jnp.asarray(counts), in_prompt=jnp.asarray(in_prompt))
        emitted, path_len = jax.device_get(tree_round(sub, jnp.asarray(seq[rows, n - 2]), jnp.asarray(seq[rows, n - 1]),
                                                      s, history, jnp.float32(temperature), schema=schema))
        for j in range(L + 1):
            take = j < path_len
            seq[rows[take], n[take] + j] = emitted[take, j]
            np.add.at(counts, (rows[take], emitted[take, j]), 1)
        n = n + path_len
    return seq[:, 2:5]


def chi2_test(samples, dist):
    """Pearson's chi-square over the 27 outcomes; outcomes the processors forbid must never occur, and rare
    ones are pooled (expected < 5) so the statistic follows its distribution."""
    counts = np.zeros((V,) * 3)
    np.add.at(counts, tuple(samples.T), 1)
    counts, expected = counts.ravel(), dist.ravel() * len(samples)
    assert counts[expected == 0].sum() == 0
    rare = (expected > 0) & (expected < 5)
    obs = np.append(counts[expected >= 5], counts[rare].sum())
    exp = np.append(expected[expected >= 5], expected[rare].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    return stat, float(scipy.stats.chi2.ppf(0.999, len(exp) - 1))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ddtree_sampling_with_processors_is_lossless(name):
    values, temperature = CONFIGS[name]
    stat, critical = chi2_test(first_three(values, temperature), ar_distribution(values, temperature))
    print(f"chi2[{name}] = {stat:.1f} (critical {critical:.1f})")
    assert stat < critical


@pytest.mark.parametrize("name", ["temperature", "combination"])
def test_ddtree_sampling_under_a_schema_is_lossless(name):
    """The tree under an automaton, each node's state masking the target: accepted tokens are AR sampling from
    the masked, processed distribution (refused continuations never occur: chi2_test asserts it)."""
    values, temperature = CONFIGS[name]
    samples = first_three(values, temperature, schema=True)
    stat, critical = chi2_test(samples, ar_distribution(values, temperature, schema=True))
    print(f"chi2[{name} under a schema] = {stat:.1f} (critical {critical:.1f})")
    assert stat < critical


@pytest.mark.slow      # checks the chi-square harness itself (its power), not the library
def test_the_chi_square_test_sees_a_missing_path_correction(monkeypatch):
    """The same test fails if every node took the row's history alone (no path correction): it has power."""
    monkeypatch.setattr(processors, "_path_penalties", lambda biased, penalised, *a: penalised)
    jax.clear_caches()
    try:
        values, temperature = CONFIGS["presence_frequency"]
        stat, critical = chi2_test(first_three(values, temperature), ar_distribution(values, temperature))
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    print(f"chi2[presence_frequency without the path correction] = {stat:.1f} (critical {critical:.1f})")
    assert stat > 3 * critical


# ---- the engine: greedy DDTree == greedy AR with processors, one program for every value -----------------------

CFG = preset("tiny").replace(eos_token_ids=())
DCFG = dflash.DrafterConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=64, vocab_size=256, block_size=5, mask_token_id=255,
                            target_layer_ids=(0, 2))
PROMPTS = [[5, 6, 7, 5], list(range(20, 31))]
SETTINGS = dict(repetition_penalty=[1.4, 0.8], presence_penalty=[0.6, -0.5], frequency_penalty=[0.5, 1.2],
                logit_bias=[{6: 3.0, 100: -100}, {7: 4.0}])


@pytest.fixture(scope="module")
def model():
    return kimi_jax.Model(CFG, init_params(CFG, jax.random.key(0), scale=2.0),
                          drafter=dflash.Drafter(DCFG, dflash.init_params(DCFG, jax.random.key(1))))


DRAFT = dflash.draft


def oracle_draft(sequences, wrong_depth=1):
    """A drafter that knows the processed AR continuation, wrong on top at one depth (the true token second)."""
    table = jnp.asarray(sequences)

    def draft(p, c, target_params, cache, bonus, lengths, block_size, depth=None, rt=None):
        idx = lengths[:, None] + 1 + jnp.arange(block_size - 1 if depth is None else depth)[None, :]
        true = jnp.take_along_axis(table, jnp.minimum(idx, table.shape[1] - 1), axis=1)
        logits = 5.0 * jax.nn.one_hot(true, c.vocab_size)
        if logits.shape[1] <= wrong_depth:            # budget 0 drafts nothing
            return logits
        return logits.at[:, wrong_depth].add(6.0 * jax.nn.one_hot((true[:, wrong_depth] + 1) % c.vocab_size,
                                                                  c.vocab_size))
    return draft


@pytest.fixture(scope="module")
def processed_ar(model):
    """Greedy AR with SETTINGS, and a model whose drafter is the oracle of that continuation."""
    plain = model.generate(PROMPTS, 20, method="ar").tokens
    ar = model.generate(PROMPTS, 20, method="ar", **SETTINGS).tokens
    assert ar != plain                                      # the processors changed the continuation
    assert any(len(set(row)) < len(row) for row in ar)      # and tokens repeat: the penalties count them
    table = np.zeros((2, 64), np.int32)
    for i, (p, t) in enumerate(zip(PROMPTS, ar)):
        table[i, :len(p) + len(t)] = p + t
    jax.clear_caches()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dflash, "draft", oracle_draft(table))
        yield ar, kimi_jax.Model(CFG, model.params, drafter=model.drafter)   # no program compiled before the patch
    jax.clear_caches()


# Slow with its fixture (two AR programs, then the oracle's DDTree ones: ~60 s on a 2-core VM). The fast loop has
# the processors in the tree (test_ddtree_sampling_with_processors_is_lossless, test_each_node_is_processed_with_
# its_own_path_as_history) and through generate (test_every_value_shares_one_program).
@pytest.mark.slow
@pytest.mark.parametrize("budget", [0, 4, 32])
def test_greedy_ddtree_equals_greedy_ar_with_penalties_and_logit_bias(processed_ar, budget):
    ar, oracle = processed_ar
    out = oracle.generate(PROMPTS, 20, method="ddtree", budget=budget, **SETTINGS)
    assert out.tokens == ar
    if budget == 32:
        assert out.stats["mean_tau"] > 2.0            # long paths, with repeated tokens, were accepted


@pytest.mark.slow      # one more program: the sampling one
def test_sampling_ddtree_at_top_k_1_is_the_greedy_continuation(processed_ar):
    """top_k = 1 leaves each node one token, the argmax of its penalised logits: DDTree sampling (every node's
    history, the truncation, the first token from prefill) must then emit exactly the greedy AR tokens."""
    ar, oracle = processed_ar
    out = oracle.generate(PROMPTS, 20, method="ddtree", budget=32, temperature=0.8, seed=3, top_k=1, **SETTINGS)
    assert out.tokens == ar and out.stats["mean_tau"] > 2.0


def test_every_value_shares_one_program(model):
    first = model.generate(PROMPTS, 8, method="ar", temperature=0.9, seed=1, top_k=[3, 0], top_p=0.8)
    again = model.generate(PROMPTS, 8, method="ar", temperature=0.5, seed=2, min_p=[0.1, 0.2], presence_penalty=1.0,
                           logit_bias=[{}, {1: 2}])
    assert again.stats["compile_s"] == 0.0 and first.stats["new_tokens"] == again.stats["new_tokens"] == 16
    assert not model.prepare(PROMPTS, 8, "ar").spec.process                # no processors: today's program
    assert model.prepare(PROMPTS, 8, "ar", top_p=0.5).spec.process
    assert not model.prepare(PROMPTS, 8, "ar", top_p=1.0, logit_bias={}).spec.process   # defaults are off


@pytest.mark.parametrize("kw,says", [
    (dict(top_p=0.0), "top_p must be a finite number in (0, 1]"),
    (dict(top_k=-1), "top_k must be an integer in [0,"),
    (dict(top_k=2.5), "top_k must be an integer"),
    (dict(min_p=1.5), "min_p must be a finite number in [0, 1]"),
    (dict(presence_penalty=2.5), "presence_penalty must be a finite number in [-2, 2]"),
    (dict(frequency_penalty=[0.0, float("nan")]), "frequency_penalty must be a finite number in [-2, 2]"),
    (dict(repetition_penalty=0), "repetition_penalty must be a finite number in (0, 100]"),
    (dict(logit_bias={1: 101}), "logit_bias must be a map of at most 300 token ids to numbers in [-100, 100]"),
    (dict(logit_bias={"x": 1}), "logit_bias must be a map"),
    (dict(logit_bias={i: 1 for i in range(LOGIT_BIAS_ENTRIES + 1)}), "logit_bias must be a map of at most 300"),
    (dict(logit_bias={256: 1}), "logit_bias token id 256 is outside the vocabulary [0, 256)"),
    (dict(top_k=[1, 2, 3]), "top_k has 3 values for 2 rows"),
])
def test_bad_values_name_the_field_and_its_range(model, kw, says):
    with pytest.raises(GenerationError) as e:
        model.generate(PROMPTS, 4, method="ar", **kw)
    assert says in str(e.value)


def test_inputs_refuse_processors_the_request_was_not_prepared_with(model):
    request = model.prepare(PROMPTS, 4, "ar")
    with pytest.raises(GenerationError, match="prepared without logits processors"):
        model.inputs(request, top_k=3)


@pytest.mark.slow      # two more programs (prefill, chunk); the round they run is generate's
def test_stream_carries_the_history_across_dispatches(model):
    want = model.generate(PROMPTS, 12, method="ar", **SETTINGS).tokens
    *chunks, last = model.stream(PROMPTS, 12, method="ar", rounds_per_dispatch=3, **SETTINGS)
    assert last.tokens == want and len(chunks) > 1


# Slow (a fresh model and its sampling programs, ~20-30 s each): the fast loop has a temperature per row in
# test_each_processor_matches_hf_with_a_value_per_row[temperature], values per row through generate in
# test_every_value_shares_one_program, DDTree sampling at a temperature in test_ddtree_sampling_with_processors_...
@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_each_row_samples_at_its_own_temperature(monkeypatch, method):
    """Per-row temperatures in one program: a row's tokens do not depend on another row's temperature (the same
    key, the same draws), and a row at 0 in a sampling batch decodes what greedy decoding does."""
    monkeypatch.setattr(dflash, "draft", DRAFT)      # the real drafter, whatever processed_ar patched
    jax.clear_caches()
    model = kimi_jax.Model(CFG, init_params(CFG, jax.random.key(0), scale=2.0),
                           drafter=dflash.Drafter(DCFG, dflash.init_params(DCFG, jax.random.key(1))))
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1]]
    mixed = model.generate(prompts, 12, method=method, budget=4, temperature=[0.0, 1.5, 0.7], seed=3).tokens
    other = model.generate(prompts, 12, method=method, budget=4, temperature=[1.0, 1.5, 0.7], seed=3).tokens
    greedy = model.generate(prompts[:1], 12, method=method, budget=4).tokens[0]
    assert mixed[0] == greedy and mixed[0] != mixed[1]
    assert mixed[1:] == other[1:]
    with pytest.raises(GenerationError, match="one per row"):
        model.generate(prompts, 4, method=method, temperature=[1.0, 1.0])
    jax.clear_caches()
