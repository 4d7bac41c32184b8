"""Tokenizers for kimi_jax: the Kimi K2 tiktoken tokenizer and a small byte-level BPE.

Both are tiktoken encodings (byte-level BPE over a regex pre-tokenizer) and
share one interface, :class:`Tokenizer`:

* ``encode(text, allowed_special="all") -> list[int]``: special-token strings
  in the text become special ids by default, as in Kimi's own ``encode``;
  ``allowed_special=()`` (or a subset of names) turns the others into text.
  No BOS is prepended (Kimi does not either).
* ``decode(ids) -> str`` / ``decode_bytes(ids) -> bytes``; invalid UTF-8 is
  replaced by U+FFFD in ``decode``.
* ``eos_ids``, ``bos_id``, ``vocab_size`` (ids the tokenizer can produce),
  ``special_tokens`` (name -> id).
* ``apply_chat_template(messages, add_generation_prompt=True)`` -> str, and
  ``encode_chat`` (the same, encoded).  Tokenizers without a chat format raise
  :class:`NoChatTemplateError`.

:class:`StreamDecoder` turns a stream of generated ids into text, emitting only
complete UTF-8 characters.  :func:`load_tokenizer` opens a Kimi checkpoint
directory (``tiktoken.model`` + ``tokenizer_config.json``) or a directory saved
by :meth:`BPETokenizer.save` (``tokenizer.tiktoken`` + ``tokenizer.json``).

Kimi specifics reproduced from ``tokenization_kimi.py`` (sources: tag
[kimi-tokenizer] in docs/sources.md): ranks file of "base64 rank"
lines; 256 + 2 special ids starting at ``len(ranks)`` named from the config's
``added_tokens_decoder`` (else the built-in K2/K2.5 table), unnamed ones
``<|reserved_token_{id}|>``; the 8-way pre-tokenizer regex with ``&&`` class
intersection; input split into <= 400,000-char pieces and <= 25,000-char runs
of whitespace / non-whitespace before BPE.  The chat format is rendered in
Python (no Jinja), see :meth:`KimiTokenizer.apply_chat_template`.
"""

from __future__ import annotations

import base64
import codecs
import json
import os
import re
from typing import Any, Collection, Iterable, Iterator, Literal, Sequence

import tiktoken

from kimi_jax.text.bpe import CODE_PATTERN, compile_pattern, train_bpe

__all__ = [
    "Tokenizer", "KimiTokenizer", "BPETokenizer", "StreamDecoder", "NoChatTemplateError",
    "load_tokenizer", "read_ranks", "write_ranks", "split_for_tiktoken", "pretokenize",
    "train_bpe", "KIMI_PATTERN", "CODE_PATTERN", "K2_DEFAULT_SYSTEM_PROMPT",
]

# Kimi's pre-tokenizer: Han runs; (non-Han) words with an optional leading
# non-letter char and an optional English contraction, split into
# "Capitalized/lower" and "UPPER/Title" shapes; digit groups of <= 3;
# punctuation runs with trailing newlines; then the usual whitespace rules.
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

KIMI_NUM_RESERVED_SPECIAL = 256
# Kimi builds 256 + 2 special ids; the model's embedding covers only the
# first 256 of them (163,840 rows), the last two are never produced.
KIMI_NUM_SPECIAL_IDS = KIMI_NUM_RESERVED_SPECIAL + 2

# Built-in special-token names as offsets from len(ranks) (K2 tokenizer_config
# plus the K2.5 media/think tokens; 163584 + offset in the real tokenizer).
KIMI_SPECIAL_OFFSETS: dict[int, str] = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>",
    17: "<|im_middle|>", 18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>",
    21: "<|media_pad|>", 22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}

# What K2-Instruct's template injects when the conversation has no system turn.
K2_DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

TIKTOKEN_MAX_ENCODE_CHARS = 400_000   # tiktoken panics on longer inputs
MAX_RUN_CHARS = 25_000                # long runs make tiktoken's regex/BPE slow (tiktoken#195)
_RUNS = re.compile(r"\s+|\S+")        # same classes as str.isspace(), which Kimi uses


