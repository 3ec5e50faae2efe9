"""The mntp collator masks all rows at once (data/batches/mntp.py, issue #52): its batches are
bit-identical to the per-row masking it replaced, kept here as the reference, on fixed seeds
over rates, batch sizes, ragged rows, special tokens inside rows, span lengths and rows of 1-2
tokens. Each row still draws from its own generator in the same order and sizes, so a run
resumed from a checkpoint of the per-row code masks as it would have."""

import numpy as np
import pytest
import torch

from lit_transformer.data.batches.collate import IGNORE_INDEX, example_generators, per_example
from lit_transformer.data.batches.mntp import MNTPCollator, row_draws, span_mask
from lit_transformer.data.tokens.tokenizer import SpecialTokens

V = 99  # odd vocabulary so a transposed axis fails loudly
SPECIAL = SpecialTokens(pad_id=0, unk_id=1, bos_id=2, eos_id=3, cls_id=4, sep_id=5, mask_id=6)
FIRST_WORD = 7  # ids below are special


def reference_span_mask(eligible, rate, max_span_length, gen):
    """The per-row span_mask the collator used before issue #52: n + 1 + n draws from `gen`."""
    n = eligible.numel()
    m = int(eligible.sum())
    k = min(int(rate * m + float(torch.rand((), generator=gen))), m)
    lengths = torch.randint(1, max_span_length + 1, (n,), generator=gen)
    scores = torch.rand(n, generator=gen)
    ends = lengths.cumsum(0)
    span = torch.searchsorted(ends, torch.arange(n), right=True)
    if n == 0:
        return eligible.clone(), span
    count = int(span[-1]) + 1
    elig = eligible.long()
    per_span = torch.zeros(count, dtype=torch.long).index_add_(0, span, elig)
    order = scores[:count].argsort(stable=True)
    taken_before = torch.empty_like(per_span)
    taken_before[order] = per_span[order].cumsum(0) - per_span[order]
    span_start = per_span.cumsum(0) - per_span
    within = elig.cumsum(0) - elig - span_start[span]
    return eligible & (taken_before[span] + within < k), span


def reference_mntp_batch(collator: MNTPCollator, examples, generators=None, done=None) -> dict:
    """MNTPCollator.__call__ as it was before issue #52: one row at a time."""
    gens = per_example(generators, len(examples))
    B, n = len(examples), max(len(ex) for ex in examples)
    ids = torch.full((B, n), collator.pad_id, dtype=torch.long)  # collate.pad as it was: a copy per row
    for row, ex in enumerate(examples):
        ids[row, : len(ex)] = torch.as_tensor(np.asarray(ex), dtype=torch.long)
    lengths = torch.tensor([len(ex) for ex in examples])
    real = torch.arange(n)[None, :] < lengths[:, None]
    eligible = real & ~torch.isin(ids, collator.never)
    eligible[:, 0] = False
    rate = collator.rate(done)
    chosen = torch.zeros(B, n, dtype=torch.bool)
    inputs = ids.clone()
    keep_below = collator.mask_replace_prob + collator.random_replace_prob
    for row, gen in enumerate(gens):
        L = int(lengths[row])
        picked, span = reference_span_mask(eligible[row, :L], rate, collator.max_span_length, gen)
        r = torch.rand(L, generator=gen)[span]
        random_tokens = collator.random_ids[torch.randint(len(collator.random_ids), (L,), generator=gen)]
        to_mask = picked & (r < collator.mask_replace_prob)
        to_random = picked & (r >= collator.mask_replace_prob) & (r < keep_below)
        inputs[row, :L] = torch.where(to_mask, collator.mask_id, torch.where(to_random, random_tokens, ids[row, :L]))
        chosen[row, :L] = picked
    labels = ids[:, 1:].masked_fill(~chosen[:, 1:], IGNORE_INDEX)
    return {"input_ids": inputs[:, :-1], "attention_mask": real[:, :-1].long(), "labels": labels}


