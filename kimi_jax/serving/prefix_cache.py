"""Prefix caching: the pages of a prompt computed once, and copied into every later prompt that starts with them.

A prompt is cut into pages of ``page_size`` tokens. Page i is named by a digest chain,
``key_i = blake2b(key_{i-1} + tokens of page i)``, so one key names a page together with everything before it
(vLLM's hash chain): two prompts share page i's key only if they agree on all of their first i + 1 pages. The
store holds, per page, what a prefill computes for those positions: the target's latent KV rows of every layer
and, with a drafter, its context K/V rows (the drafter's features need the target's hidden states, which the KV
cache does not keep, so they are stored rather than recomputed). A request whose prompt starts with cached
pages prefills only the rest (``engine.Prefix``), and the prompt's new whole pages join the store.

Choices, and why:
* **Copy in, not share in place.** The server's batch rows keep the contiguous cache (``join`` writes a prefilled
  row into its slot), so a hit's pages are copied into the new row by its prefill: one read of the hit's rows per
  admission, against the prefill compute it saves. Hence a running request holds no page of the store, pages need
  no reference counts, and eviction can never pull a page from under a request.
* **Whole pages of the prompt, never its last token**: the prefill must compute the last prompt token to get the
  first new one, so a hit is a multiple of ``page_size`` and at most ``len(prompt) - 1`` tokens.
* **Least recently used, leaves first.** A lookup or insert touches its chain from the last page back to the
  first, so a page is always at least as recent as every page that continues it: eviction takes leaves before
  the pages they hang from, and never strands a reachable page behind an evicted one.
* **Prompts only.** Generated tokens are not stored: a multi-turn chat re-sends the previous reply inside its next
  prompt, and that prompt's prefill stores it then.
* One prefill program per prompt-length bucket serves hits and misses alike: the prefix is a fixed
  ``max_pages`` pages (unused ones read as zeros), so a hit costs no compile.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.decoding import engine


@dataclasses.dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0                 # lookups that found at least one page
    prompt_tokens: int = 0        # tokens of the prompts looked up
    hit_tokens: int = 0           # of those, tokens served from the store
    evictions: int = 0            # pages evicted to make room

    @property
    def hit_rate(self) -> float:
        """The fraction of looked-up prompt tokens the store served."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@functools.partial(jax.jit, donate_argnames=("store",))
def _keep(store: engine.Prefix, kv, rows, start, src, dst) -> engine.Prefix:
    """The store with page ``dst[i]`` set from the prefilled row's slots [src[i], src[i] + page) (kv: its cache
    [layers, 1, slots, latent]; rows: its drafter context rows (k, v) [draft_layers, 1, t, ...] from prompt
    position ``start``, or None) where dst[i] < store pages; other entries are dropped."""
    page = store.kv.shape[2]
    slots = src[:, None] + jnp.arange(page)[None, :]                       # [n, page] prompt positions

    def put(pages, seq, offset):
        got = jnp.take(seq[:, 0], jnp.clip(slots - offset, 0, seq.shape[2] - 1), axis=1)   # [layers, n, page, ...]
        return pages.at[:, dst].set(got.astype(pages.dtype), mode="drop")

    store = store.replace(kv=put(store.kv, kv, 0))
    if rows is not None:
        store = store.replace(k=put(store.k, rows[0], start), v=put(store.v, rows[1], start))
    return store


class PageIndex:
    """The host side: page keys -> store pages, in least-recently-used order, and the free pages."""

    def __init__(self, capacity: int, page_size: int):
        self.capacity, self.page_size = capacity, page_size
        self._pages: collections.OrderedDict[bytes, int] = collections.OrderedDict()   # oldest first
        self._free = list(range(capacity))[::-1]
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key) -> bool:
        return key in self._pages

    def keys(self, ids, pages: int) -> list[bytes]:
        """The chain keys of the first ``pages`` whole pages of ``ids``."""
        keys, key = [], b""
        for i in range(pages):
            chunk = np.asarray(ids[i * self.page_size:(i + 1) * self.page_size], np.int32)
            key = hashlib.blake2b(key + chunk.tobytes(), digest_size=16).digest()
            keys.append(key)
        return keys

    def _touch(self, keys):
        for key in reversed(keys):          # the chain's first page ends most recent (the module docstring)
            if key in self._pages:
                self._pages.move_to_end(key)

    def match(self, keys) -> list[int]:
        """The store pages of the longest cached run of ``keys`` from the first; touches them."""
        hit = []
        for key in keys:
            if key not in self._pages:
                break
            hit.append(key)
        self._touch(hit)
        return [self._pages[k] for k in hit]

    def add(self, keys, start: int) -> list[tuple[int, int]]:
        """Give ``keys[start:]`` that are not cached a page each, evicting the least recently used pages (never
        one of ``keys``: a chain longer than the store keeps its first pages); touches the chain.
        -> (index into keys, page) of each new page."""
        new = []
        for i, key in enumerate(keys[start:], start):
            if key in self._pages:          # stored meanwhile by an identical chain
                continue
            if not self._free:
                victim = next(iter(self._pages))
                if victim in keys:
                    break
                self._free.append(self._pages.pop(victim))
                self.evictions += 1
            self._pages[key] = self._free.pop()
            new.append((i, self._pages[key]))
        self._touch(keys)
        return new


