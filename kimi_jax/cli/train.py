"""``python -m kimi_jax.train target|drafter``: train the embedded default target or a DFlash drafter for it."""

from __future__ import annotations

import argparse
import sys

from kimi_jax.cli.exits import exit_with, run_command


def _parser() -> argparse.ArgumentParser:
    from kimi_jax.training.target import TOKENIZER_VOCAB
    ap = argparse.ArgumentParser(prog="python -m kimi_jax.train", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("target", help="train the embedded default target model (resumes from --state-dir)")
    t.add_argument("--out", default="checkpoints/target")
    t.add_argument("--state-dir", default="checkpoints/target_train/train_state")
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--batch", type=int, default=16)
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--bias-gamma", type=float, default=1e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--vocab", type=int, default=TOKENIZER_VOCAB)
    t.add_argument("--save-every", type=int, default=100)
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--save-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    t.add_argument("--dry-run", action="store_true", help="train only (no eval, no final checkpoint)")
    t.add_argument("--int4", action=argparse.BooleanOptionalAction, default=True,
                   help="store the routed experts as INT4 (group 32), as K2.6 does")
    d = sub.add_parser("drafter", help="train a DFlash drafter for a target")
    d.add_argument("--target", default="checkpoints/target")
    d.add_argument("--out", default="checkpoints/drafter")
    d.add_argument("--layers", type=int, default=2)
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--taps", default="1,2,3")
    d.add_argument("--sequences", type=int, default=256)
    d.add_argument("--prompt-len", type=int, default=64)
    d.add_argument("--new-tokens", type=int, default=192)
    d.add_argument("--steps", type=int, default=600)
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--blocks", type=int, default=12)
    d.add_argument("--lr", type=float, default=1e-3)
    d.add_argument("--seed", type=int, default=0)
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.what == "drafter":
        from kimi_jax.training import drafter as job
    else:
        from kimi_jax.training import target as job
    return run_command(f"kimi_jax.train {args.what}", lambda: job.run(args))


if __name__ == "__main__":
    exit_with(main())
