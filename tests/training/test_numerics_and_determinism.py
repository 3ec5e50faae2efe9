"""Numerics and determinism of a run: non-finite steps are skipped, counted, and stop the run
after the patience with the last finite checkpoint intact; language models default to bf16
only where bf16 is fast; the same recipe and seed give bitwise equal losses on the CPU."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import RECIPES, losses, one_error_line
from helpers import tiny_dropout_pretrain as pretrain

from lit_transformer.commands.cli import main
from lit_transformer.training.checkpoints import checkpoint_step, read_checkpoint
from lit_transformer.training.rundir import latest_checkpoint, read_metrics

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")


# ----------------------------------------------------------------------------- numerics


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(tmp_path, monkeypatch, capsys):
    """Step 2: a finite loss with infinite gradients (skipped); steps 5, 6, 7: NaN losses. With
    patience 3 the run stops after step 7, before step 8's checkpoint: step 4's stays the
    newest, finite and intact; skipped steps leave the weights alone."""
    from lit_transformer.objectives.objective_base import ObjectiveBase

    original = ObjectiveBase.finish_training_step
    seen: dict[int, dict[str, torch.Tensor]] = {}  # step -> weights its forward ran with

    def poisoned(self, loss, *args, **kwargs):
        if self.global_step == 2:
            loss = loss * 1.0
            loss.register_hook(lambda grad: grad * float("inf"))
        elif self.global_step >= 5:
            loss = loss * float("nan")
        seen[self.global_step] = {k: v.detach().clone() for k, v in self.state_dict().items()}
        return original(self, loss, *args, **kwargs)

    monkeypatch.setattr(ObjectiveBase, "finish_training_step", poisoned)
    run_dir = tmp_path / "run"
    assert (
        main(
            pretrain(
                run_dir,
                "trainer.max_steps=12",
                "trainer.val_check_interval=12",
                "trainer.checkpoint_every_n_steps=4",
                "trainer.nonfinite_patience=3",
            )
        )
        == 2
    )
    line = one_error_line(capsys)
    assert "training stopped at step 8: 3 steps in a row had a non-finite loss or gradient" in line
    assert str(run_dir / "checkpoints" / "last.ckpt") in line
    rows = read_metrics(run_dir)
    loss = {int(r["step"]): r["train/loss"] for r in rows if "train/loss" in r}
    assert sorted(loss) == [0, 1, 2, 3, 4, 5, 6]  # step 7's row: the run stopped before Lightning logs it
    assert all(math.isfinite(loss[s]) for s in range(5)) and all(math.isnan(loss[s]) for s in (5, 6))
    norms = {int(r["step"]): r["train/grad_norm"] for r in rows if "train/grad_norm" in r}
    assert not math.isfinite(norms[2]) and all(math.isfinite(norms[s]) for s in (0, 1, 3, 4))
    assert [r.get("train/skipped_steps") for r in rows if "train/loss" in r] == [0, 0, 0, 1, 1, 2, 3]  # 4th: step 7
    assert checkpoint_step(latest_checkpoint(run_dir)) == 4 and not (run_dir / "model.safetensors").exists()
    state = read_checkpoint(latest_checkpoint(run_dir))["state_dict"]
    for name, value in state.items():
        assert torch.isfinite(value).all(), name
        torch.testing.assert_close(value, seen[4][name], rtol=0, atol=0)  # the checkpoint: after 4 updates
        torch.testing.assert_close(seen[7][name], seen[5][name], rtol=0, atol=0)  # skipped steps change nothing
    assert all(torch.equal(seen[3][k], seen[2][k]) for k in state)  # step 2 (inf gradients) was skipped too


@pytest.mark.parametrize("bf16_cpu", [True, False])
def test_language_models_default_to_bf16_where_bf16_is_fast(bf16_cpu, monkeypatch):
    from lit_transformer import machine
    from lit_transformer.recipe.load import load_recipe as read
    from lit_transformer.run.resolve import resolve_run

    def load_recipe(path, overrides=()):  # the precision is the resolver's: it asks the machine
        return resolve_run(read(path, overrides), read_source=False, training=False, measure=lambda *_: 1e9).config

    flags = {"avx2", "amx_bf16"} if bf16_cpu else {"avx2", "avx512f"}
    monkeypatch.setattr(machine, "cpu_flags", lambda: flags)
    monkeypatch.setattr(machine, "has_nvidia_gpu", lambda: False)
    for path in RECIPES.glob("*.yaml"):
        cfg = load_recipe(path)
        if cfg.objective.name in ("span", "seq2seq"):  # never float16: T5's activations overflow it
            assert cfg.trainer.precision.startswith("bf16") or not bf16_cpu and cfg.trainer.precision == "32-true", path
    span = "bf16-mixed" if bf16_cpu else "32-true"  # emulated bf16 is several times slower than float32
    assert load_recipe(RECIPES / "tiny-span.yaml", ["trainer.precision=null"]).trainer.precision == span
    assert load_recipe(RECIPES / "tiny-seq2seq.yaml", ["trainer.precision=null"]).trainer.precision == span
    assert load_recipe(RECIPES / "tiny-span.yaml", ["trainer.accelerator=gpu"]).trainer.precision == "bf16-mixed"
    assert load_recipe(RECIPES / "tiny-clm.yaml", ["trainer.precision=null"]).trainer.precision == span
    assert load_recipe(RECIPES / "tiny-mlm.yaml", ["trainer.precision=null"]).trainer.precision == span
    assert load_recipe(RECIPES / "tiny-classify.yaml", ["trainer.precision=null"]).trainer.precision == "32-true"
    # a recipe's own choice stands
    assert load_recipe(RECIPES / "tiny-clm.yaml", ["trainer.precision=bf16-mixed"]).trainer.precision == "bf16-mixed"


# ----------------------------------------------------------------------------- determinism


def test_same_recipe_and_seed_give_identical_losses(tmp_path):
    """Masked LM: random masking, dropout and shuffling, twice from scratch: bitwise equal."""
    args = ["trainer.max_steps=5", "trainer.val_check_interval=5", "trainer.checkpoint_every_n_steps=5"]
    assert main(pretrain(tmp_path / "a", *args, recipe="tiny-mlm")) == 0
    assert main(pretrain(tmp_path / "b", *args, recipe="tiny-mlm")) == 0
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(a) == 5 and a == b
    assert main(pretrain(tmp_path / "c", *args, "trainer.seed=1", recipe="tiny-mlm")) == 0
    assert losses(tmp_path / "c") != a  # the seed matters
