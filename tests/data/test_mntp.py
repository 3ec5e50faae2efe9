"""Masked next-token prediction's data (data/batches/mntp.py): span masking, the shifted
targets, the 80/10/10 split and the mask-rate schedule, which a resumed mixture repeats exactly."""

import numpy as np
import pytest
import torch

from lit_transformer.data.batches.collate import IGNORE_INDEX, example_generators
from lit_transformer.data.batches.mntp import MNTPCollator, mask_rate, span_mask
from lit_transformer.data.data_config import DataConfig, TokenizerConfig
from lit_transformer.data.modules.mixture_module import MixtureDataModule, MixtureTask
from lit_transformer.data.tokens.tokenizer import SpecialTokens
from lit_transformer.errors import DataError

V = 99  # odd vocabulary so a transposed axis fails loudly
SPECIAL = SpecialTokens(pad_id=0, unk_id=1, bos_id=2, eos_id=3, cls_id=4, sep_id=5, mask_id=6)
FIRST_WORD = 7  # ids below are special


def blocks(rows: int, n: int, seed: int = 0) -> list[np.ndarray]:
    """Next-token blocks of n tokens, with a separator (eos) now and then, as packing leaves them."""
    rng = np.random.default_rng(seed)
    out = rng.integers(FIRST_WORD, V, size=(rows, n))
    out[rng.random((rows, n)) < 0.05] = SPECIAL.eos_id
    return list(out)


def collate(rows, n=33, *, done=None, seed=0, **options):
    data = blocks(rows, n, seed)
    options = {"mask_rate_start": 0.3, "mask_rate_end": 0.15, **options}
    batch = MNTPCollator(special=SPECIAL, vocab_size=V, **options)(data, example_generators(seed, 0, range(rows)), done)
    return torch.as_tensor(np.stack(data)), batch


def test_span_mask_chooses_exactly_the_rate_in_spans_of_at_most_max_span_length():
    gen = torch.Generator().manual_seed(0)
    shares, lengths_seen = [], set()
    for row in range(300):
        n, span_max = 40 + row % 7, 1 + row % 4
        eligible = torch.rand(n, generator=gen) > 0.2
        eligible[0] = False
        u = torch.rand(1, generator=gen)
        span_lengths = torch.randint(1, span_max + 1, (1, n), generator=gen)
        chosen, span = span_mask(eligible[None], 0.3, u, span_lengths, torch.rand(1, n, generator=gen))
        chosen, span = chosen[0], span[0]  # one row
        m = int(eligible.sum())
        assert not (chosen & ~eligible).any()
        assert int(chosen.sum()) in (int(0.3 * m), int(0.3 * m) + 1)  # stochastic rounding of 0.3 m
        shares.append(int(chosen.sum()) / m)
        spans = torch.unique_consecutive(span, return_counts=True)[1]  # spans are runs of one index
        assert torch.equal(torch.unique_consecutive(span), torch.arange(len(spans)))
        assert 1 <= int(spans.min()) and int(spans.max()) <= span_max
        lengths_seen |= set(spans.tolist())
        # whole spans are chosen, in score order; at most one is cut short, and only at its end
        partial = 0
        for s in range(len(spans)):
            inside = span == s
            picked, allowed = chosen[inside], eligible[inside]
            if picked.any() and not torch.equal(picked, allowed):
                partial += 1
                taken = picked[allowed]
                assert torch.equal(taken, torch.sort(taken, descending=True).values)  # a prefix of its tokens
        assert partial <= 1
    assert lengths_seen == {1, 2, 3, 4}
    assert np.mean(shares) == pytest.approx(0.3, abs=0.01)


def test_targets_are_the_masked_tokens_read_at_the_position_before_them():
    original, batch = collate(64)
    B, n = original.shape
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (B, n - 1)
    labels = batch["labels"]
    chosen = torch.zeros_like(original, dtype=torch.bool)
    chosen[:, 1:] = labels != IGNORE_INDEX  # labels[t] is about the token at t + 1
    assert torch.equal(labels[labels != IGNORE_INDEX], original[:, 1:][chosen[:, 1:]])
    assert not chosen[:, 0].any() and not chosen[original == SPECIAL.eos_id].any()
    inputs = batch["input_ids"]
    untouched = ~chosen[:, : n - 1]
    assert torch.equal(inputs[untouched], original[:, : n - 1][untouched])  # only chosen tokens change
    assert (inputs[chosen[:, : n - 1]] == SPECIAL.mask_id).float().mean() > 0.5


@pytest.mark.parametrize("mask, random", [(0.8, 0.1), (0.5, 0.5)])
def test_the_replacement_split_is_configurable(mask, random):
    original, batch = collate(600, mask_replace_prob=mask, random_replace_prob=random)
    n = original.shape[1]
    chosen = batch["labels"][:, :-1] != IGNORE_INDEX  # tokens 1..n-2: those that stay in the input
    was, now = original[:, 1 : n - 1][chosen], batch["input_ids"][:, 1:][chosen]
    masked = (now == SPECIAL.mask_id).float().mean()
    changed = ((now != SPECIAL.mask_id) & (now != was)).float().mean()  # a random token may equal the old one
    kept = (now == was).float().mean()
    assert masked == pytest.approx(mask, abs=0.04)
    assert changed == pytest.approx(random * (1 - 1 / (V - FIRST_WORD)), abs=0.04)
    assert kept == pytest.approx(1 - mask - random, abs=0.04)
    never = torch.tensor(sorted(SPECIAL.never_masked()))
    assert not torch.isin(now[(now != was) & (now != SPECIAL.mask_id)], never).any()  # no special token drawn


