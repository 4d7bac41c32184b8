"""Tests for kimi_jax.text.tokenizer and kimi_jax.text.bpe.

The Kimi tokenizer is exercised on a small synthetic ranks file (BPE trained
here on a few KB of mixed text, written in Kimi's base64-rank format), so no
checkpoint is needed; its special ids therefore start at len(ranks), not
163,584.
"""

from __future__ import annotations

import json
import random

import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimi_jax.text.bpe import CODE_PATTERN, count_words, train_bpe
from kimi_jax.text.tokenizer import (
    K2_DEFAULT_SYSTEM_PROMPT,
    KIMI_PATTERN,
    BPETokenizer,
    KimiTokenizer,
    NoChatTemplateError,
    StreamDecoder,
    load_tokenizer,
    pretokenize,
    read_ranks,
    split_for_tiktoken,
    write_ranks,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Don't panic; we're fine, they'll see. " * 8,
    "def forward(self, x):\n    y = self.norm(x)\n    for i in range(10):\n        y = y + i * 2\n"
    "    return {'out': y, \"n\": 1234567}\n\n" * 10,
    "人工智能是计算机科学的一个分支。我们今天学习分词器。中文文本没有空格。" * 10,
    "Emoji 😀🎉🚀 and accents: café naïve Ωmega ÉCOLE — done.\n\t\n" * 8,
    "日本語のテキストも少し。한국어 텍스트도 조금.  \n   \n" * 6,
]

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def _kimi_reference_split(s: str, n: int):
    """Kimi's whitespace/non-whitespace run splitter as specified (one char at a time)."""
    run_len, run_space, start = 0, (s[0].isspace() if s else False), 0
    for i, ch in enumerate(s):
        if ch.isspace() != run_space:
            run_len, run_space = 1, ch.isspace()
        else:
            run_len += 1
            if run_len > n:
                yield s[start:i]
                start, run_len = i, 1
    yield s[start:]


@pytest.fixture(scope="module")
def kimi_ranks():
    return train_bpe(CORPUS, 500, KIMI_PATTERN)


@pytest.fixture(scope="module")
def kimi_dir(kimi_ranks, tmp_path_factory):
    d = tmp_path_factory.mktemp("kimi")
    write_ranks(kimi_ranks, d / "tiktoken.model")
    return d


@pytest.fixture(scope="module")
def kimi(kimi_dir):
    return KimiTokenizer.from_file(kimi_dir / "tiktoken.model")


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train(CORPUS, 512)


# ------------------------------------------------------------------ Kimi: specials

def test_ranks_file_round_trip(kimi_dir, kimi_ranks):
    assert len(kimi_ranks) == 500
    text = (kimi_dir / "tiktoken.model").read_text()
    assert text.splitlines()[0] == "AA== 0"  # base64(b"\0") rank 0
    assert read_ranks(kimi_dir / "tiktoken.model") == kimi_ranks


def test_special_ids_start_at_len_ranks(kimi, kimi_ranks):
    n = len(kimi_ranks)
    sp = kimi.special_tokens
    assert len(sp) == 258 and sorted(sp.values()) == list(range(n, n + 258))
    assert (sp["[BOS]"], sp["[EOS]"], sp["<|im_end|>"]) == (n, n + 1, n + 2)
    assert sp["<|im_middle|>"] == n + 17 and sp["[PAD]"] == n + 255
    assert sp[f"<|reserved_token_{n + 5}|>"] == n + 5          # unnamed -> reserved
    assert sp[f"<|reserved_token_{n + 257}|>"] == n + 257      # the 2 extra ids
    assert kimi.vocab_size == n + 258
    assert kimi.bos_id == n
    assert kimi.eos_ids == (n + 1, n + 2)


