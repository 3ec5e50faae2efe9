"""data.block_warmup_steps: sequence-length warmup by cutting packed blocks into shorter rows. The
schedule, the cut (every token kept, in order), the batches a run trains on, an exact resume in
the middle of the warmup, and the one-line errors."""

from __future__ import annotations

import pytest
import torch
from helpers import RECIPES, TINY_RUN, assert_resume_matches
from lightning.pytorch.callbacks import Callback

from lit_transformer.commands.train import train
from lit_transformer.data.batches.block_warmup import cut_rows, warmup_row_length
from lit_transformer.data.batches.collate import IGNORE_INDEX
from lit_transformer.errors import DataError, RecipeError
from lit_transformer.recipe.load import load_recipe


def test_rows_double_in_equal_stages_then_stay_whole():
    lengths = [warmup_row_length(s, block_size=128, start=16, steps=90) for s in range(120)]
    assert lengths[:30] == [16] * 30
    assert lengths[30:60] == [32] * 30
    assert lengths[60:90] == [64] * 30
    assert lengths[90:] == [128] * 30
    assert [warmup_row_length(s, block_size=24, start=12, steps=3) for s in range(5)] == [12, 12, 12, 24, 24]


def _packed_batch() -> dict[str, torch.Tensor]:
    """(3, 8) rows; the last holds 3 real tokens and padding, as the final block of a corpus does."""
    ids = torch.arange(24).reshape(3, 8) + 5
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[2, 3:] = 0
    labels = (ids + 1).masked_fill(mask == 0, IGNORE_INDEX)
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]] * 3)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 3)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "document_ids": documents,
        "position_ids": positions,
    }


def test_cut_keeps_every_token_in_order_and_drops_rows_of_padding_only():
    batch = _packed_batch()
    cut = cut_rows(batch, 2)
    # 12 rows of 2, less the two rows of the last block that hold only padding
    assert cut["input_ids"].shape == (10, 2)
    for key in ("input_ids", "labels", "document_ids", "position_ids"):
        real_before = batch[key][batch["attention_mask"].bool()]
        real_after = cut[key][cut["attention_mask"].bool()]
        assert torch.equal(real_after, real_before), key
    assert cut["attention_mask"].any(dim=1).all()
    assert torch.equal(cut["input_ids"][1], torch.tensor([7, 8]))  # the second row continues the first
    assert cut_rows(batch, 8) is batch  # whole blocks: untouched
    with pytest.raises(ValueError, match="cannot be cut into rows of 3"):
        cut_rows(batch, 3)


class RecordRows(Callback):
    """The (rows, length) of every batch a training step receives."""

    def __init__(self):
        self.shapes: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.shapes.append(tuple(batch["input_ids"].shape))


@pytest.mark.parametrize("recipe", ["tiny-clm", "tiny-mlm"])
def test_a_run_trains_on_short_rows_first_then_whole_blocks(tmp_path, recipe):
    record = RecordRows()
    args = [
        *TINY_RUN,
        "trainer.max_steps=6",
        "trainer.val_check_interval=6",
        "data.block_warmup_steps=4",
        "data.block_warmup_start=6",
        f"run.dir={tmp_path / 'run'}",
    ]
    train(load_recipe(RECIPES / f"{recipe}.yaml", args), callbacks=[record], progress_bar=False)
    # blocks of 24 tokens, 3 a batch: rows of 6 for two steps, of 12 for two, then whole blocks
    assert record.shapes == [(12, 6), (12, 6), (6, 12), (6, 12), (3, 24), (3, 24)]


def test_a_run_resumed_in_the_middle_of_the_warmup_repeats_it_exactly(tmp_path):
    def config(run_dir, *extra):
        args = [
            *TINY_RUN,
            "trainer.max_steps=6",
            "trainer.val_check_interval=3",
            "trainer.checkpoint_every_n_steps=3",
            "model.dropout=0.0",
            "data.block_warmup_steps=4",
            "data.block_warmup_start=12",
            f"run.dir={run_dir}",
            *extra,
        ]
        return load_recipe(RECIPES / "tiny-clm.yaml", args)

    assert_resume_matches(config, tmp_path, stop=3, steps=6)


@pytest.mark.parametrize(
    ("recipe", "change", "named"),
    [
        ("tiny-clm", ["data.block_warmup_steps=10", "data.block_warmup_start=48"], "data.block_warmup_start=48"),
        ("tiny-clm", ["data.block_warmup_steps=10", "data.block_warmup_start=128"], "data.block_warmup_start=128"),
        ("tiny-clm", ["data.block_size=96", "data.block_warmup_steps=10"], "data.block_warmup_start=32"),
        ("tiny-clm", ["data.block_warmup_steps=-1"], "data.block_warmup_steps=-1"),
        ("tiny-seq2seq", ["data.block_warmup_steps=10"], "data.block_warmup_steps"),
        ("tiny-span", ["data.block_warmup_steps=10"], "not 'span'"),
    ],
)
def test_warmup_that_cannot_apply_is_a_one_line_error(recipe, change, named):
    with pytest.raises((RecipeError, DataError), match=named) as caught:
        load_recipe(RECIPES / f"{recipe}.yaml", ["data.block_size=128", *change])
    assert "\n" not in str(caught.value)