class PrefixCache:
    """The store's device pages and its host index. Used by the batcher's thread only."""

    def __init__(self, model, pages: int, page_size: int, max_prompt: int, drafter: bool):
        if pages < 1 or page_size < 1:
            raise ValueError(f"a prefix cache needs pages >= 1 and page_size >= 1, not {pages} and {page_size}")
        self.page_size, self.capacity = page_size, pages
        self.max_pages = max(1, (max_prompt - 1) // page_size)      # a hit leaves the prompt's last token
        cfg, dtype = model.config, model.compute_params["embed"].dtype
        self._shapes = dict(kv=((cfg.num_hidden_layers, pages, page_size, cfg.latent_dim), dtype))
        if drafter:
            dc, ddtype = model.drafter.config, model.drafter_params["fc"].dtype
            shape = (dc.num_hidden_layers, pages, page_size, dc.num_key_value_heads, dc.head_dim)
            self._shapes.update(k=(shape, ddtype), v=(shape, ddtype))
        self.stats = PrefixStats()
        self.clear()

    def clear(self):
        """Forget every page (and reallocate the store: after a failed store its buffers may be gone)."""
        zeros = {name: jnp.zeros(shape, dtype) for name, (shape, dtype) in self._shapes.items()}
        self._store = engine.Prefix(kv=zeros["kv"], k=zeros.get("k"), v=zeros.get("v"),
                                    pages=jnp.zeros((1, self.max_pages), jnp.int32), length=jnp.zeros((1,), jnp.int32))
        self.index = PageIndex(self.capacity, self.page_size)

    @property
    def used(self) -> int:
        return len(self.index)

    def lookup(self, ids) -> engine.Prefix:
        """The cached prefix of ``ids`` as the prefill's ``Inputs.prefix`` (length 0 where nothing is cached)."""
        hit = self.index.match(self.index.keys(ids, min((len(ids) - 1) // self.page_size, self.max_pages)))
        n = len(hit) * self.page_size
        self.stats.lookups += 1
        self.stats.hits += bool(hit)
        self.stats.prompt_tokens += len(ids)
        self.stats.hit_tokens += n
        pages = np.full((1, self.max_pages), self.capacity, np.int32)
        pages[0, :len(hit)] = hit
        tokens = np.full((1, self.max_pages * self.page_size), -1, np.int32)     # the repetition penalty's prompt
        tokens[0, :n] = ids[:n]
        # numpy: the length is read back on the host (the batcher, keep) without a device round trip
        return self._store.replace(pages=pages, length=np.asarray([n], np.int32), tokens=tokens)

    def keep(self, ids, prefix: engine.Prefix, row: engine.State, rows) -> None:
        """Store the whole pages of prompt ``ids`` that its prefill (``row``, which started from ``prefix``;
        ``rows``: its drafter context rows or None) computed, evicting the least recently used pages."""
        start = int(prefix.length[0])
        keys = self.index.keys(ids, min(len(ids) // self.page_size, self.max_pages))
        evicted = self.index.evictions
        new = self.index.add(keys, start // self.page_size)
        self.stats.evictions += self.index.evictions - evicted
        if not new:
            return
        src = np.zeros(self.max_pages, np.int32)                  # one shape for every call: unused entries
        dst = np.full(self.max_pages, self.capacity, np.int32)    # point past the store and are dropped
        for j, (i, page) in enumerate(new):
            src[j], dst[j] = i * self.page_size, page
        try:
            self._store = _keep(self._store, row.cache.kv, rows, start, src, dst)
        except Exception:
            self.clear()                    # the store's buffers were donated: start it again, empty
            raise
