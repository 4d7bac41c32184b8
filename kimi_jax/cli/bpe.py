"""``python -m kimi_jax.cli.bpe --out DIR --vocab-size 4096 FILE_OR_DIR...``: train a byte-level BPE tokenizer."""

from __future__ import annotations

import argparse
import os
import time
from typing import Iterable

from kimi_jax.text.bpe import CODE_PATTERN, count_words, train_bpe
from kimi_jax.text.tokenizer import BPETokenizer


def _read_corpus(paths: list[str], exts: tuple[str, ...]) -> Iterable[str]:
    for path in paths:
        if os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs.sort()
                for name in sorted(files):
                    if name.endswith(exts):
                        yield from _read_corpus([os.path.join(root, name)], exts)
        else:
            with open(path, encoding="utf-8", errors="replace") as fh:
                yield fh.read()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kimi_jax.cli.bpe", description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="+", help="text files or directories")
    ap.add_argument("--out", required=True, help="output tokenizer directory")
    ap.add_argument("--vocab-size", type=int, default=4096,
                    help="total ids: mergeable ranks + the BPETokenizer specials after them")
    ap.add_argument("--ext", default=".py", help="comma-separated file suffixes read from directories")
    ap.add_argument("--max-mb", type=float, default=0, help="stop reading after this many MB (0: all)")
    args = ap.parse_args(argv)

    texts, total = [], 0
    for t in _read_corpus(args.inputs, tuple(args.ext.split(","))):
        texts.append(t)
        total += len(t.encode("utf-8"))
        if args.max_mb and total >= args.max_mb * 1e6:
            break
    t0 = time.perf_counter()
    counts = count_words(texts, CODE_PATTERN)
    t1 = time.perf_counter()
    n_ranks = args.vocab_size - len(BPETokenizer.SPECIALS)
    ranks = train_bpe([], n_ranks, CODE_PATTERN, word_counts=counts, verbose=True)
    t2 = time.perf_counter()
    BPETokenizer(ranks, CODE_PATTERN).save(args.out)
    print(f"{total / 1e6:.1f} MB, {len(counts)} distinct pieces; pre-tokenize {t1 - t0:.1f}s, "
          f"merges {t2 - t1:.1f}s, total {(total / 1e6) / (t2 - t0):.2f} MB/s -> {args.out}")


if __name__ == "__main__":
    main()
