"""Train a DFlash drafter for a target ([dflash-drafter] in docs/sources.md, training-time view).

Data are the target's own greedy continuations of corpus prompts (what the drafter must predict at serving
time). Per training sequence the target's tapped hidden states are computed once; random anchors a pick
blocks ``[seq[a], MASK x (bs-1)]`` at positions a..a+bs-1 whose labels are ``seq[a+1 .. a+bs-1]``. A block sees
the context rows before its anchor and its own block, bidirectionally, never another block, so many blocks pack
into one drafter forward. The loss weights in-block position k by exp(-(k-1)/gamma). The target's embedding and
lm_head are shared and frozen; only fc, the norms and the drafter layers train.

    python -m kimi_jax.train drafter --target checkpoints/target --out checkpoints/drafter
"""

from __future__ import annotations

import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.cache import init_cache
from kimi_jax.decoding import drafter as dflash
from kimi_jax.model.transformer import forward
from kimi_jax.training.optim import Hyper, adamw
from kimi_jax.weights.drafter import save_drafter


def make_sequences(model, prompts: list[list[int]], new_tokens: int, batch: int = 32) -> np.ndarray:
    """prompt + the target's greedy continuation, for every prompt (equal prompt lengths)."""
    rows = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        out = model.generate(chunk, max_new_tokens=new_tokens, method="ar")
        for p, t in zip(chunk, out.tokens):
            rows.append((p + t + [0] * new_tokens)[:len(p) + new_tokens])
    return np.asarray(rows, np.int32)


def block_batch(rng: np.random.Generator, seqs: np.ndarray, n_blocks: int, bs: int, mask_id: int):
    """Anchors and the packed block inputs/labels/masks for a batch of sequences [b, t]."""
    b, t = seqs.shape
    anchors = np.stack([np.sort(rng.choice(np.arange(1, t - bs + 1), n_blocks, replace=False)) for _ in range(b)])
    offs = np.arange(bs)
    pos = anchors[:, :, None] + offs                                          # [b, nb, bs]
    tokens = np.where(offs == 0, np.take_along_axis(seqs, anchors, 1)[:, :, None], mask_id)
    # Slot j (at position a + j) predicts the token at its own position, as serving reads logits[:, 1:] for
    # positions P + 1 .. P + bs - 1; slot 0 (the anchor) is not predicted.
    labels = np.take_along_axis(seqs, pos.reshape(b, -1), 1).reshape(b, n_blocks, bs)
    return anchors.astype(np.int32), tokens.reshape(b, -1).astype(np.int32), pos.reshape(b, -1).astype(np.int32), \
        labels.reshape(b, -1).astype(np.int32)


def packed_logits(dparams, dcfg, target_params, taps, anchors, tokens, positions):
    """Drafter logits [b, nb*bs, vocab] for nb blocks per sequence in one forward: block i sees the context rows
    before its anchor and its own block only (what serving sees for a bonus token at that anchor)."""
    b, t = taps.shape[1], taps.shape[2]
    nb = anchors.shape[1]
    bs = tokens.shape[1] // nb
    ctx_pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    k, v = dflash.context_kv(dparams, dcfg, dflash.context_features(dparams, dcfg, taps), ctx_pos)
    ctx_visible = jnp.arange(t)[None, None, :] < jnp.repeat(anchors, bs, axis=1)[:, :, None]
    block_id = jnp.arange(nb * bs) // bs
    block_mask = jnp.broadcast_to(block_id[:, None] == block_id[None, :], (b, nb * bs, nb * bs))
    return dflash.block_logits(dparams, dcfg, target_params, tokens, positions, k, v, ctx_pos, ctx_visible,
                               block_mask)


def loss_fn(dparams, dcfg, target_params, taps, anchors, tokens, positions, labels, gamma):
    b, nb = anchors.shape
    bs = tokens.shape[1] // nb
    logits = packed_logits(dparams, dcfg, target_params, taps, anchors, tokens, positions)
    logp = jax.nn.log_softmax(logits, -1)
    nll = -jnp.take_along_axis(logp, labels[..., None], -1)[..., 0]           # [b, nb*bs]
    slot = jnp.arange(nb * bs) % bs
    weight = jnp.where(slot == 0, 0.0, jnp.exp(-(slot - 1) / gamma))           # the anchor slot is not predicted
    acc = (jnp.argmax(logits, -1) == labels) & (slot > 0)
    return jnp.sum(nll * weight) / (b * jnp.sum(weight[:bs]) * nb), jnp.sum(acc) / (b * nb * (bs - 1))