def ragged_rows(rows: int, longest: int, seed: int) -> list[np.ndarray]:
    """Rows of 1..longest tokens (always some of 1 and 2), with special tokens inside them
    (separators, [PAD], [MASK], [CLS]) and now and then a row of special tokens only."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, longest + 1, size=rows)
    lengths[: min(rows, 2)] = [1, 2][: min(rows, 2)]
    rng.shuffle(lengths)
    out = []
    for n in lengths:
        row = rng.integers(FIRST_WORD, V, size=n)
        inside = rng.random(n) < 0.1
        row[inside] = rng.choice([SPECIAL.eos_id, SPECIAL.pad_id, SPECIAL.mask_id, SPECIAL.cls_id], size=inside.sum())
        if rng.random() < 0.05:
            row[:] = SPECIAL.sep_id
        out.append(row)
    return out


def assert_same_batches(collator, examples, seed, done=None):
    new = collator(examples, example_generators(seed, 0, range(len(examples))), done)
    old = reference_mntp_batch(collator, examples, example_generators(seed, 0, range(len(examples))), done)
    assert new.keys() == old.keys() == {"input_ids", "attention_mask", "labels"}
    for key in old:
        assert new[key].dtype == old[key].dtype and torch.equal(new[key], old[key]), key


@pytest.mark.parametrize("rate", [0.05, 0.15, 0.5, 0.95])
@pytest.mark.parametrize("max_span_length", [1, 3])
@pytest.mark.parametrize("batch", [1, 3, 16])
def test_batches_equal_the_per_row_reference_on_ragged_rows(rate, max_span_length, batch):
    collator = MNTPCollator(
        special=SPECIAL, vocab_size=V, mask_rate_start=rate, mask_rate_end=rate, max_span_length=max_span_length
    )
    for seed in range(8):
        assert_same_batches(collator, ragged_rows(batch, 40, seed), seed)


@pytest.mark.parametrize("mask, random", [(0.8, 0.1), (0.5, 0.5), (0.0, 0.0), (0.0, 1.0)])
def test_batches_equal_the_reference_for_every_replacement_split_and_progress(mask, random):
    collator = MNTPCollator(
        special=SPECIAL,
        vocab_size=V,
        mask_rate_start=0.3,
        mask_rate_end=0.15,
        mask_replace_prob=mask,
        random_replace_prob=random,
    )
    for seed, done in enumerate([None, 0.0, 0.37, 1.0, 2.5]):  # the share of the run done
        assert_same_batches(collator, ragged_rows(7, 20, seed), seed, done)


def test_batches_equal_the_reference_on_tiny_gptbert_blocks():
    """Many full blocks of 129 tokens, as packing gives them (no row is sliced), then batches of
    the shortest rows."""
    collator = MNTPCollator(special=SPECIAL, vocab_size=V, mask_rate_start=0.3, mask_rate_end=0.15)
    rng = np.random.default_rng(3)
    rows = rng.integers(FIRST_WORD, V, size=(512, 129))
    rows[rng.random(rows.shape) < 0.05] = SPECIAL.eos_id
    assert_same_batches(collator, list(rows), 11)
    assert_same_batches(collator, [rows[0][:1], rows[1][:2]], 12)  # a batch of only the shortest rows
    assert_same_batches(collator, [rows[2][:1]], 13)  # one token: nothing eligible
    assert_same_batches(collator, [rows[3][:0], rows[4][:5]], 14)  # an empty row draws its u alone


def test_spans_with_equal_scores_are_taken_in_span_order_as_before():
    """Row 6320 of seed 0 draws one float32 score for spans 9 and 65, and at rate 0.1 the
    chosen tokens run out between them: only a stable sort (the earlier span first) gives the
    reference's mask. Found by searching rows for such a tie; the asserts keep it one."""
    collator = MNTPCollator(special=SPECIAL, vocab_size=V, mask_rate_start=0.1, mask_rate_end=0.1)
    row = FIRST_WORD + np.arange(129) % (V - FIRST_WORD)  # every position but the first eligible
    u, span_lengths, scores, _, _ = row_draws(example_generators(0, 0, [6320]), [129], 129, 3, V - FIRST_WORD)
    assert scores[0, 9] == scores[0, 65]
    eligible = torch.ones(1, 129, dtype=torch.bool)
    eligible[0, 0] = False
    later_first = scores.clone()
    later_first[0, 9] = torch.nextafter(scores[0, 9], torch.tensor(2.0))  # the tie broken the other way
    assert not torch.equal(
        span_mask(eligible, 0.1, u, span_lengths, scores)[0], span_mask(eligible, 0.1, u, span_lengths, later_first)[0]
    )
    new = collator([row], example_generators(0, 0, [6320]))
    old = reference_mntp_batch(collator, [row], example_generators(0, 0, [6320]))
    assert all(torch.equal(new[k], old[k]) for k in old)


def test_a_single_batch_generator_draws_as_before():
    """`generators` as one batch generator (or None) seeds each row's generator (per_example)."""
    collator = MNTPCollator(special=SPECIAL, vocab_size=V, max_span_length=2)
    examples = ragged_rows(5, 30, 4)
    new = collator(examples, torch.Generator().manual_seed(9))
    old = reference_mntp_batch(collator, examples, torch.Generator().manual_seed(9))
    assert all(torch.equal(new[k], old[k]) for k in old)
    assert all(
        torch.equal(a, b)
        for a, b in zip(collator(examples).values(), reference_mntp_batch(collator, examples).values())
    )
