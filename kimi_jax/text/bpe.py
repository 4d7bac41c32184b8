"""Byte-level BPE trainer producing tiktoken-style mergeable ranks.

Used to build the tokenizer of the small embedded model (see ``BPETokenizer`` in
``kimi_jax.text.tokenizer``).  The output is the same format Kimi ships: a mapping
``token bytes -> rank`` where ranks 0..255 are the single bytes and every later
rank is the concatenation of two tokens with lower ranks.

Algorithm (the classic word-frequency BPE):

1. Pre-tokenize every text with the regex ``pattern`` and count the pieces.
   BPE never merges across pieces, so training only needs the distinct pieces
   ("words") and how often each occurs.
2. Count adjacent token pairs over all words, weighted by word frequency, and
   index which words contain each pair.
3. Repeatedly take the most frequent pair (ties: smallest token ids, so the
   result is deterministic), give it a new rank and rewrite only the words that
   contain it, updating the pair counts incrementally.  A max-heap with lazy
   deletion finds the best pair without rescanning all counts.

Command line (trains and saves a tokenizer directory)::

    python -m kimi_jax.cli.bpe --out DIR --vocab-size 4096 FILE_OR_DIR...
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from typing import Iterable

import regex

# GPT-4 (cl100k) pre-tokenizer.  Chosen for code because it keeps identifiers
# whole (a single optional leading punctuation/space char + a letter run),
# splits numbers into groups of <= 3 digits, keeps operator runs together and
# leaves indentation as whitespace runs: "\n        x" pre-tokenizes to
# "\n", "       ", " x" (the last space sticks to the following word, so the
# common " name" tokens are shared between indented and inline code).
CODE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def compile_pattern(pattern: str) -> regex.Pattern:
    """Compile a tiktoken pre-tokenizer pattern with the ``regex`` module.

    Character-class intersection (``[A&&[^B]]``, used by Kimi) only exists in
    the module's VERSION1 mode; in the default mode ``&&`` would silently be two
    literal ampersands, so switch modes when the pattern uses it.
    """
    return regex.compile(pattern, regex.V1 if "&&" in pattern else regex.V0)


def count_words(texts: Iterable[str], pattern: str) -> Counter:
    """Frequency of every pre-tokenized piece over ``texts``."""
    rx = compile_pattern(pattern)
    counts: Counter = Counter()
    for text in texts:
        counts.update(rx.findall(text))  # Counter.update on a list runs in C
    return counts


def _merge_word(word: tuple, a: int, b: int, new: int) -> tuple:
    out = []
    i, n = 0, len(word)
    while i < n:
        if i + 1 < n and word[i] == a and word[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def train_bpe(texts: Iterable[str], vocab_size: int, pattern: str = CODE_PATTERN,
              *, word_counts: Counter | None = None, verbose: bool = False) -> dict[bytes, int]:
    """Train byte-level BPE ranks with at most ``vocab_size`` entries.

    Returns ``{token_bytes: rank}`` with ranks ``0..len-1`` contiguous; ranks
    0..255 are the single bytes in byte order.  Fewer than ``vocab_size`` ranks
    come back only when the corpus runs out of pairs to merge.  Pass
    ``word_counts`` (from :func:`count_words`) to skip pre-tokenization.
    """
    if vocab_size < 256:
        raise ValueError(f"vocab_size must be >= 256 (the byte alphabet), got {vocab_size}")
    if word_counts is None:
        word_counts = count_words(texts, pattern)

    vocab: list[bytes] = [bytes([i]) for i in range(256)]  # id == rank
    ranks: dict[bytes, int] = {tok: i for i, tok in enumerate(vocab)}
    # Sort words so that ids, pair-index iteration and hence ties are
    # independent of the order the texts came in.
    items = sorted(word_counts.items())
    words: list[tuple] = [tuple(w.encode("utf-8")) for w, _ in items]
    freqs: list[int] = [f for _, f in items]

    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    where: dict[tuple[int, int], set[int]] = defaultdict(set)  # may hold stale ids
    for i, w in enumerate(words):
        f = freqs[i]
        for p in zip(w, w[1:]):
            pair_counts[p] += f
            where[p].add(i)

    # Max-heap keyed on (count, smallest ids first).  Entries go stale when a
    # count changes; a fresh entry is pushed for every changed pair and stale
    # ones are discarded when popped.
    heap = [(-c, p) for p, c in pair_counts.items()]
    heapq.heapify(heap)

    while len(vocab) < vocab_size and heap:
        neg, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg or neg == 0:
            continue  # stale entry
        a, b = pair
        merged = vocab[a] + vocab[b]
        # Different merge paths can build the same bytes (("a","bc") after
        # ("ab","c")); reuse the existing token rather than duplicating it.
        new = ranks.get(merged)
        if new is None:
            new = len(vocab)
            vocab.append(merged)
            ranks[merged] = new
            if verbose and new % 256 == 0:
                print(f"  bpe: {new} tokens, last merge count {-neg}", flush=True)

        changed = set()
        for i in sorted(where.pop(pair)):
            w = words[i]
            nw = _merge_word(w, a, b, new)
            if len(nw) == len(w):
                continue  # stale index entry: the pair was already merged away
            f = freqs[i]
            for p in zip(w, w[1:]):
                pair_counts[p] -= f
                changed.add(p)
            for p in zip(nw, nw[1:]):
                pair_counts[p] += f
                changed.add(p)
                where[p].add(i)
            words[i] = nw
        for p in changed:
            c = pair_counts[p]
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                del pair_counts[p]
                where.pop(p, None)
    return ranks
