"""Collators: masking statistics, shifting, span corruption exactness, padding conventions."""

import numpy as np
import pytest
import torch

from lit_transformer.data.batches.collate import (
    IGNORE_INDEX,
    ClassifyCollator,
    CLMCollator,
    MLMCollator,
    Seq2SeqCollator,
    batch_generator,
    example_generators,
    pad,
    word_start_table,
)
from lit_transformer.data.batches.span import SpanCorruptionCollator, span_lengths
from lit_transformer.data.data_config import TokenizerConfig
from lit_transformer.data.sources import stdlib
from lit_transformer.data.tokens.tokenizer import SpecialTokens, train_tokenizer

V = 99  # odd vocabulary so a transposed axis fails loudly
SPECIAL = SpecialTokens(
    pad_id=0, unk_id=1, bos_id=2, eos_id=3, cls_id=4, sep_id=5, mask_id=6, sentinel_ids=tuple(range(98, 48, -1))
)  # T5 style: descending ids


def _blocks(n, length, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.integers(7, 48, size=length)  # ordinary tokens
        x[rng.random(length) < 0.05] = 3  # document separators
        x[0] = 4
        out.append(x)
    return out


def test_mlm_rates_and_80_10_10():
    collator = MLMCollator(special=SPECIAL, vocab_size=V)
    examples = _blocks(800, 160)  # ~120k eligible tokens
    batch = collator(examples, torch.Generator().manual_seed(1))
    original = torch.as_tensor(np.stack(examples))
    eligible = ~torch.isin(original, torch.tensor(sorted(SPECIAL.never_masked())))
    selected = batch["labels"] != IGNORE_INDEX
    rate = selected.sum().item() / eligible.sum().item()
    assert abs(rate - 0.15) < 0.01
    assert torch.equal(batch["labels"][selected], original[selected])
    n = selected.sum().item()
    masked = (batch["input_ids"] == SPECIAL.mask_id) & selected
    unchanged = (batch["input_ids"] == original) & selected
    replaced = selected & ~masked & ~unchanged
    assert abs(masked.sum().item() / n - 0.8) < 0.02
    # a random draw can hit the original token (1 in ~90): counted as unchanged
    assert abs(replaced.sum().item() / n - 0.1 * (1 - 1 / 90)) < 0.015
    assert abs(unchanged.sum().item() / n - 0.1 * (1 + 1 / 90)) < 0.015
    # special tokens are never selected, never replaced, and random tokens are never special
    assert not (selected & ~eligible).any()
    assert torch.equal(batch["input_ids"][~eligible], original[~eligible])
    assert not torch.isin(batch["input_ids"][replaced], torch.tensor(sorted(SPECIAL.never_masked()))).any()
    assert batch["attention_mask"].all()


def test_mlm_pads_and_never_predicts_padding():
    collator = MLMCollator(special=SPECIAL, vocab_size=V, probability=0.9)
    batch = collator([np.arange(7, 17), np.arange(7, 10)], torch.Generator().manual_seed(0))
    assert batch["input_ids"].shape == (2, 10)
    assert batch["attention_mask"][1].tolist() == [1, 1, 1] + [0] * 7
    assert (batch["labels"][1, 3:] == IGNORE_INDEX).all() and (batch["input_ids"][1, 3:] == 0).all()


def test_mlm_is_a_function_of_the_generator():
    collator = MLMCollator(special=SPECIAL, vocab_size=V)
    ex = _blocks(4, 33)
    a, b = collator(ex, batch_generator(1, 0, 0, 5)), collator(ex, batch_generator(1, 0, 0, 5))
    c = collator(ex, batch_generator(1, 0, 0, 6))
    assert all(torch.equal(a[k], b[k]) for k in a) and not torch.equal(a["labels"], c["labels"])


@pytest.mark.parametrize("whole_word", [False, True])
def test_mlm_row_depends_only_on_its_example_and_generator(whole_word):
    """What makes 2 ranks draw the masks one process draws: an example's row is the same in a
    batch of one, in another batch with other partners, and with more padding after it."""
    starts = torch.rand(V, generator=torch.Generator().manual_seed(2)) < 0.5 if whole_word else None
    collator = MLMCollator(special=SPECIAL, vocab_size=V, probability=0.4, word_starts=starts)
    ex = _blocks(5, 23, seed=1) + [np.arange(7, 40)]  # the last one is longer: the others get padded
    together = collator(ex, example_generators(3, 1, range(6)))
    for i in range(5):
        alone = collator([ex[i]], example_generators(3, 1, [i]))
        for key in ("input_ids", "labels"):
            assert torch.equal(together[key][i, :23], alone[key][0]), (i, key)
    shuffled = collator([ex[4], ex[2]], example_generators(3, 1, [4, 2]))
    assert torch.equal(shuffled["labels"][0], together["labels"][4, :23])
    # a new epoch (or another seed) draws new masks for the same example
    again = collator([ex[0]], example_generators(3, 2, [0]))
    assert not torch.equal(again["labels"][0], together["labels"][0, :23])
    assert (together["labels"] != IGNORE_INDEX).float().mean() > 0.2  # masks were drawn at all


def test_span_row_depends_only_on_its_example_and_generator():
    lengths = span_lengths(64)
    collator = SpanCorruptionCollator(block_size=64, sentinel_ids=SPECIAL.sentinel_ids, eos_id=3, decoder_start_id=0)
    rng = np.random.default_rng(0)
    blocks = [rng.integers(7, 48, size=lengths.raw_length) for _ in range(4)]
    together = collator(blocks, example_generators(0, 0, [10, 11, 12, 13]))
    alone = collator([blocks[2]], example_generators(0, 0, [12]))
    assert torch.equal(together["input_ids"][2], alone["input_ids"][0])
    assert torch.equal(together["labels"][2], alone["labels"][0])
    other = collator([blocks[2]], example_generators(0, 0, [11]))
    assert not torch.equal(other["input_ids"][0], alone["input_ids"][0])


def test_generators_must_match_the_examples():
    with pytest.raises(ValueError, match="2 generators for 3 examples"):
        MLMCollator(special=SPECIAL, vocab_size=V)(_blocks(3, 9), example_generators(0, 0, [0, 1]))


@pytest.fixture(scope="module")
def wordpiece():
    texts = [p.read_text("utf-8", "replace") for _, p in stdlib.corpus_split("train")[:40]]
    return train_tokenizer(texts, TokenizerConfig(kind="wordpiece", vocab_size=700, num_sentinels=0))


@pytest.fixture(scope="module")
def bpe():
    texts = [p.read_text("utf-8", "replace") for _, p in stdlib.corpus_split("train")[:40]]
    return train_tokenizer(texts, TokenizerConfig(kind="bpe", vocab_size=700, num_sentinels=0))


@pytest.mark.parametrize("fixture", ["wordpiece", "bpe"])
def test_whole_word_masking_masks_whole_words(request, fixture):
    tok = request.getfixturevalue(fixture)
    sp = SpecialTokens.from_tokenizer(tok)
    starts = word_start_table(tok)
    text = " ".join(["internationalization configuration asynchronous subprocess"] * 40)
    ids = np.asarray(tok.encode(text, add_special_tokens=False).ids)
    assert (~starts[torch.as_tensor(ids)]).sum() > 20  # the words really split into pieces
    collator = MLMCollator(special=sp, vocab_size=tok.get_vocab_size(), word_starts=starts)
    batch = collator([ids] * 16, torch.Generator().manual_seed(3))
    selected = (batch["labels"] != IGNORE_INDEX).numpy()
    word = np.cumsum(starts[torch.as_tensor(ids)].numpy())
    for row in selected:
        for w in np.unique(word):
            assert row[word == w].all() or not row[word == w].any()  # all pieces of a word, or none
    assert 0.05 < selected.mean() < 0.3


@pytest.mark.parametrize(
    "rows",
    [
        [np.arange(5), np.arange(5, 10)],  # packed blocks: one length, stacked in one copy
        [np.arange(5, dtype=np.uint16), np.arange(3, dtype=np.uint16)],  # ragged, as a token store's dtype
        [[1, 2, 3], (4, 5, 6), np.array([7, 8, 9], dtype=np.int32)],  # lists, tuples and arrays together
        [[], []],
    ],
)
def test_pad_equals_a_copy_per_row(rows):
    expected = torch.full((len(rows), max(len(r) for r in rows)), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        expected[i, : len(r)] = torch.as_tensor(np.asarray(r, dtype=np.int64))
    got = pad(rows, -1)
    assert got.dtype == torch.long and torch.equal(got, expected)
    assert torch.equal(pad(rows, 0, dtype=torch.float32), torch.where(expected < 0, 0, expected).float())


def test_clm_labels_are_shifted_inputs():
    collator = CLMCollator(special=SPECIAL)
    blocks = _blocks(3, 17)
    batch = collator(blocks, None)
    assert batch["input_ids"].shape == (3, 16) and batch["labels"].shape == (3, 16)
    x = torch.as_tensor(np.stack(blocks))
    assert torch.equal(batch["input_ids"], x[:, :-1]) and torch.equal(batch["labels"], x[:, 1:])
    ragged = collator([np.arange(10, 15), np.arange(10, 13)], None)
    assert ragged["labels"][1].tolist() == [11, 12, -100, -100]
    assert ragged["attention_mask"][1].tolist() == [1, 1, 1, 0]


def _reconstruct(inputs, labels, sentinels, eos):
    """Put each target span back where its sentinel stands in the input."""
    spans, current = {}, None
    for t in labels:
        if t == eos:
            break
        if t in sentinels:
            current = t
            spans[current] = []
        else:
            spans[current].append(t)
    out = []
    for t in inputs:
        if t == eos:
            break
        out.extend(spans[t] if t in sentinels else [t])
    return out


@pytest.mark.parametrize("block_size", [8, 31, 64, 128, 512])
def test_span_corruption_exact_lengths_and_reconstruction(block_size):
    lengths = span_lengths(block_size)
    collator = SpanCorruptionCollator(
        block_size=block_size, sentinel_ids=SPECIAL.sentinel_ids, eos_id=3, decoder_start_id=0
    )
    rng = np.random.default_rng(block_size)
    blocks = [rng.integers(7, 48, size=lengths.raw_length) for _ in range(5)]
    batch = collator(blocks, torch.Generator().manual_seed(block_size))
    assert batch["input_ids"].shape == (5, block_size)
    assert batch["labels"].shape == (5, lengths.target_length)
    assert (batch["labels"][:, -1] == 3).all() and (batch["input_ids"][:, -1] == 3).all()
    assert torch.equal(batch["decoder_input_ids"][:, 0], torch.zeros(5, dtype=torch.long))
    assert torch.equal(batch["decoder_input_ids"][:, 1:], batch["labels"][:, :-1])
    assert batch["attention_mask"].all() and batch["decoder_attention_mask"].all()
    sentinels = set(SPECIAL.sentinel_ids)
    for raw, inp, lab in zip(blocks, batch["input_ids"].tolist(), batch["labels"].tolist()):
        assert _reconstruct(inp, lab, sentinels, 3) == raw.tolist()
        used = [t for t in inp if t in sentinels]
        assert used == list(SPECIAL.sentinel_ids[: lengths.noise_spans])  # in order 0, 1, 2, ...
    noise = (torch.isin(batch["labels"], torch.tensor(sorted(sentinels))) | (batch["labels"] == 3)).logical_not()
    assert noise.sum().item() == 5 * lengths.noise_tokens


def test_span_lengths_match_t5():
    # T5's compute_input_and_target_lengths(512, 0.15, 3) = (568, 114): the published pairing
    out = span_lengths(512, 0.15, 3.0)
    assert (out.raw_length, out.target_length) == (568, 114)


def test_seq2seq_collator():
    collator = Seq2SeqCollator(special=SPECIAL)
    batch = collator([(np.array([10, 11, 3]), np.array([20, 21, 22, 3])), (np.array([12, 3]), np.array([23, 3]))])
    assert batch["input_ids"].tolist() == [[10, 11, 3], [12, 3, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[20, 21, 22, 3], [23, 3, -100, -100]]
    assert batch["decoder_input_ids"].tolist() == [[0, 20, 21, 22], [0, 23, 3, 0]]
    assert batch["decoder_attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]


@pytest.mark.parametrize("task", ["single_label", "multi_label", "regression"])
def test_classify_collator_label_types(task):
    labels = {
        "single_label": [np.int64(2), np.int64(0)],
        "multi_label": [np.array([1.0, 0.0, 1.0]), np.array([0.0, 1.0, 0.0])],
        "regression": [np.float32(0.5), np.float32(-1.25)],
    }[task]
    ex = [
        {"ids": np.array([4, 10, 5, 11, 5]), "type_ids": np.array([0, 0, 0, 1, 1]), "label": labels[0]},
        {"ids": np.array([4, 12, 5]), "type_ids": np.array([0, 0, 0]), "label": labels[1]},
    ]
    batch = ClassifyCollator(special=SPECIAL, task=task)(ex)
    assert batch["input_ids"].tolist() == [[4, 10, 5, 11, 5], [4, 12, 5, 0, 0]]
    assert batch["token_type_ids"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    if task == "single_label":
        assert batch["labels"].dtype == torch.long and batch["labels"].tolist() == [2, 0]
    elif task == "multi_label":
        assert batch["labels"].dtype == torch.float32 and batch["labels"].shape == (2, 3)
    else:
        assert batch["labels"].dtype == torch.float32 and batch["labels"].tolist() == [0.5, -1.25]