class NoChatTemplateError(NotImplementedError):
    """Raised by ``apply_chat_template`` on tokenizers without a chat format."""


# ----------------------------------------------------------------------------- ranks files

def read_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Parse a tiktoken ranks file (``base64(token) rank`` per line)."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                tok, rank = line.split()
                ranks[base64.b64decode(tok, validate=True)] = int(rank)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: not a 'base64 rank' line: {line[:80]!r}") from e
    return ranks


def write_ranks(ranks: dict[bytes, int], path: str | os.PathLike) -> None:
    with open(path, "wb") as fh:
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            fh.write(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n")


def _check_ranks(ranks: dict[bytes, int], special_tokens: dict[str, int]) -> None:
    # Special ids are numbered from len(ranks); that is only sound when the
    # ranks are exactly 0..n-1 and no special id lands on a rank.
    n = len(ranks)
    if sorted(ranks.values()) != list(range(n)):
        raise ValueError(f"ranks must be exactly 0..{n - 1} (got {n} entries with gaps or repeats)")
    bad = {k: v for k, v in special_tokens.items() if v < n}
    if bad:
        raise ValueError(f"special ids overlap the {n} mergeable ranks: {bad}")


# ----------------------------------------------------------------------------- pre-tokenizing

def split_for_tiktoken(text: str, max_chars: int = TIKTOKEN_MAX_ENCODE_CHARS,
                       max_run: int = MAX_RUN_CHARS) -> Iterator[str]:
    """Cut ``text`` the way Kimi does before handing it to tiktoken.

    First into ``max_chars`` pieces, then each piece wherever a run of
    whitespace or of non-whitespace grows past ``max_run`` chars (cuts at
    ``run_start + k * max_run``).  Cuts can fall inside what would otherwise
    be one pre-token (or even a special-token string); that is Kimi's
    behaviour and only matters for pathological inputs.
    """
    for start in range(0, len(text), max_chars):
        chunk = text[start:start + max_chars]
        if len(chunk) <= max_run:  # no run can be too long: skip the scan
            yield chunk
            continue
        cut = 0
        for m in _RUNS.finditer(chunk):
            if m.end() - m.start() > max_run:
                for pos in range(m.start() + max_run, m.end(), max_run):
                    yield chunk[cut:pos]
                    cut = pos
        yield chunk[cut:]


def pretokenize(text: str, pattern: str = KIMI_PATTERN) -> list[str]:
    """The pieces ``pattern`` splits ``text`` into (Python ``regex``; tiktoken
    uses Rust fancy-regex with the same semantics for these patterns)."""
    return compile_pattern(pattern).findall(text)


# ----------------------------------------------------------------------------- interface

class Tokenizer:
    """Common interface over a ``tiktoken.Encoding`` (see module docstring)."""

    def __init__(self, name: str, ranks: dict[bytes, int], pattern: str,
                 special_tokens: dict[str, int], eos_names: Sequence[str],
                 bos_name: str | None = None):
        _check_ranks(ranks, special_tokens)
        self.name = name
        self.pattern = pattern
        self.ranks = ranks
        self.special_tokens: dict[str, int] = dict(special_tokens)
        self.encoding = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks,
                                          special_tokens=self.special_tokens)
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(special_tokens[n] for n in eos_names))
        self.bos_id: int | None = special_tokens[bos_name] if bos_name else None
        self._id_to_special = {i: s for s, i in self.special_tokens.items()}

    @property
    def vocab_size(self) -> int:
        """Number of ids (ranks + specials); max id + 1."""
        return self.encoding.n_vocab

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def encode(self, text: str, allowed_special: Literal["all"] | Collection[str] = "all") -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes str, got {type(text).__name__}")
        if allowed_special == "all":
            allowed: Literal["all"] | set[str] = "all"
        elif isinstance(allowed_special, str):
            allowed = {allowed_special}  # one name, not its characters
        else:
            allowed = set(allowed_special)
        ids: list[int] = []
        for piece in split_for_tiktoken(text):
            # disallowed_special=() : special strings not allowed are plain text
            # rather than an error (tiktoken's default is to raise).
            ids.extend(self.encoding.encode(piece, allowed_special=allowed, disallowed_special=()))
        return ids

    def decode_bytes(self, ids: Iterable[int] | int) -> bytes:
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        try:
            return self.encoding.decode_bytes(ids)
        except KeyError as e:
            raise ValueError(f"token id {e.args[0]} is outside this tokenizer "
                             f"(vocab_size={self.vocab_size})") from None

    def decode(self, ids: Iterable[int] | int) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of one id; special ids give their name."""
        return self.decode_bytes([token_id])

    def is_special(self, token_id: int) -> bool:
        return token_id in self._id_to_special

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        raise NoChatTemplateError(f"{type(self).__name__} {self.name!r} has no chat template; "
                                  "encode plain text instead")

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, ranks={self.num_ranks}, "
                f"vocab_size={self.vocab_size}, eos_ids={self.eos_ids})")


class StreamDecoder:
    """Incremental detokenizer for streaming generation.

    ``push(ids)`` returns the text completed by these ids; bytes of a UTF-8
    character split across tokens are held back until the character is
    complete, and invalid sequences become U+FFFD exactly as ``decode`` would,
    so ``"".join(pushes) + flush()`` equals ``tokenizer.decode(all_ids)``.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Iterable[int] | int) -> str:
        return self._utf8.decode(self.tokenizer.decode_bytes(ids))

    def flush(self) -> str:
        """Emit what is held back (an unfinished character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


# ----------------------------------------------------------------------------- Kimi

def _token_name(v: Any) -> str | None:
    # tokenizer_config.json stores tokens either as strings or as serialized
    # AddedToken dicts ({"content": ..., "special": true, ...}).
    if v is None or isinstance(v, str):
        return v
    return v["content"]


class KimiTokenizer(Tokenizer):
    """Kimi K2 / K2.5 / K2.6 tokenizer (``tiktoken.model`` + ``tokenizer_config.json``)."""

    def __init__(self, ranks: dict[bytes, int], special_tokens: dict[str, int] | None = None, *,
                 bos_token: str = "[BOS]", eos_token: str = "[EOS]",
                 default_system_prompt: str | None = None, name: str = "kimi"):
        if special_tokens is None:
            special_tokens = self.default_special_tokens(len(ranks))
        # Kimi stops on [EOS] and on <|im_end|> (end of an assistant turn).
        eos_names = [eos_token] + (["<|im_end|>"] if "<|im_end|>" in special_tokens else [])
        super().__init__(name, ranks, KIMI_PATTERN, special_tokens, eos_names, bos_token)
        self.default_system_prompt = default_system_prompt

    @staticmethod
    def default_special_tokens(num_ranks: int, names: dict[int, str] | None = None) -> dict[str, int]:
        """The 258 special ids from ``num_ranks`` on; ``names`` maps absolute
        ids to names (default: the built-in K2 table), others are reserved."""
        if names is None:
            names = {num_ranks + off: s for off, s in KIMI_SPECIAL_OFFSETS.items()}
        return {names.get(i, f"<|reserved_token_{i}|>"): i
                for i in range(num_ranks, num_ranks + KIMI_NUM_SPECIAL_IDS)}

    @classmethod
    def from_file(cls, path: str | os.PathLike,
                  tokenizer_config_json: str | os.PathLike | dict | None = None, *,
                  default_system_prompt: str | None = None) -> "KimiTokenizer":
        """Load ``tiktoken.model``; names, BOS and EOS come from the config
        (path or parsed dict) when given.

        ``default_system_prompt``: K2-Instruct's template adds
        :data:`K2_DEFAULT_SYSTEM_PROMPT` when there is no system turn; later
        models' templates do not, so it is off unless asked for.
        """
        ranks = read_ranks(path)
        cfg: dict = {}
        if tokenizer_config_json is not None:
            if isinstance(tokenizer_config_json, dict):
                cfg = tokenizer_config_json
            else:
                with open(tokenizer_config_json, encoding="utf-8") as fh:
                    cfg = json.load(fh)
        names = None
        if "added_tokens_decoder" in cfg:
            names = {int(i): _token_name(t) for i, t in cfg["added_tokens_decoder"].items()}
        specials = cls.default_special_tokens(len(ranks), names)
        return cls(ranks, specials,
                   bos_token=_token_name(cfg.get("bos_token")) or "[BOS]",
                   eos_token=_token_name(cfg.get("eos_token")) or "[EOS]",
                   default_system_prompt=default_system_prompt,
                   name=os.path.basename(os.fspath(path)))

    # ---- chat format
    _ROLE_TAGS = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>"}

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            *, tools: list[dict] | None = None, thinking: bool | None = None) -> str:
        """Render ``messages`` in Kimi's chat format.

        Each turn is ``<|im_{tag}|>{role}<|im_middle|>{content}<|im_end|>``
        (system/user/assistant tags; other roles such as ``tool`` use the
        system tag).  ``tools`` become a leading ``tool_declare`` system turn
        (compact JSON, keys deep-sorted as Kimi does); a ``tool`` message with
        ``tool_call_id`` is prefixed ``## Return of {id}\\n``; assistant
        ``tool_calls`` are written as a tool-calls section after the content.
        Earlier turns' reasoning (``reasoning_content``) is not rendered.
        ``thinking`` pre-fills the generation prompt for K2.5-style thinking
        models: True -> ``<think>``, False -> ``<think></think>``, None ->
        nothing (K2-Instruct).
        """
        parts: list[str] = []
        if tools:
            decl = json.dumps(tools, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
            parts.append(f"<|im_system|>tool_declare<|im_middle|>{decl}<|im_end|>")
        if self.default_system_prompt and (not messages or messages[0]["role"] != "system"):
            parts.append(f"<|im_system|>system<|im_middle|>{self.default_system_prompt}<|im_end|>")
        for m in messages:
            role = m["role"]
            text = content_text(m.get("content"))
            if role == "tool" and m.get("tool_call_id") is not None:
                text = f"## Return of {m['tool_call_id']}\n{text}"
            if role == "assistant" and m.get("tool_calls"):
                calls = []
                for tc in m["tool_calls"]:
                    args = tc["function"]["arguments"]
                    if not isinstance(args, str):
                        args = json.dumps(args, ensure_ascii=False)
                    calls.append(f"<|tool_call_begin|>{tc['id']}<|tool_call_argument_begin|>"
                                 f"{args}<|tool_call_end|>")
                text += "<|tool_calls_section_begin|>" + "".join(calls) + "<|tool_calls_section_end|>"
            tag = self._ROLE_TAGS.get(role, "<|im_system|>")
            parts.append(f"{tag}{role}<|im_middle|>{text}<|im_end|>")
        if add_generation_prompt:
            parts.append("<|im_assistant|>assistant<|im_middle|>")
            if thinking is not None:
                parts.append("<think>" if thinking else "<think></think>")
        return "".join(parts)


# ----------------------------------------------------------------------------- small BPE

def content_text(content: Any) -> str:
    """A chat message's content as text: a string, or an OpenAI-style list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for part in content:
        if part.get("type") != "text":
            raise NoChatTemplateError(f"unsupported content part type {part.get('type')!r} (text only)")
        out.append(part["text"])
    return "".join(out)


