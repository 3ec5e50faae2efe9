"""trainer.ema_decay: the final model is the moving average of the weights after each optimizer
step, validation sees it, and a resumed run continues both the weights and the average."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import TINY_RUN, StopAt, losses
from lightning.pytorch.callbacks import Callback
from safetensors.torch import load_file

from lit_transformer.commands.train import train
from lit_transformer.errors import RecipeError
from lit_transformer.recipe.load import load_recipe
from lit_transformer.training.checkpoints import read_checkpoint

RECIPES = Path(__file__).resolve().parents[2] / "recipes"

DECAY = 0.5  # large steps of the average, so that a wrong update order shows
COMMON = [
    *TINY_RUN,
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.checkpoint_every_n_steps=2",
    "trainer.log_every_n_steps=1",
    "model.dropout=0.0",
    f"trainer.ema_decay={DECAY}",
    "logger.wandb.mode=disabled",
]


def config(run_dir, *extra):
    return load_recipe(RECIPES / "tiny-clm.yaml", [*COMMON, f"run.dir={run_dir}", *extra])


class RecordWeights(Callback):
    """The trained weights after every optimizer step, by parameter name."""

    def __init__(self):
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.steps.append({n: p.detach().clone() for n, p in pl_module.model.named_parameters()})


def test_the_final_model_is_the_moving_average_of_the_steps(tmp_path):
    record = RecordWeights()
    train(config(tmp_path / "run"), callbacks=[record], progress_bar=False)
    assert len(record.steps) == 4
    average = dict(record.steps[0])  # the average starts as the first step's weights
    for step in record.steps[1:]:
        average = {n: DECAY * average[n] + (1 - DECAY) * step[n] for n in average}
    final = load_file(tmp_path / "run" / "model.safetensors")
    for name, value in average.items():
        torch.testing.assert_close(final[name], value, rtol=1e-6, atol=1e-7)
    # the average differs from the trained weights (or this test could not fail)
    assert any(not torch.equal(final[n], record.steps[-1][n]) for n in average)
    # the checkpoint: state_dict is the average, current_model_state the trained weights
    ckpt = read_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    name = next(iter(average))
    torch.testing.assert_close(ckpt["state_dict"][f"model.{name}"], average[name], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ckpt["current_model_state"][f"model.{name}"], record.steps[-1][name])


def test_a_resumed_run_continues_the_average(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(config(whole), progress_bar=False)
    train(config(parts), callbacks=[StopAt(2)], progress_bar=False)
    train(config(parts, "resume=auto"), progress_bar=False)
    expected, got = losses(whole), losses(parts)
    assert sorted(got) == sorted(expected) == [0, 1, 2, 3]
    for step in expected:  # the trained weights continued, not the average
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step
    a, b = load_file(whole / "model.safetensors"), load_file(parts / "model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["trainer.ema_decay=1.0"], "is outside"),
        (["trainer.average_last=3"], "choose one"),
        (["trainer.strategy=fsdp"], "whole weights"),
    ],
)
def test_bad_ema_settings_are_one_line_errors(tmp_path, extra, message):
    with pytest.raises(RecipeError, match=message):
        config(tmp_path / "run", *extra)
