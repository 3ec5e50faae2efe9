"""trainer.ema_decay: the final model is the moving average of the weights after each optimizer
step, validation and the named evaluations see it, and a resumed run continues both the weights
and the average."""

from __future__ import annotations

import pytest
import torch
from helpers import RECIPES, TINY_RUN, StopAt, losses, tiny_run_config
from lightning.pytorch.callbacks import Callback
from safetensors.torch import load_file

from lit_transformer.commands.evaluate import evaluate_suite
from lit_transformer.commands.train import train
from lit_transformer.errors import RecipeError
from lit_transformer.recipe.load import load_recipe
from lit_transformer.training.checkpoints import read_checkpoint
from lit_transformer.training.rundir import read_metrics

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


class RecordWeights(Callback):
    """The trained weights after every optimizer step, by parameter name."""

    def __init__(self):
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.steps.append({n: p.detach().clone() for n, p in pl_module.model.named_parameters()})


def test_the_final_model_is_the_moving_average_of_the_steps(tmp_path):
    record = RecordWeights()
    train(tiny_run_config(tmp_path / "run", base=COMMON), callbacks=[record], progress_bar=False)
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


class RecordValidation(Callback):
    """The objective module and the batches of the latest validation, as the model saw them."""

    def __init__(self):
        self.module = None
        self.batches: list[dict[str, torch.Tensor]] = []

    def on_validation_start(self, trainer, pl_module) -> None:
        self.module, self.batches = pl_module, []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.batches.append({k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()})


def validation_loss(module, weights: dict[str, torch.Tensor], batches) -> float:
    """val/loss as the objective computes it, on `weights`."""
    module.model.load_state_dict({**module.model.state_dict(), **weights})
    module.eval()
    module.eval_reset()
    with torch.no_grad():
        for i, batch in enumerate(batches):
            module.eval_update(batch, i)
    loss = float(module.eval_compute()["loss"])
    module.eval_reset()
    return loss


def test_validation_and_named_evaluations_see_the_average(tmp_path):
    """The last validation (step 4, inside fit) logs the loss of the average, not of the trained
    weights, and so does a named evaluation run after it; a learning rate of 1e-2 without warmup
    keeps the two sets of weights far enough apart to tell their numbers apart."""
    recipe = tmp_path / "clm.yaml"
    recipe.write_text(
        f"extends: {RECIPES / 'tiny-clm.yaml'}\n"
        "eval:\n  - {name: text, kind: heldout, embedded: stdlib_text, max_examples: 4}\n"
    )
    run_dir = tmp_path / "run"
    overrides = [a for a in COMMON if a != "eval=[]"]  # TINY_RUN turns the evaluations off
    cfg = load_recipe(recipe, [*overrides, "optim.lr=1e-2", "optim.warmup_steps=0", f"run.dir={run_dir}"])
    record, validation = RecordWeights(), RecordValidation()
    train(cfg, callbacks=[record, validation], progress_bar=False)
    rows = read_metrics(run_dir)
    logged = [r for r in rows if "val/loss" in r][-1]
    evaluated = [r for r in rows if "eval/text/loss" in r][-1]
    # both after the 4th step: Lightning logs that validation at step index 3, the evaluations at 4
    assert (int(logged["step"]), int(evaluated["step"])) == (3, 4)

    average, trained = load_file(run_dir / "model.safetensors"), record.steps[-1]
    on_average = validation_loss(validation.module, average, validation.batches)
    on_trained = validation_loss(validation.module, trained, validation.batches)
    assert abs(on_average - on_trained) > 1e-3  # or this test could not fail
    assert logged["val/loss"] == pytest.approx(on_average, rel=1e-5), (on_average, on_trained)

    # the named evaluation, by `evaluate` on the last checkpoint's average (state_dict) and on its
    # trained weights (current_model_state, written as the state_dict of a second checkpoint)
    last = run_dir / "checkpoints" / "last.ckpt"
    ckpt = read_checkpoint(last)
    ckpt["state_dict"] = ckpt["current_model_state"]
    torch.save(ckpt, run_dir / "checkpoints" / "trained.ckpt")
    on_average = evaluate_suite(str(last))["eval/text/loss"]
    on_trained = evaluate_suite(str(run_dir / "checkpoints" / "trained.ckpt"))["eval/text/loss"]
    assert abs(on_average - on_trained) > 1e-3
    assert evaluated["eval/text/loss"] == pytest.approx(on_average, rel=1e-5), (on_average, on_trained)


def test_a_resumed_run_continues_the_average(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(tiny_run_config(whole, base=COMMON), progress_bar=False)
    train(tiny_run_config(parts, base=COMMON), callbacks=[StopAt(2)], progress_bar=False)
    train(tiny_run_config(parts, "resume=auto", base=COMMON), progress_bar=False)
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
        tiny_run_config(tmp_path / "run", *extra, base=COMMON)