def test_names_from_tokenizer_config(kimi_dir, kimi_ranks):
    n = len(kimi_ranks)
    cfg = {
        "added_tokens_decoder": {
            str(n): {"content": "[BOS]", "special": True},
            str(n + 1): {"content": "[EOS]", "special": True},
            str(n + 2): {"content": "<|im_end|>", "special": True},
            str(n + 7): {"content": "<|custom|>", "special": True},
        },
        "bos_token": "[BOS]",
        "eos_token": {"content": "[EOS]", "special": True},  # AddedToken form
    }
    path = kimi_dir / "tokenizer_config.json"
    path.write_text(json.dumps(cfg))
    try:
        tok = KimiTokenizer.from_file(kimi_dir / "tiktoken.model", path)
        assert tok.special_tokens["<|custom|>"] == n + 7
        assert tok.special_tokens[f"<|reserved_token_{n + 17}|>"] == n + 17  # no built-in names
        assert tok.eos_ids == (n + 1, n + 2) and tok.bos_id == n
        assert tok.encode("x<|custom|>")[-1] == n + 7
        # load_tokenizer finds the config next to tiktoken.model
        assert load_tokenizer(kimi_dir).special_tokens == tok.special_tokens
    finally:
        path.unlink()


def test_special_strings_in_text(kimi):
    sp = kimi.special_tokens
    text = "hi<|im_end|>there[EOS]"
    ids = kimi.encode(text)
    assert sp["<|im_end|>"] in ids and ids[-1] == sp["[EOS]"]
    plain = kimi.encode(text, allowed_special=())
    assert not any(kimi.is_special(i) for i in plain)
    assert kimi.decode(plain) == text == kimi.decode(ids)
    some = kimi.encode(text, allowed_special={"[EOS]"})
    assert sp["<|im_end|>"] not in some and some[-1] == sp["[EOS]"]
    assert kimi.encode(text, allowed_special="[EOS]") == some  # a single name


def test_decode_unknown_id_is_clear(kimi):
    with pytest.raises(ValueError, match="outside"):
        kimi.decode([kimi.vocab_size + 10])


# ------------------------------------------------------------------ Kimi: round trips

_PIECES = ["中文", "人工智能", "😀", "🎉🚀", "é", " ", "  ", "\n", "\t", "\r\n", "   \n  ", "don't",
           "123456", "<|im_end|>", "[BOS]", "Hello", " World", "Ω", "한국어", "\u200b", "\x00"]
texts = st.one_of(
    st.text(max_size=200),
    st.lists(st.one_of(st.sampled_from(_PIECES), st.text(max_size=5)), max_size=40).map("".join),
)


@SETTINGS
@given(s=texts)
def test_kimi_round_trip(kimi, s):
    assert kimi.decode(kimi.encode(s)) == s
    assert kimi.decode(kimi.encode(s, allowed_special=())) == s


@SETTINGS
@given(data=st.binary(max_size=64), cuts=st.lists(st.integers(0, 64), max_size=6))
def test_arbitrary_bytes_decode_and_stream(kimi, data, cuts):
    # Models can emit any byte sequence (e.g. half a character): decode_bytes
    # is exact, decode/StreamDecoder replace invalid UTF-8 identically.
    ids = [kimi.ranks[bytes([b])] for b in data]
    assert kimi.decode_bytes(ids) == data
    assert kimi.decode(ids) == data.decode("utf-8", errors="replace")
    sd, out, prev = StreamDecoder(kimi), [], 0
    for c in sorted(set(cuts)) + [len(ids)]:
        out.append(sd.push(ids[prev:c]))
        prev = max(prev, c)
    assert "".join(out) + sd.flush() == kimi.decode(ids)


def test_long_inputs_round_trip(kimi):
    for s in [" " * 60_001 + "x", "a" * 60_001, "中" * 30_000 + "\n" * 26_000 + "b"]:
        assert kimi.decode(kimi.encode(s)) == s
    rng = random.Random(0)
    words = ["alpha", "中文", " ", "\n", "😀", "123", "<|im_end|>"]
    big = "".join(rng.choice(words) for _ in range(150_000))
    assert len(big) > 400_000
    assert kimi.decode(kimi.encode(big)) == big


def test_split_for_tiktoken_matches_kimi():
    rng = random.Random(1)
    for _ in range(30):
        s = "".join(rng.choice([" ", "\n", "a", "中"]) * rng.randint(1, 40) for _ in range(30))
        for n in (3, 7, 50):
            assert list(split_for_tiktoken(s, max_chars=10**9, max_run=n)) == \
                list(_kimi_reference_split(s, n))
    # the 400k cut comes first, then the run limit restarts per chunk
    s = "a" * 30 + " " * 30
    assert list(split_for_tiktoken(s, max_chars=40, max_run=25)) == \
        ["a" * 25, "a" * 5 + " " * 10, " " * 20]
    assert list(split_for_tiktoken("")) == []


