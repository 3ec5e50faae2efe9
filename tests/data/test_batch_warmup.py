"""data.batch_warmup_steps: batch-size warmup. The schedule, the sampler (the plain sampler's
examples in the plain order, only in smaller batches first), the batches a run trains on with and
without accumulation, an exact resume in the middle of the warmup, and the one-line errors."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import RECIPES, TINY_RUN, assert_resume_matches
from lightning.pytorch.callbacks import Callback

from lit_transformer.commands.train import train
from lit_transformer.data.batches.batch_warmup import WarmupBatchSampler, warmup_batch_rows
from lit_transformer.data.batches.sampler import ResumableBatchSampler
from lit_transformer.errors import DataError, RecipeError
from lit_transformer.recipe.load import load_recipe


def test_batches_double_in_equal_stages_then_stay_whole():
    sizes = [warmup_batch_rows(i, batch_size=64, start=8, items=90) for i in range(100)]
    assert sizes[:30] == [8] * 30
    assert sizes[30:60] == [16] * 30
    assert sizes[60:90] == [32] * 30
    assert sizes[90:] == [64] * 10
    assert [warmup_batch_rows(i, batch_size=6, start=3, items=2) for i in range(4)] == [3, 3, 6, 6]


def _flat(sampler, epoch: int) -> list[int]:
    sampler.set_epoch(epoch)
    return [i for _, _, indices in sampler for i in indices]


@pytest.mark.parametrize(("rank", "world"), [(0, 1), (1, 3)])
def test_the_first_epoch_holds_the_plain_examples_in_the_plain_order(rank, world):
    common = dict(seed=5, rank=rank, world_size=world)
    plain = ResumableBatchSampler(203, 8, **common)
    warm = WarmupBatchSampler(203, 8, warmup_items=6, start=2, **common)
    warm.set_epoch(0)
    assert [len(indices) for _, _, indices in warm][:8] == [2, 2, 2, 4, 4, 4, 8, 8]
    assert len(warm) == len(list(warm))
    first, expected = _flat(warm, 0), _flat(plain, 0)
    per_rank = 203 // world
    # the warmup took 18 examples, so the plain batches after it end 18 mod 8 = 2 examples later
    # (both drop the rest of the rank's shard that fills no whole batch)
    assert first == plain.shard(0)[: len(first)].tolist()
    assert len(first) == 18 + (per_rank - 18) // 8 * 8 and len(expected) == per_rank // 8 * 8
    assert len(set(first)) == len(first)
    assert _flat(warm, 1) == _flat(plain, 1)  # later epochs: the plain sampler's
    assert len(warm) == len(plain)


def test_a_resumed_first_epoch_goes_on_with_the_next_batch():
    warm = WarmupBatchSampler(100, 8, warmup_items=6, start=2, seed=1)
    warm.set_epoch(0)
    whole = list(warm)
    warm.resume(0, 4)
    assert list(warm) == whole[4:]
    assert list(warm) == whole  # a resume is used once


def test_a_checkpoint_of_the_first_epoch_carries_only_to_its_own_layout():
    warm = WarmupBatchSampler(96, 8, warmup_items=4, start=2)
    warm.set_epoch(0)
    with pytest.raises(DataError, match="resumes only on the layout it was saved with"):
        warm.carry(3, 2, 8)
    warm.set_epoch(1)
    assert warm.carry(3, 2, 8) == ResumableBatchSampler(96, 8).carry(3, 2, 8) == 6


def test_a_warmup_longer_than_an_epoch_is_refused():
    with pytest.raises(DataError, match="take 80 examples per rank, more than an epoch's 50"):
        WarmupBatchSampler(100, 8, warmup_items=20, start=4, world_size=2)


class RecordRows(Callback):
    def __init__(self):
        self.rows: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.rows.append(batch["input_ids"].shape[0])


def _args(run_dir, *extra):
    return [
        *TINY_RUN,
        "data.batch_size=4",
        "data.batch_warmup_start=1",
        "data.batch_warmup_steps=4",
        f"run.dir={run_dir}",
        *extra,
    ]


@pytest.mark.parametrize(("recipe", "accumulate"), [("tiny-clm", 1), ("tiny-mlm", 1), ("tiny-clm", 2)])
def test_a_run_trains_on_small_batches_first(tmp_path, recipe, accumulate):
    record = RecordRows()
    steps = 6
    extra = [f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps * accumulate}"]
    extra.append(f"trainer.accumulate_grad_batches={accumulate}")
    train(load_recipe(RECIPES / f"{recipe}.yaml", _args(tmp_path / "run", *extra)), callbacks=[record])
    # micro-batches: 1 example for two steps, 2 for two, then the whole batch of 4
    assert record.rows == list(np.repeat([1, 1, 2, 2, 4, 4], accumulate))


def test_a_run_resumed_in_the_middle_of_the_warmup_repeats_it_exactly(tmp_path):
    def config(run_dir, *extra):
        more = ["trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.checkpoint_every_n_steps=3"]
        return load_recipe(RECIPES / "tiny-clm.yaml", _args(run_dir, *more, "model.dropout=0.0", *extra))

    assert_resume_matches(config, tmp_path, stop=3, steps=6)


@pytest.mark.parametrize(
    ("recipe", "change", "named"),
    [
        ("tiny-clm", ["data.batch_warmup_steps=10", "data.batch_warmup_start=3"], "data.batch_warmup_start=3"),
        ("tiny-clm", ["data.batch_warmup_steps=10", "data.batch_warmup_start=32"], "data.batch_warmup_start=32"),
        ("tiny-clm", ["data.batch_warmup_steps=-2"], "data.batch_warmup_steps=-2"),
        ("tiny-clm", ["data.batch_warmup_steps=10", "data.streaming=true"], "data.streaming=true"),
        ("tiny-seq2seq", ["data.batch_warmup_steps=10", "data.batch_tokens=512"], "data.batch_tokens is set"),
        ("tiny-ul2", ["data.batch_warmup_steps=10"], "a mixture's steps draw from several tasks"),
    ],
)
def test_warmup_that_cannot_apply_is_a_one_line_error(recipe, change, named):
    with pytest.raises((RecipeError, DataError), match=named) as caught:
        load_recipe(RECIPES / f"{recipe}.yaml", ["data.batch_size=32", *change])
    assert "\n" not in str(caught.value)