class BPETokenizer(Tokenizer):
    """Byte-level BPE for the small embedded model, in Kimi's tiktoken format.

    Specials follow the ranks: ``<|endoftext|>`` (EOS / document separator),
    ``<|mask|>`` (the drafter's mask token), ``<|pad|>``.  Saved as a
    directory with ``tokenizer.tiktoken`` (same line format as Kimi's
    ``tiktoken.model``) and ``tokenizer.json`` (pattern, specials, EOS names).
    """

    SPECIALS = ("<|endoftext|>", "<|mask|>", "<|pad|>")
    FORMAT = "kimi_jax.bpe"

    def __init__(self, ranks: dict[bytes, int], pattern: str = CODE_PATTERN,
                 special_tokens: dict[str, int] | Sequence[str] = SPECIALS,
                 eos_names: Sequence[str] = ("<|endoftext|>",), bos_name: str | None = None,
                 name: str = "bpe"):
        if not isinstance(special_tokens, dict):
            special_tokens = {s: len(ranks) + i for i, s in enumerate(special_tokens)}
        super().__init__(name, ranks, pattern, special_tokens, eos_names, bos_name)
        self.eos_names = tuple(eos_names)
        self.bos_name = bos_name

    @property
    def mask_id(self) -> int | None:
        return self.special_tokens.get("<|mask|>")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """A plain-text chat format (this vocabulary has no role tokens): a ``# role: content`` line per turn
        (a comment, which the code model continues naturally), then ``# assistant:`` to prompt the reply."""
        lines = [f"# {m['role']}: {content_text(m.get('content'))}\n" for m in messages]
        return "".join(lines) + ("# assistant:" if add_generation_prompt else "")

    @property
    def pad_id(self) -> int | None:
        return self.special_tokens.get("<|pad|>")

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, pattern: str = CODE_PATTERN,
              specials: Sequence[str] = SPECIALS, **kwargs: Any) -> "BPETokenizer":
        """Train so that the whole id space (ranks + specials) is ``vocab_size``."""
        ranks = train_bpe(texts, vocab_size - len(specials), pattern)
        return cls(ranks, pattern, tuple(specials), **kwargs)

    def save(self, directory: str | os.PathLike) -> None:
        os.makedirs(directory, exist_ok=True)
        write_ranks(self.ranks, os.path.join(directory, "tokenizer.tiktoken"))
        meta = {"format": self.FORMAT, "version": 1, "name": self.name, "pattern": self.pattern,
                "num_ranks": len(self.ranks), "special_tokens": self.special_tokens,
                "eos_tokens": list(self.eos_names), "bos_token": self.bos_name}
        with open(os.path.join(directory, "tokenizer.json"), "w", encoding="utf-8") as fh:
            json.dump(meta, fh, indent=1, ensure_ascii=False)
            fh.write("\n")

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "BPETokenizer":
        with open(os.path.join(directory, "tokenizer.json"), encoding="utf-8") as fh:
            meta = json.load(fh)
        if meta.get("format") != cls.FORMAT:
            raise ValueError(f"{directory}/tokenizer.json is not a {cls.FORMAT} tokenizer")
        ranks = read_ranks(os.path.join(directory, "tokenizer.tiktoken"))
        return cls(ranks, meta["pattern"], {k: int(v) for k, v in meta["special_tokens"].items()},
                   meta["eos_tokens"], meta.get("bos_token"), meta.get("name", "bpe"))