# ------------------------------------------------------------------ pre-tokenizer

PRETOK_CASES = [
    ("Hello World", ["Hello", " World"]),
    ("don't stop", ["don't", " stop"]),                 # contraction stays on the word
    ("I'M HERE", ["I'M", " HERE"]),
    ("你好世界abc", ["你好世界", "abc"]),                 # Han run splits from Latin
    ("1234567", ["123", "456", "7"]),                    # digits in groups of <= 3
    ("x = (a+b);\n\n  y", ["x", " =", " (", "a", "+b", ");\n\n", " ", " y"]),
    ("CamelCase", ["Camel", "Case"]),
]


@pytest.mark.parametrize("text,expected", PRETOK_CASES)
def test_pretokenizer_examples(text, expected):
    assert pretokenize(text, KIMI_PATTERN) == expected


@pytest.mark.parametrize("text,expected", PRETOK_CASES)
def test_tiktoken_splits_like_regex(text, expected):
    # tiktoken (Rust fancy-regex, && intersection) must split the same way.
    # Vocab = bytes + every prefix of each expected piece and of the whole
    # text: each piece then BPE-merges into exactly one token, and a missed
    # split would let tokens grow across the piece boundary.
    ranks = {bytes([i]): i for i in range(256)}
    for piece in expected + [text]:
        b = piece.encode()
        for k in range(2, len(b) + 1):
            ranks.setdefault(b[:k], len(ranks))
    enc = tiktoken.Encoding("t", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens={})
    assert [enc.decode_single_token_bytes(t).decode() for t in enc.encode(text)] == expected


def test_code_pattern_examples():
    assert pretokenize("    def foo_bar(x1):\n", CODE_PATTERN) == \
        ["   ", " def", " foo", "_bar", "(x", "1", "):\n"]


# ------------------------------------------------------------------ chat template

def test_chat_template_exact(kimi):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 你好"}]
    s = kimi.apply_chat_template(msgs)
    assert s == ("<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
                 "<|im_user|>user<|im_middle|>Hi 你好<|im_end|>"
                 "<|im_assistant|>assistant<|im_middle|>")
    sp = kimi.special_tokens
    ids = kimi.encode_chat(msgs)
    assert ids[0] == sp["<|im_system|>"] and ids[-1] == sp["<|im_middle|>"]
    assert ids.count(sp["<|im_end|>"]) == 2 and kimi.decode(ids) == s
    assert kimi.apply_chat_template(msgs, add_generation_prompt=False).endswith("Hi 你好<|im_end|>")
    assert kimi.apply_chat_template(msgs, thinking=True).endswith("<|im_middle|><think>")
    assert kimi.apply_chat_template(msgs, thinking=False).endswith("<think></think>")


def test_chat_template_options(kimi_dir):
    tok = KimiTokenizer.from_file(kimi_dir / "tiktoken.model",
                                  default_system_prompt=K2_DEFAULT_SYSTEM_PROMPT)
    s = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert s == (f"<|im_system|>system<|im_middle|>{K2_DEFAULT_SYSTEM_PROMPT}<|im_end|>"
                 "<|im_user|>user<|im_middle|>Hi<|im_end|>")
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "functions.get:0", "function": {"name": "get", "arguments": '{"c":"SF"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get:0", "content": "sunny"},
    ]
    s = tok.apply_chat_template(msgs, tools=[{"type": "function", "function": {"name": "get"}}])
    assert s.startswith('<|im_system|>tool_declare<|im_middle|>'
                        '[{"function":{"name":"get"},"type":"function"}]<|im_end|>')
    assert ("<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>"
            'functions.get:0<|tool_call_argument_begin|>{"c":"SF"}<|tool_call_end|>'
            "<|tool_calls_section_end|><|im_end|>") in s
    assert "<|im_system|>tool<|im_middle|>## Return of functions.get:0\nsunny<|im_end|>" in s


def test_bpe_chat_format_is_plain_comment_lines(bpe):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert bpe.apply_chat_template(msgs) == "# system: be brief\n# user: hi\n# assistant:"
    assert bpe.decode(bpe.encode_chat(msgs, add_generation_prompt=False)) == "# system: be brief\n# user: hi\n"
    with pytest.raises(NoChatTemplateError, match="text only"):
        bpe.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])


