"""Log-probabilities of emitted tokens (``logprobs=n``): every new token's, under the target's raw distribution,
equals a plain forward's log-softmax over the prompt and the tokens before it (``Model.logits``, one full forward
with no cache, an independent path), for AR and DDTree, greedy and sampled, with processors on; the top n are
the n largest of that same distribution."""

import jax
import numpy as np
import pytest

from kimi_jax.cli.decode import DEFAULT_DRAFTER, DEFAULT_TARGET

pytestmark = pytest.mark.skipif(not (DEFAULT_TARGET / "kimi_config.json").exists(), reason="embedded default not built")
PROMPT = "for line in open('log.txt'):\n    "          # held out: written here


@pytest.fixture(scope="module")
def model():
    import kimi_jax
    return kimi_jax.load(str(DEFAULT_TARGET), drafter=str(DEFAULT_DRAFTER))


# Slow: each case compiles its own generate program of the embedded default (~15-20 s on a 2-core VM). The fast
# loop has logprobs in a batch's state (test_slot_buckets) and the prepared count (the test below).
@pytest.mark.slow
@pytest.mark.parametrize("method,budget,kw", [("ar", None, {}), ("ddtree", 8, {}),
                                              ("ddtree", 16, dict(temperature=1.0, seed=4, top_p=0.9,
                                                                  presence_penalty=0.5))])
def test_logprobs_are_the_plain_forwards(model, method, budget, kw):
    n = 4
    out = model.generate(PROMPT, 12, method=method, budget=budget, logprobs=n, **kw)
    ids = model.tokenizer.encode(PROMPT)
    tokens = out.tokens[0]
    log_p = np.asarray(jax.nn.log_softmax(model.logits(ids + tokens).astype(np.float32), -1))
    assert len(out.logprobs[0]) == len(tokens)
    for k, (t, (chosen, top)) in enumerate(zip(tokens, out.logprobs[0])):
        row = log_p[len(ids) - 1 + k]
        assert chosen == pytest.approx(float(row[t]), abs=2e-5)
        want = np.argsort(-row, kind="stable")[:n]
        assert [tok for tok, _ in top] == want.tolist()
        np.testing.assert_allclose([v for _, v in top], row[want], atol=2e-5)


@pytest.mark.slow      # its own stream and generate programs (~50 s)
def test_stream_reports_the_same_logprobs(model):
    *_, final = model.stream(PROMPT, 10, method="ddtree", budget=8, logprobs=2)
    want = model.generate(PROMPT, 10, method="ddtree", budget=8, logprobs=2)
    assert final.tokens == want.tokens
    np.testing.assert_allclose([c for c, _ in final.logprobs[0]], [c for c, _ in want.logprobs[0]], atol=1e-6)
    assert model.generate(PROMPT, 4, method="ar").logprobs is None


def test_inputs_take_up_to_the_prepared_count(model):
    """logprobs is the program's (static): the server's batches are prepared with the most (fields.LOGPROBS_MAX)
    and each row asks for its own count, cut on the host; more than prepared, or none prepared, is refused."""
    from kimi_jax.fields import GenerationError
    request = model.prepare([model.tokenizer.encode(PROMPT)], 4, "ar", logprobs=5)
    for n in (0, 2, 5):
        assert model.inputs(request, logprobs=n) is not None
    with pytest.raises(GenerationError, match="at least"):
        model.inputs(request, logprobs=6)
    with pytest.raises(GenerationError, match="at least"):
        model.inputs(model.prepare([model.tokenizer.encode(PROMPT)], 4, "ar"), logprobs=1)


@pytest.mark.slow     # a load onto 2 devices and a sampled DDTree program (~20 s)
def test_logprobs_on_a_mesh_are_one_devices(model):
    """On ep=2 the logits' vocabulary is split over the devices: the chosen token's log-probability is a masked
    sum and the top n a vocab.top_k, both by all-reduces. Same tokens and log-probabilities as one device."""
    import kimi_jax
    sharded = kimi_jax.load(str(DEFAULT_TARGET), drafter=str(DEFAULT_DRAFTER), mesh="ep=2")
    kw = dict(method="ddtree", budget=8, logprobs=3, temperature=1.0, seed=5, top_k=20)
    got, want = sharded.generate(PROMPT, 10, **kw), model.generate(PROMPT, 10, **kw)
    assert got.tokens == want.tokens
    for (c1, top1), (c2, top2) in zip(got.logprobs[0], want.logprobs[0]):
        assert c1 == pytest.approx(c2, abs=1e-4) and [t for t, _ in top1] == [t for t, _ in top2]