def test_the_mask_rate_falls_over_the_run_and_validation_reads_the_end_rate():
    assert mask_rate(0.0, 0.3, 0.15) == 0.3
    assert mask_rate(0.5, 0.3, 0.15) == pytest.approx(0.225)
    assert mask_rate(1.0, 0.3, 0.15) == mask_rate(5.0, 0.3, 0.15) == mask_rate(None, 0.3, 0.15) == 0.15

    def share(done):
        _, batch = collate(300, done=done)
        return float((batch["labels"] != IGNORE_INDEX).float().mean()) * 32 / 31  # of the eligible positions

    assert share(0.0) == pytest.approx(0.3 * 0.95, abs=0.015)  # about 5% of the tokens are separators
    assert share(1.0) == pytest.approx(0.15 * 0.95, abs=0.015)
    assert share(None) == share(1.0)


def test_a_row_is_masked_by_its_own_generator_and_progress_alone():
    data = blocks(5, 33)
    collator = MNTPCollator(special=SPECIAL, vocab_size=V, mask_rate_start=0.3, mask_rate_end=0.15)
    whole = collator(data, example_generators(1, 0, range(5)), 0.4)
    alone = collator(data[3:4], example_generators(1, 0, [3]), 0.4)
    assert all(torch.equal(whole[k][3:4], alone[k]) for k in whole)
    start, end = (
        collator(data, example_generators(1, 0, range(5)), done)["labels"] != IGNORE_INDEX for done in (0.0, 1.0)
    )
    assert not (end & ~start).any() and end.sum() < start.sum()  # the same spans, fewer of them at a lower rate


def test_bad_settings_are_one_line_errors():
    with pytest.raises(DataError, match="needs a mask token"):
        MNTPCollator(special=SpecialTokens(pad_id=0), vocab_size=V)
    with pytest.raises(DataError, match=r"mask_rate_start=1.0 is outside \(0, 1\)"):
        MNTPCollator(special=SPECIAL, vocab_size=V, mask_rate_start=1.0)
    with pytest.raises(DataError, match="max_span_length=0 must be a positive integer"):
        MNTPCollator(special=SPECIAL, vocab_size=V, max_span_length=0)


# ----------------------------------------------------------------------------- in a mixture


DATA = dict(max_train_bytes=60_000, max_val_bytes=10_000, block_size=24, batch_size=4)
TOKENIZER = TokenizerConfig(vocab_size=300, max_train_bytes=60_000, num_sentinels=0)


def gptbert(cache: str, mixing: str) -> MixtureDataModule:
    data = DataConfig(cache_dir=cache, **DATA)
    tasks = [
        MixtureTask("clm", "clm", "clm", data),
        MixtureTask("mntp", "mntp", "clm", data, mask_rate_start=0.5, mask_rate_end=0.1),
    ]
    return MixtureDataModule(
        tasks,
        arch="decoder",
        tokenizer=TOKENIZER,
        tokenizer_data=data,
        weights=[1.0, 3.0],
        seed=4,
        mixing=mixing,
        max_steps=8,
        accumulate=2,
    )


def consume(dm, it, k):
    return [dm.on_before_batch_transfer(next(it), 0) for _ in range(k)]  # what Lightning calls per batch


def same(a, b):
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


@pytest.mark.parametrize("mixing", ["step", "row"])
def test_a_resumed_mixture_masks_exactly_as_an_uninterrupted_one(tmp_path_factory, mixing):
    cache = str(tmp_path_factory.getbasetemp() / "mntp-cache")
    first = gptbert(cache, mixing)
    first.setup()
    it = iter(first.train_dataloader())
    early = consume(first, it, 5)
    state = first.state_dict()
    expected = consume(first, it, 11)  # to step 8, where the rate reaches its end

    resumed = gptbert(cache, mixing)  # its collators rebuilt, at micro-batch 5 of accumulation 2
    resumed.load_state_dict(state)
    resumed.setup()
    got = consume(resumed, iter(resumed.train_dataloader()), 11)
    assert all(same(a, b) for a, b in zip(got, expected)) and resumed.state_dict() == first.state_dict()

    def masked_share(batch) -> float | None:  # of the mntp rows' positions
        if mixing == "row":
            labels = batch["labels"][batch["row_task"] == 1]
        else:
            labels = batch["labels"] if batch["task"] == 1 else batch["labels"][:0]
        return float((labels != IGNORE_INDEX).float().mean()) if labels.numel() else None

    by_step = [(i // 2, masked_share(b)) for i, b in enumerate(early + expected)]  # accumulation 2
    first = [s for step, s in by_step if step <= 2 and s is not None]  # rates 0.5, 0.45, 0.4
    last = [s for step, s in by_step if step >= 6 and s is not None]  # rates 0.2, 0.15
    assert first and last and np.mean(first) > np.mean(last) + 0.15