# ------------------------------------------------------------------ BPE trainer

def test_merges_are_concatenations_of_earlier_tokens(kimi_ranks):
    by_rank = sorted(kimi_ranks, key=kimi_ranks.get)
    assert by_rank[:256] == [bytes([i]) for i in range(256)]
    assert len(set(by_rank)) == len(by_rank)
    for r, tok in enumerate(by_rank[256:], 256):
        assert any(kimi_ranks.get(tok[:i], r) < r and kimi_ranks.get(tok[i:], r) < r
                   for i in range(1, len(tok))), tok


def test_training_is_deterministic_and_sized():
    a = train_bpe(CORPUS, 500, CODE_PATTERN)
    b = train_bpe(list(reversed(CORPUS)), 500, CODE_PATTERN)
    assert a == b and len(a) == 500
    # same result from precomputed word counts
    assert train_bpe([], 500, CODE_PATTERN, word_counts=count_words(CORPUS, CODE_PATTERN)) == a
    # a tiny corpus runs out of pairs before the requested size
    assert sorted(train_bpe(["abab"], 1000, CODE_PATTERN), key=len)[256:] == [b"ab", b"abab"]
    with pytest.raises(ValueError):
        train_bpe(CORPUS, 100, CODE_PATTERN)


def test_bpe_tokenizer_basics(bpe):
    assert bpe.vocab_size == 512 and bpe.num_ranks == 509
    assert bpe.special_tokens == {"<|endoftext|>": 509, "<|mask|>": 510, "<|pad|>": 511}
    assert bpe.eos_ids == (509,) and bpe.mask_id == 510 and bpe.pad_id == 511 and bpe.bos_id is None
    code = "def forward(self, x):\n    return x\n"
    assert len(bpe.encode(code)) < len(code.encode()) / 2  # merges actually compress
    assert bpe.encode("a<|endoftext|>")[-1] == 509


@SETTINGS
@given(s=texts)
def test_bpe_round_trip(bpe, s):
    assert bpe.decode(bpe.encode(s)) == s


def test_bpe_save_load(bpe, tmp_path):
    bpe.save(tmp_path / "tok")
    for tok in (BPETokenizer.load(tmp_path / "tok"), load_tokenizer(tmp_path / "tok")):
        assert isinstance(tok, BPETokenizer)
        assert tok.ranks == bpe.ranks and tok.special_tokens == bpe.special_tokens
        assert tok.pattern == bpe.pattern and tok.eos_ids == bpe.eos_ids
        s = "".join(CORPUS)
        assert tok.encode(s) == bpe.encode(s)
    # the ranks file is Kimi's format: readable as a Kimi tokenizer too
    kimi = KimiTokenizer.from_file(tmp_path / "tok" / "tokenizer.tiktoken")
    assert kimi.decode(kimi.encode("人工智能 😀")) == "人工智能 😀"


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path)
    (tmp_path / "bad.model").write_text("not base64 at all\n")
    with pytest.raises(ValueError, match="base64 rank"):
        load_tokenizer(tmp_path / "bad.model")
    write_ranks({bytes([i]): i for i in range(255)} | {b"\xff": 300}, tmp_path / "gap.model")
    with pytest.raises(ValueError, match="ranks must be"):
        KimiTokenizer.from_file(tmp_path / "gap.model")


# ------------------------------------------------------------------ streaming

def test_stream_decoder_holds_partial_characters(bpe, kimi):
    for tok in (bpe, kimi):
        text = "é中😀 ok 人工智能🎉"
        ids = tok.encode(text)
        sd = StreamDecoder(tok)
        out = [sd.push(i) for i in ids]
        assert "".join(out) + sd.flush() == text
        assert all("\ufffd" not in o for o in out)
    # byte-level ids: nothing is emitted until the 4-byte emoji is complete
    raw = "😀".encode()
    sd = StreamDecoder(bpe)
    assert [sd.push([bpe.ranks[raw[i:i + 1]]]) for i in range(4)] == ["", "", "", "😀"]
    sd.push([bpe.ranks[raw[:1]]])
    assert sd.flush() == "\ufffd"  # an unfinished character at the end
