"""The training corpus of the embedded default model: the Python standard library's own source.

Every machine that runs kimi_jax has it, so the model can be trained (and evaluated) offline anywhere.

Rule (documented in checkpoints/target/MODEL_CARD.md):

* root: ``sysconfig.get_paths()["stdlib"]`` of the interpreter that runs the script;
* files: every ``*.py`` below it, relative paths with ``/`` separators, sorted; excluded are
  ``site-packages/``, ``dist-packages/`` and every path with a component named ``test``, ``tests``,
  ``idle_test`` or ``__pycache__`` or starting with ``test_`` (the test suites are huge and repetitive),
  and files that are not valid UTF-8;
* held-out: a file is held out iff ``int(sha1(relpath).hexdigest(), 16) % 50 == 0`` (bucket 0 of 50). The
  rule depends only on the relative path, so it selects the same files on every 3.12.x patch release
  (file contents may differ slightly between patch releases).
* documents are joined with the tokenizer's ``<|endoftext|>`` id between them.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig

HELD_OUT_BUCKETS = 50
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_held_out(relpath: str) -> bool:
    return int(hashlib.sha1(relpath.encode("utf-8")).hexdigest(), 16) % HELD_OUT_BUCKETS == 0


def stdlib_files(root: str | None = None) -> list[str]:
    """Sorted relative paths of the corpus files (both splits)."""
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        parts = [] if rel_dir == "." else rel_dir.split(os.sep)
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith("test_")]
        if any(p in EXCLUDED_DIRS or p.startswith("test_") for p in parts):
            continue
        for f in filenames:
            if f.endswith(".py") and not f.startswith("test_"):
                out.append("/".join(parts + [f]))
    return sorted(out)


def read_split(split: str, root: str | None = None, max_bytes: int | None = None) -> list[tuple[str, str]]:
    """[(relpath, text)] of split "train" or "heldout", in sorted order (optionally capped in total size)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = root or stdlib_root()
    docs, total = [], 0
    for rel in stdlib_files(root):
        if is_held_out(rel) != (split == "heldout"):
            continue
        try:
            with open(os.path.join(root, *rel.split("/")), encoding="utf-8") as fh:
                text = fh.read()
        except (UnicodeDecodeError, OSError):
            continue
        if max_bytes is not None and total + len(text) > max_bytes:
            break
        docs.append((rel, text))
        total += len(text)
    return docs


def heldout_prompts(tok, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n windows of `length` tokens from the held-out files (the target never trained on them)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    docs = [tok.encode(text) for _, text in read_split("heldout")]
    docs = [d for d in docs if len(d) > length + 1]
    out = []
    for i in range(n):
        d = docs[i % len(docs)]
        s = int(rng.integers(0, len(d) - length))
        out.append(d[s:s + length])
    return out
