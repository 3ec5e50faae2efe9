"""Time to quality: a wall-clock budget (trainer.max_time) that ends a run as max_steps would and
that the learning-rate schedule decays over, and its recipe keys' errors."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from helpers import RECIPES, tiny_config, tiny_run_config
from lightning.pytorch.callbacks import Callback

from lit_transformer.commands.train import train
from lit_transformer.objectives import CausalLM
from lit_transformer.objectives.optim import (
    TrainingClock,
    lr_multiplier,
    make_scheduler,
)
from lit_transformer.recipe.load import RecipeError, load_recipe
from lit_transformer.recipe.schema import OptimConfig
from lit_transformer.training.rundir import read_metrics

# ----------------------------------------------------------------------------- schedules


def lrs(scheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def advance(scheduler) -> None:
    scheduler.optimizer.step()  # (no gradient: no update) before the scheduler, as torch expects
    scheduler.step()


def one_parameter_sgd(lr: float = 2.0) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=lr)


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_the_decay_follows_the_time_budget_not_the_step(schedule):
    """With a fake clock: half the budget gives the decay's midpoint, the budget and beyond
    its floor, whatever step the run is at; warmup (in steps) ramps up beneath the decay."""
    optim = OptimConfig(lr=2.0, schedule=schedule, warmup_steps=4, min_lr_ratio=0.1)
    clock = SimpleNamespace(elapsed=0.0)
    scheduler = make_scheduler(one_parameter_sgd(), optim, max_steps=1_000_000, max_time=60.0, clock=clock)
    group = scheduler.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(2.0 * 1 / 4)  # step_num 1 of a 4-step warmup
    advance(scheduler)
    assert group["lr"] == pytest.approx(2.0 * 2 / 4)
    clock.elapsed = 59.0  # warmup's ramp stays beneath a decay that is already nearly done
    advance(scheduler)
    assert group["lr"] == pytest.approx(2.0 * lr_multiplier(2, optim, elapsed=59.0, max_time=60.0))
    assert group["lr"] < 2.0 * 3 / 4
    for _ in range(10):  # past warmup
        advance(scheduler)
    midpoint = 0.1 + 0.9 * 0.5  # cos(pi / 2) = 0 and the linear's half both give the midpoint
    for elapsed, factor in [(0.0, 1.0), (15.0, None), (30.0, midpoint), (60.0, 0.1), (600.0, 0.1)]:
        clock.elapsed = elapsed
        advance(scheduler)
        if factor is None:  # a quarter: cosine's 0.1 + 0.9 * (1 + cos(pi / 4)) / 2, linear's 0.775
            progress_term = 0.5 * (1 + math.cos(math.pi / 4)) if schedule == "cosine" else 0.75
            factor = 0.1 + 0.9 * progress_term
        assert group["lr"] == pytest.approx(2.0 * factor, rel=1e-12), elapsed


def test_constant_and_inverse_sqrt_ignore_the_budget():
    clock = SimpleNamespace(elapsed=1e9)
    for schedule in ("constant", "inverse_sqrt"):
        optim = OptimConfig(schedule=schedule, warmup_steps=5)
        for step in (0, 3, 50):
            assert lr_multiplier(step, optim, d_model=64, elapsed=clock.elapsed, max_time=10.0) == lr_multiplier(
                step, optim, d_model=64
            )


def reference_multiplier(step, optim, max_steps=None, d_model=None):
    """lr_multiplier as it was before time budgets (a verbatim copy): the step-based schedule."""
    s = step + 1
    warmup = optim.warmup_steps
    if optim.schedule == "inverse_sqrt":
        ramp = s * warmup**-1.5 if warmup > 0 else math.inf
        return d_model**-0.5 * min(s**-0.5, ramp)
    if s < warmup:
        return s / warmup
    if optim.schedule == "constant":
        return 1.0
    span = max(max_steps - warmup, 1)
    progress = min(max(s - warmup, 0) / span, 1.0)
    floor = optim.min_lr_ratio
    if optim.schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine", "inverse_sqrt"])
@pytest.mark.parametrize("warmup", [0, 7])
def test_without_max_time_the_step_schedule_is_unchanged_bit_for_bit(schedule, warmup):
    optim = OptimConfig(lr=3e-3, schedule=schedule, warmup_steps=warmup, min_lr_ratio=0.05)
    clock = SimpleNamespace(elapsed=123.0)  # ignored without max_time
    got = lrs(make_scheduler(one_parameter_sgd(3e-3), optim, 29, 64, clock=clock), 40)
    reference = torch.optim.lr_scheduler.LambdaLR(
        one_parameter_sgd(3e-3), lambda step: reference_multiplier(step, optim, 29, 64)
    )
    assert got == lrs(reference, 40)  # exactly: the same floats in the same order
    assert len(set(got)) > 2 or (schedule, warmup) == ("constant", 0)


def test_training_clock_counts_only_while_running(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("lit_transformer.objectives.optim.time.perf_counter", lambda: now[0])
    clock = TrainingClock()
    now[0] += 5  # before the first batch: start-up, not training
    clock.start()
    now[0] += 3
    assert clock.read() == 3.0 and clock.elapsed == 0.0  # schedules see only marks
    assert clock.mark() == 3.0 and clock.elapsed == 3.0
    clock.stop()  # validation
    now[0] += 50
    clock.start()
    now[0] += 2
    assert clock.read() == 5.0
    clock.mark(7.5)  # another rank's larger reading
    assert clock.elapsed == 7.5


def test_the_training_time_is_saved_and_restored_with_the_checkpoint():
    optim = OptimConfig(schedule="cosine", warmup_steps=0)
    module = CausalLM(tiny_config(), optim=optim, max_steps=10, max_time=40.0)
    module.train_clock.reset(30.0)
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    assert checkpoint["train_seconds"] == 30.0
    resumed = CausalLM(tiny_config(), optim=optim, max_steps=10, max_time=40.0)
    resumed.on_load_checkpoint(checkpoint)
    assert resumed.train_clock.elapsed == 30.0
    scheduler = resumed.configure_optimizers()["lr_scheduler"]["scheduler"]
    group = scheduler.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(3e-4 * lr_multiplier(0, optim, elapsed=30.0, max_time=40.0))
    assert group["lr"] < 3e-4 * 0.25  # three quarters of the budget: far down the cosine


class ClockProbe(Callback):
    """The training clock's mark at every batch end and at the end of training."""

    def __init__(self):
        self.marks: list[float] = []
        self.final: float | None = None

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.marks.append(pl_module.train_clock.elapsed)

    def on_train_end(self, trainer, pl_module) -> None:
        self.final = pl_module.train_clock.elapsed


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread", "private_cache")
def test_a_time_budget_ends_the_run_as_a_finished_one(tmp_path):
    """max_time=5 with max_steps=100000: training stops once 5 s of training are spent, then
    validates and saves the final model and metrics.json; the learning rate decays with time."""
    probe = ClockProbe()
    run = tmp_path / "run"
    metrics = train(
        tiny_run_config(
            run,
            "trainer.max_time=5",
            "trainer.max_steps=100000",
            "optim.warmup_steps=3",
            "trainer.val_check_interval=100000",
            "trainer.checkpoint_every_n_steps=100000",
        ),
        callbacks=[probe],
        progress_bar=False,
    )
    steps = len(probe.marks)
    assert 10 < steps < 100000
    assert probe.final >= 5.0 and all(m < 5.0 for m in probe.marks[:-1])  # the last step spent it
    assert (run / "model.safetensors").is_file()
    saved = json.loads((run / "metrics.json").read_text())
    assert "val/loss" in saved and saved["val/loss"] == pytest.approx(metrics["val/loss"])
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert checkpoint["global_step"] == steps and checkpoint["train_seconds"] >= 5.0
    lr = [r["train/lr"] for r in read_metrics(run) if "train/lr" in r]
    peak = 1e-3  # recipes/base/tiny.yaml
    assert lr[:3] == pytest.approx(
        [
            peak / 3,
            2 * peak / 3,
            peak * lr_multiplier(2, OptimConfig(lr=peak, warmup_steps=3), elapsed=probe.marks[1], max_time=5.0),
        ]
    )
    assert all(b <= a for a, b in zip(lr[2:], lr[3:]))  # after warmup: down with the clock
    assert lr[-1] < 0.2 * peak  # near the floor (min_lr_ratio 0.1) at the end of the budget


