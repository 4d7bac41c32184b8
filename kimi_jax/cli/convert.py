"""``python -m kimi_jax.convert --hf DIR --out DIR``: an HF K2.x checkpoint -> a layered kimi_jax checkpoint."""

from __future__ import annotations

import argparse

from kimi_jax.cli.exits import exit_with, run_command
from kimi_jax.weights.convert import convert_hf


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kimi_jax.convert",
                                description="Convert an HF Kimi K2.x checkpoint into a kimi_jax checkpoint "
                                            "(resumable: rerun the same command after an interruption).")
    p.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--out", required=True, help="output kimi_jax checkpoint directory")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="storage dtype of the non-expert weights")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    return run_command("kimi_jax.convert", lambda: _convert(a), extra_errors=(ValueError,))


def _convert(a) -> int:
    stats = convert_hf(a.hf, a.out, progress=not a.quiet, dtype=a.dtype)
    print(f"converted {stats['converted']} layers (skipped {stats['skipped']} already done) -> {a.out}: "
          f"{stats['bytes'] / 1e6:.1f} MB read in {stats['seconds']:.1f} s = {stats['mb_per_s']:.1f} MB/s, "
          f"peak RSS {stats['peak_rss_mib']:.0f} MiB")
    return 0


if __name__ == "__main__":
    exit_with(main())
