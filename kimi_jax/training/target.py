"""Training of the embedded default target model.

    python -m kimi_jax.train target [--steps N] [--batch 16] [--seq-len 256] ...

trains a small Kimi-K2-architecture model (MLA, dense first layer, 16 sigmoid-routed experts top-2 + 1
shared, YaRN) on the Python standard library's source (``kimi_jax.training.corpus``), on CPU, and writes a regular
kimi_jax checkpoint (``kimi_config.json`` + orbax ``params/`` + the BPE tokenizer) that ``kimi_jax.load``
opens. Rerunning the same command resumes from the latest train state (params, AdamW moments, step, seed)
in ``--state-dir``; the data order is a function of (seed, step) only, so a resumed run sees the same
batches as an uninterrupted one.

The training forward is the serving forward (``transformer.causal_forward``, full-form attention), which also
returns each MoE layer's expert loads (counts of the router's choices, which the aux-loss-free balancing
needs); the routed experts run in the dense layout. tests/test_train.py checks its logits against
``transformer.full_logits``.

Load balancing is DeepSeek-V3's auxiliary-loss-free rule: after each step, for every MoE layer,
``bias_e += gamma * sign(mean_load - load_e)`` with the loads of that step's batch; the router bias gets no
gradient and no weight decay. The optimiser: ``kimi_jax.training.optim``.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.config import ModelConfig
from kimi_jax.model.compute_layout import to_compute_layout
from kimi_jax.model.params import with_experts
from kimi_jax.model.transformer import causal_forward
from kimi_jax.training import corpus
from kimi_jax.training.optim import Hyper, adamw, lr_at
from kimi_jax.weights.checkpoint import restore_tree, save_tree

TOKENIZER_VOCAB = 4096
BIAS_PATH = ("moe_layers", "moe", "router_bias")


def target_config(vocab_size: int = TOKENIZER_VOCAB, eos_id: int | None = None) -> ModelConfig:
    """The embedded default target: the K2 topology at a size that trains on a CPU in minutes."""
    return ModelConfig(
        name="kimi-jax-target-stdlib", vocab_size=vocab_size, hidden_size=128, intermediate_size=256,
        moe_intermediate_size=64, num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4,
        q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-5, rope_theta=50000.0,
        max_position_embeddings=1024, rope_factor=4.0, rope_original_max_position_embeddings=256,
        rope_beta_fast=32.0, rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0,
        bos_token_id=None, eos_token_ids=() if eos_id is None else (eos_id,),
    )


# ---- tokenizer and data ----------------------------------------------------------------------------------

def build_tokenizer(out_dir: str, vocab_size: int = TOKENIZER_VOCAB, max_bytes: int = 20_000_000):
    """Train the BPE on the training split (capped at max_bytes characters) unless out_dir already has one."""
    from kimi_jax.text.tokenizer import BPETokenizer, load_tokenizer
    if os.path.isfile(os.path.join(out_dir, "tokenizer.json")):
        return load_tokenizer(out_dir)
    t0 = time.time()
    docs = corpus.read_split("train", max_bytes=max_bytes)
    tok = BPETokenizer.train([t for _, t in docs], vocab_size)
    tok.save(out_dir)
    print(f"tokenizer: {vocab_size} ids trained on {len(docs)} files in {time.time() - t0:.0f}s", flush=True)
    return tok


def token_stream(tok, split: str, cache_path: str | None = None) -> np.ndarray:
    """All files of a split encoded and joined, each followed by EOS (cached as .npy when cache_path is given)."""
    if cache_path and os.path.exists(cache_path):
        return np.load(cache_path)
    eos = tok.eos_ids[0]
    ids: list[int] = []
    for _, text in corpus.read_split(split):
        ids.extend(tok.encode(text, allowed_special=()))
        ids.append(eos)
    arr = np.asarray(ids, np.int32)
    if cache_path:
        os.makedirs(os.path.dirname(cache_path), exist_ok=True)
        np.save(cache_path, arr)
    return arr


def sample_batch(stream: np.ndarray, seed: int, step: int, batch: int, seq_len: int) -> np.ndarray:
    """[batch, seq_len + 1] random windows; a function of (seed, step) only, so resuming is exact."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
    return np.stack([stream[s:s + seq_len + 1] for s in starts])