@functools.partial(jax.jit, static_argnames=("dcfg", "cfg"))
def target_taps(target_params, seqs, *, cfg, dcfg):
    cache = init_cache(cfg, seqs.shape[0], seqs.shape[1], target_params["embed"].dtype)
    return forward(target_params, cfg, seqs, cache, taps=dcfg.target_layer_ids).taps


@functools.partial(jax.jit, static_argnames=("dcfg",), donate_argnums=(0, 1))
def train_step(dparams, opt, target_params, taps, anchors, tokens, positions, labels, step, lr, *, dcfg, gamma=7.0):
    (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(dparams, dcfg, target_params, taps, anchors,
                                                                    tokens, positions, labels, gamma)
    dparams, mu, nu, _ = adamw(dparams, grads, *opt, step, lr, Hyper(weight_decay=0.01))
    return dparams, (mu, nu), loss, acc


def run(a) -> int:
    """``python -m kimi_jax.train drafter``: target continuations, their taps, training, the drafter checkpoint."""
    import kimi_jax
    from kimi_jax.training import corpus
    t0 = time.time()
    model = kimi_jax.load(a.target)
    cfg, tok = model.config, model.tokenizer
    d = cfg.hidden_size
    dcfg = dflash.DrafterConfig(hidden_size=d, num_hidden_layers=a.layers, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=d // 4, intermediate_size=2 * d,
                                vocab_size=cfg.vocab_size, block_size=a.block_size, mask_token_id=tok.mask_id,
                                target_layer_ids=tuple(int(x) for x in a.taps.split(",")), rms_norm_eps=1e-5,
                                rope_theta=10000.0)
    rng = np.random.default_rng(a.seed)
    docs = corpus.read_split("train")                         # the target's training split
    prompts = []
    while len(prompts) < a.sequences:
        ids = tok.encode(docs[rng.integers(len(docs))][1])
        if len(ids) > a.prompt_len + 1:
            s = rng.integers(0, len(ids) - a.prompt_len)
            prompts.append(ids[s:s + a.prompt_len])
    seqs = make_sequences(model, prompts, a.new_tokens)
    print(f"{len(seqs)} target continuations of {a.new_tokens} tokens in {time.time() - t0:.0f}s", flush=True)
    taps = np.concatenate([np.asarray(target_taps(model.params, jnp.asarray(seqs[i:i + 32]), cfg=cfg, dcfg=dcfg))
                           for i in range(0, len(seqs), 32)], axis=1)         # [n_tap, n, t, d]
    dparams = dflash.init_params(dcfg, jax.random.key(a.seed))
    opt = (jax.tree.map(jnp.zeros_like, dparams), jax.tree.map(jnp.zeros_like, dparams))
    for step in range(1, a.steps + 1):
        rows = rng.choice(len(seqs), a.batch, replace=False)
        anchors, tokens, positions, labels = block_batch(rng, seqs[rows], a.blocks, a.block_size, tok.mask_id)
        lr = a.lr * min(1.0, step / 50) * 0.5 * (1 + math.cos(math.pi * step / a.steps))
        dparams, opt, loss, acc = train_step(dparams, opt, model.params, jnp.asarray(taps[:, rows]), anchors, tokens,
                                             positions, labels, jnp.float32(step), jnp.float32(lr), dcfg=dcfg)
        if step % 25 == 0 or step == a.steps:
            print(f"step {step}/{a.steps} loss {float(loss):.3f} block acc {float(acc):.3f} "
                  f"elapsed {time.time() - t0:.0f}s", flush=True)
    save_drafter(a.out, dflash.Drafter(dcfg, dparams))
    with open(os.path.join(a.out, "train_log.json"), "w") as f:
        json.dump({"args": vars(a), "final_loss": float(loss), "final_block_acc": float(acc),
                   "wall_s": time.time() - t0}, f, indent=1)
    print(f"saved {a.out} in {time.time() - t0:.0f}s")
    return 0
