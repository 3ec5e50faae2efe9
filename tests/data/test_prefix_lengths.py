"""Prefix LM's prefix lengths come for all rows at once (data/batches/prefix.py, issue #52):
the same lengths, from the same one draw of each row's generator, as the per-row function they
replaced, kept here as the reference, so a resumed run splits its rows as it would have."""

import numpy as np
import pytest
import torch

from lit_transformer.data.batches.collate import example_generators
from lit_transformer.data.batches.prefix import DecoderPrefixCollator, EncoderDecoderPrefixCollator, prefix_lengths
from lit_transformer.data.tokens.tokenizer import SpecialTokens

SPECIAL = SpecialTokens(pad_id=0, unk_id=1, bos_id=2, eos_id=3, cls_id=4, sep_id=5, mask_id=6)


def reference_prefix_length(n: int, prefix_fraction: float, gen: torch.Generator) -> int:
    """prefix.py's prefix_length before issue #52: one row, one draw."""
    width = min(prefix_fraction, 1.0 - prefix_fraction) / 2
    f = prefix_fraction - width + 2 * width * float(torch.rand((), generator=gen))
    return min(max(round(f * n), 1), max(n - 1, 1))


@pytest.mark.parametrize("prefix_fraction", [0.1, 0.25, 1 / 3, 0.5, 0.75, 0.9])
def test_prefix_lengths_equal_the_per_row_reference(prefix_fraction):
    rng = np.random.default_rng(0)
    for seed in range(40):
        lengths = [0, 1, 2, 3, 4, *rng.integers(1, 300, size=11).tolist()]  # rows too short to split, and ragged ones
        got = prefix_lengths(lengths, prefix_fraction, example_generators(seed, 0, range(16)))
        gens = example_generators(seed, 0, range(16))
        expected = [reference_prefix_length(n, prefix_fraction, g) for n, g in zip(lengths, gens)]
        assert got.dtype == torch.long and got.tolist() == expected


def test_the_prefix_collators_split_rows_as_before():
    rng = np.random.default_rng(1)
    blocks = [rng.integers(7, 99, size=n) for n in (65, 65, 9, 3, 2)]
    batch = DecoderPrefixCollator(SPECIAL, 0.4)(blocks, example_generators(2, 0, range(5)))
    gens = example_generators(2, 0, range(5))
    assert batch["prefix_lengths"].tolist() == [
        reference_prefix_length(len(b) - 1, 0.4, g) for b, g in zip(blocks, gens)
    ]
    pairs = EncoderDecoderPrefixCollator(SPECIAL, 0.4)(blocks, example_generators(3, 0, range(5)))
    gens = example_generators(3, 0, range(5))
    sources = [reference_prefix_length(len(b), 0.4, g) + 1 for b, g in zip(blocks, gens)]  # + eos
    assert pairs["attention_mask"].sum(1).tolist() == sources