@pytest.mark.slow
@pytest.mark.usefixtures("private_cache")
def test_the_speedrun_recipe_trains_for_its_budget_and_finishes(tmp_path):
    """recipes/speedrun-clm.yaml as it stands (Muon, QK-norm, ReLU^2, tied head, schedule to
    the budget), on a small slice of the embedded corpus with a 4-second budget."""
    run = tmp_path / "speedrun"
    cfg = load_recipe(
        RECIPES / "speedrun-clm.yaml",
        [
            "tokenizer.vocab_size=400",
            "tokenizer.max_train_bytes=150000",
            "data.max_train_bytes=150000",
            "data.max_val_bytes=20000",
            "data.batch_size=4",
            "trainer.max_time=4",
            "trainer.limit_val_batches=2",
            "trainer.log_every_n_steps=1",
            "logger.wandb.mode=disabled",
            f"run.dir={run}",
        ],
    )
    assert (cfg.optim.optimizer, cfg.model.qk_norm, cfg.model.activation, cfg.model.tie_embeddings) == (
        "muon",
        True,
        "relu2",
        True,
    )
    metrics = train(cfg, progress_bar=False)
    assert math.isfinite(metrics["val/bpb"]) and (run / "model.safetensors").is_file()
    steps = [r["step"] for r in read_metrics(run) if "train/loss" in r]
    assert steps and steps[-1] < cfg.trainer.max_steps  # the budget, not the steps, ended it


# ----------------------------------------------------------------------------- recipe errors


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.max_time=0", r"trainer\.max_time=0\.0 must be positive or null"),
        ("trainer.max_time=-30", r"trainer\.max_time=-30\.0 must be positive or null"),
        ("optim.optimizer=sgd", r"optim\.optimizer: Invalid value 'sgd'"),
        ("optim.optimizer=Muon", r"optim\.optimizer: .*\(did you mean `muon`\?\)"),
        ("optim.muon_lr=0", r"optim\.muon_lr=0\.0 must be positive"),
        ("optim.muon_momentum=1", r"optim\.muon_momentum=1\.0 is outside \[0, 1\)"),
        ("optim.z_loss=-0.1", r"optim\.z_loss=-0\.1 must not be negative"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_key(override, message):
    with pytest.raises(RecipeError, match=message) as info:
        load_recipe(RECIPES / "tiny-clm.yaml", [override])
    assert "\n" not in str(info.value)


def test_the_new_keys_have_their_defaults():
    cfg = load_recipe(RECIPES / "tiny-clm.yaml")
    assert cfg.trainer.max_time is None
    assert (cfg.optim.optimizer, cfg.optim.muon_lr, cfg.optim.muon_momentum, cfg.optim.z_loss) == (
        "adamw",
        0.02,
        0.95,
        0.0,
    )
    cfg = load_recipe(RECIPES / "tiny-clm.yaml", ["trainer.max_time=90", "optim.optimizer=muon", "optim.z_loss=1e-4"])
    assert (cfg.trainer.max_time, cfg.optim.optimizer, cfg.optim.z_loss) == (90.0, "muon", 1e-4)