# ----------------------------------------------------------------------------- loading

def load_tokenizer(path: str | os.PathLike, **kwargs: Any) -> Tokenizer:
    """Open the tokenizer in ``path``.

    * a directory saved by :meth:`BPETokenizer.save` -> :class:`BPETokenizer`;
    * a directory with ``tiktoken.model`` (a Kimi checkpoint; its
      ``tokenizer_config.json`` is used when present) or a path to such a
      ranks file -> :class:`KimiTokenizer` (``kwargs`` go to ``from_file``).
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        meta_path = os.path.join(path, "tokenizer.json")
        if os.path.isfile(meta_path) and os.path.isfile(os.path.join(path, "tokenizer.tiktoken")):
            return BPETokenizer.load(path)
        model = os.path.join(path, "tiktoken.model")
        if os.path.isfile(model):
            cfg = os.path.join(path, "tokenizer_config.json")
            return KimiTokenizer.from_file(model, cfg if os.path.isfile(cfg) else None, **kwargs)
        raise FileNotFoundError(f"{path}: no tiktoken.model (Kimi) or tokenizer.tiktoken + "
                                "tokenizer.json (kimi_jax BPE) found")
    if os.path.isfile(path):
        cfg = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        return KimiTokenizer.from_file(path, cfg if os.path.isfile(cfg) else None, **kwargs)
    raise FileNotFoundError(path)