def eval_windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping windows [n, seq_len + 1] from the start of a stream (the fixed held-out set)."""
    n = (len(stream) - 1) // seq_len
    return np.stack([stream[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)])


# ---- training forward --------------------------------------------------------------------------------------

def train_forward(params, cfg: ModelConfig, tokens):
    """Causal forward over tokens [b, t] -> (logits [b, t, V] float32, expert loads [n_moe_layers, E]).

    The serving forward itself (full-form attention); the routed experts in the dense layout
    (``compute_layout.to_compute_layout``: every token through every expert, weighted by its routing coefficient), whose
    backward has no per-token weight gathers, which are slow to differentiate on a CPU."""
    dense = to_compute_layout(params["moe_layers"]["moe"]["experts"], cfg, dense=True)
    out = causal_forward(with_experts(params, dense), cfg, tokens, attn_form="full")
    return out.logits, out.loads


def cross_entropy(logits, targets):
    logz = jax.nn.logsumexp(logits, axis=-1)
    gold = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - gold)


def _is_bias(path) -> bool:
    return tuple(getattr(k, "key", None) for k in path) == BIAS_PATH


def init_state(params) -> dict:
    zeros = jax.tree.map(jnp.zeros_like, params)
    return {"params": params, "mu": zeros, "nu": jax.tree.map(jnp.zeros_like, params),
            "step": jnp.zeros((), jnp.int32)}


def balance_bias(bias, loads, gamma):
    """Aux-loss-free balancing: raise under-loaded experts' bias, lower over-loaded ones' (per layer)."""
    mean = loads.mean(axis=-1, keepdims=True)
    return bias + gamma * jnp.sign(mean - loads)


@functools.lru_cache(maxsize=8)
def make_train_step(cfg: ModelConfig, hp: Hyper):
    def loss_fn(params, batch):
        logits, loads = train_forward(params, cfg, batch[:, :-1])
        return cross_entropy(logits, batch[:, 1:]), loads

    @jax.jit
    def step_fn(state, batch):
        params, step = state["params"], state["step"]
        (loss, loads), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        lr = lr_at(step, hp)
        new_p, mu, nu, gnorm = adamw(params, grads, state["mu"], state["nu"], step + 1, lr, hp, frozen=_is_bias)
        if cfg.num_moe_layers:
            moe = new_p["moe_layers"]["moe"]
            moe["router_bias"] = balance_bias(moe["router_bias"], loads, hp.bias_gamma)
        new_state = {"params": new_p, "mu": mu, "nu": nu, "step": step + 1}
        return new_state, {"loss": loss, "gnorm": gnorm, "lr": lr, "loads": loads}

    return step_fn


def make_eval(cfg: ModelConfig):
    @jax.jit
    def eval_loss(params, batch):
        logits, _ = train_forward(params, cfg, batch[:, :-1])
        return cross_entropy(logits, batch[:, 1:])
    return eval_loss


def evaluate(eval_fn, params, windows: np.ndarray, batch: int) -> float:
    """Mean CE over all windows (every window has the same length, so the mean of batch means is exact
    when the last batch is padded by repeating windows and those are dropped from the average)."""
    total, n = 0.0, len(windows)
    for i in range(0, n, batch):
        chunk = windows[i:i + batch]
        k = len(chunk)
        if k < batch:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - k, 0)])
            # Per-window losses are needed for a partial batch: evaluate the real ones one by one.
            for j in range(k):
                total += float(eval_fn(params, np.repeat(chunk[j:j + 1], batch, 0)))
            continue
        total += float(eval_fn(params, chunk)) * k
    return total / n


# ---- train state on disk ---------------------------------------------------------------------------------

_STATE_RE = re.compile(r"^step_(\d+)$")


def latest_state(state_dir: str) -> str | None:
    if not os.path.isdir(state_dir):
        return None
    found = sorted((int(m.group(1)), d) for d in os.listdir(state_dir) if (m := _STATE_RE.match(d)))
    return os.path.join(state_dir, found[-1][1]) if found else None


def save_state(state_dir: str, state: dict, seed: int, keep: int = 2) -> str:
    step = int(state["step"])
    path = os.path.abspath(os.path.join(state_dir, f"step_{step:08d}"))
    if os.path.exists(path):
        return path
    os.makedirs(state_dir, exist_ok=True)
    save_tree(path, {**state, "seed": jnp.asarray(seed, jnp.int32)})
    old = sorted(d for d in os.listdir(state_dir) if _STATE_RE.match(d))[:-keep]
    for d in old:
        shutil.rmtree(os.path.join(state_dir, d), ignore_errors=True)
    return path


def load_state(path: str, like: dict) -> tuple[dict, int]:
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                          {**like, "seed": jnp.zeros((), jnp.int32)})
    restored = restore_tree(path, target)
    seed = int(restored.pop("seed"))
    return restored, seed


# ---- the loop --------------------------------------------------------------------------------------------

def train(cfg: ModelConfig, stream: np.ndarray, *, steps: int, batch: int, seq_len: int, seed: int,
          hp: Hyper, state_dir: str | None = None, save_every: int = 100, log_every: int = 10,
          log=print, init_scale: float = 1.0):
    """Train (resuming from state_dir when it holds a state); returns the final state and the loss history."""
    from kimi_jax.model.params import init_params
    state = init_state(init_params(cfg, jax.random.PRNGKey(seed), jnp.float32, init_scale))
    if state_dir and (path := latest_state(state_dir)):
        state, saved_seed = load_state(path, state)
        if saved_seed != seed:
            raise ValueError(f"{path} was trained with seed {saved_seed}, not {seed}")
        log(f"resumed from {path} at step {int(state['step'])}")
    step_fn = make_train_step(cfg, hp)
    history = []
    start = int(state["step"])
    t0 = time.time()
    tokens_per_step = batch * seq_len
    for step in range(start, steps):
        state, m = step_fn(state, sample_batch(stream, seed, step, batch, seq_len))
        done = step + 1
        if done % log_every == 0 or done == steps or done == start + 1:
            loss = float(m["loss"])
            history.append((done, loss))
            el = time.time() - t0
            rate = (done - start) * tokens_per_step / max(el, 1e-9)
            eta = (steps - done) * tokens_per_step / max(rate, 1e-9)
            loads = np.asarray(m["loads"])
            imb = float((loads.max(-1) / loads.mean(-1)).max()) if loads.size else 1.0
            bar = "#" * int(30 * done / steps)
            log(f"step {done}/{steps} [{bar:<30}] loss {loss:.4f} gnorm {float(m['gnorm']):.2f} "
                f"lr {float(m['lr']):.2e} max/mean load {imb:.2f} {rate:.0f} tok/s "
                f"elapsed {el:.0f}s eta {eta:.0f}s")
        if state_dir and (done % save_every == 0 or done == steps):
            save_state(state_dir, state, seed)
    return state, history


def to_save_dtype(params, dtype):
    """Cast floating weights to dtype, keeping the float32 router bias."""
    return jax.tree_util.tree_map_with_path(
        lambda path, a: a if _is_bias(path) or not jnp.issubdtype(a.dtype, jnp.floating) else a.astype(dtype),
        params)


def dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def run(args) -> int:
    """``python -m kimi_jax.train target``: tokenizer, data, training (resumable), evaluation, checkpoint."""
    from kimi_jax.weights import checkpoint
    out, state_dir = args.out, args.state_dir
    os.makedirs(state_dir, exist_ok=True)
    logf = open(os.path.join(state_dir, "train.log"), "a")

    def log(msg):
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    log(f"command: {' '.join(sys.argv)}")
    tok = build_tokenizer(out, args.vocab)
    eos = tok.eos_ids[0]
    specials = dict(tok.special_tokens)
    if max(specials.values()) >= args.vocab or tok.vocab_size > args.vocab:
        raise SystemExit(f"tokenizer ids {specials} do not fit vocab {args.vocab}")
    cfg = target_config(args.vocab, eos)
    t0 = time.time()
    train_stream = token_stream(tok, "train", os.path.join(state_dir, "tokens_train.npy"))
    held_stream = token_stream(tok, "heldout", os.path.join(state_dir, "tokens_heldout.npy"))
    log(f"data: {len(train_stream)} train tokens, {len(held_stream)} held-out tokens "
        f"({time.time() - t0:.0f}s to encode)")
    from kimi_jax.config import param_count
    log(f"config: {cfg}")
    log(f"params: {param_count(cfg)}")
    hp = Hyper(lr=args.lr, warmup=args.warmup, total=args.steps, bias_gamma=args.bias_gamma)
    t_train = time.time()
    state, history = train(cfg, train_stream, steps=args.steps, batch=args.batch, seq_len=args.seq_len,
                           seed=args.seed, hp=hp, state_dir=state_dir, save_every=args.save_every,
                           log_every=args.log_every, log=log)
    log(f"training loop wall time this run: {time.time() - t_train:.0f}s")
    if args.dry_run:
        return 0
    params = state["params"]
    windows = eval_windows(held_stream, args.seq_len)
    ev = make_eval(cfg)
    held32 = evaluate(ev, params, windows, args.batch)
    saved = to_save_dtype(params, jnp.bfloat16 if args.save_dtype == "bfloat16" else jnp.float32)
    held_saved = evaluate(ev, jax.tree.map(lambda a: a.astype(jnp.float32), saved), windows, args.batch)
    last = [l for _, l in history[-5:]]
    log(f"final train loss (mean of last {len(last)} logged): {np.mean(last) if last else float('nan'):.4f}")
    log(f"held-out loss over {len(windows)} windows of {args.seq_len}: float32 {held32:.4f}, "
        f"{args.save_dtype} {held_saved:.4f}")
    if args.int4:
        # The shipped format: routed experts as compressed-tensors INT4 (group 32), the rest in save_dtype.
        from kimi_jax.model.params import quantize_experts
        saved, cfg = quantize_experts(jax.tree.map(np.asarray, saved), cfg)
        held_int4 = evaluate_model(saved, cfg, windows, args.batch)
        log(f"held-out loss with INT4 experts: {held_int4:.4f} (float {held_saved:.4f})")
    if os.path.exists(os.path.join(out, checkpoint.PARAMS_DIR)):
        shutil.rmtree(os.path.join(out, checkpoint.PARAMS_DIR))
    checkpoint.save(out, cfg, saved)
    log(f"saved {out}: {dir_size(out) / 1e6:.2f} MB")
    return 0


def evaluate_model(params, cfg: ModelConfig, windows: np.ndarray, batch: int) -> float:
    """Held-out CE through the serving model (kimi_jax.model.transformer.full_logits), e.g. with INT4 experts."""
    from kimi_jax.model.transformer import full_logits

    @jax.jit
    def ce(params, b):
        logits = full_logits(params, cfg, b[:, :-1], attn_form="absorbed")
        return cross_entropy(logits, b[:, 1:])

    return evaluate(ce, params, windows, batch)
