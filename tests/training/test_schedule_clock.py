"""A time-budgeted hybrid (tiny-gptbert: causal and mntp rows in every batch) under a fake
training clock: the mask rate falls over trainer.max_time, as the learning rate does, although
trainer.max_steps is far away, and a resumed run goes on from the seconds it had spent."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import pytest
from helpers import StopAt, tiny_run_config
from lightning.pytorch.callbacks import Callback

from lit_transformer.commands.train import train
from lit_transformer.data.batches import mntp
from lit_transformer.objectives import optim

START, END = 0.30, 0.15  # recipes/tiny-gptbert.yaml's mask_rate_start and mask_rate_end
BUDGET = 12.0  # seconds of training, one a step: the budget runs out at step 11
RUN = [
    "tokenizer.vocab_size=400",
    "data.batch_size=4",  # 3 causal rows and 1 mntp row in every batch (weights 3:1)
    "data.num_workers=0",  # the collator in this process, where the rates are recorded
    "optim.warmup_steps=0",
    f"trainer.max_time={BUDGET}",
    "trainer.max_steps=100000",  # as users set it: an upper bound far beyond the budget
    "trainer.val_check_interval=100000",
    "trainer.checkpoint_every_n_steps=100000",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=5",  # the last step, the 12th, is not a logging step
]


class FakeClock(Callback):
    """Every training batch takes one second of the training clock: perf_counter, as the clock
    reads it (objectives/optim.py), moves only here. It comes after TimeBudget, which starts the
    clock at the batch's start, so step s's mark is s + 1 seconds."""

    def __init__(self, monkeypatch):
        self.now = 0.0
        monkeypatch.setattr(optim, "time", SimpleNamespace(perf_counter=lambda: self.now))
        self.progress = None

    def on_train_batch_start(self, trainer, *args) -> None:
        self.now += 1.0

    def on_train_end(self, trainer, pl_module) -> None:
        self.progress, self.steps = trainer.datamodule.schedule_progress, trainer.global_step


def hybrid(run_dir, monkeypatch, *extra, stop: int | None = None) -> tuple[list[float], FakeClock]:
    """tiny-gptbert for the budget under the fake clock: the share of the run done that each
    training batch's mntp rows were masked at, in the order the batches were drawn (one more
    than the steps trained: Lightning fetches a batch ahead), and the clock callback."""
    shares: list[float] = []
    rate = mntp.MNTPCollator.rate

    def recorded(self, done):
        if done is not None:  # training batches; validation reads the end rate
            shares.append(done)
        return rate(self, done)

    clock = FakeClock(monkeypatch)
    with monkeypatch.context() as patch:
        patch.setattr(mntp.MNTPCollator, "rate", recorded)
        callbacks = [clock] if stop is None else [clock, StopAt(stop)]
        train(tiny_run_config(run_dir, *RUN, *extra, recipe="tiny-gptbert"), callbacks=callbacks, progress_bar=False)
    clock.run_dir = run_dir
    return shares, clock


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:  # private_cache's cache, for the module
        monkeypatch.setenv("LIT_TRANSFORMER_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        return hybrid(tmp_path_factory.mktemp("budget") / "whole", monkeypatch)


@pytest.mark.usefixtures("one_thread")
def test_the_mask_rate_falls_over_the_time_budget_to_its_end(whole):
    shares, clock = whole
    steps = clock.steps
    assert steps == BUDGET  # one second a step: the budget, not max_steps, ended the run
    trained = shares[:steps]
    assert trained == sorted(trained) and trained[0] == 0.0
    # step s's share is the s seconds spent before it (the clock the learning rate reads for
    # step s), once a mark gives the pace; step 1 is drawn before step 0's mark
    assert trained[2:] == pytest.approx([s / BUDGET for s in range(2, steps)], abs=1e-12)
    rates = [mntp.mask_rate(d, START, END) for d in trained]
    assert rates[-1] == pytest.approx(END + (START - END) / BUDGET)  # one second from the end
    assert clock.progress.at(steps) == 1.0 and mntp.mask_rate(shares[steps], START, END) == END  # the next batch's
    # over trainer.max_steps, as before, the rate would not have moved from the start
    assert mntp.mask_rate((steps - 1) / 100_000, START, END) > START - 1e-4


@pytest.mark.usefixtures("one_thread")
def test_the_step_the_budget_ends_writes_its_own_metrics(whole):
    """The budget runs out on step 12, not a logging step (every 5th): Lightning still writes it,
    and what it writes is that step's learning rate, perplexity and per-task values, not those
    kept from step 10 (objective_base.write_step_metrics, from on_before_optimizer_step)."""
    _, clock = whole
    with open(next(clock.run_dir.glob("csv/version_*/metrics.csv"))) as file:
        rows = [row for row in csv.DictReader(file) if row.get("train/loss")]
    assert [int(row["step"]) for row in rows] == [4, 9, 11]
    names = [
        "train/lr",
        "train/ppl",
        "train/clm/loss",
        "train/mntp/loss",
        "train/mntp/accuracy",
        "train/clm/step_share",
    ]
    for name in names:
        assert all(row[name] for row in rows), name
    # fresh values: the learning rate falls with the clock; the losses change every step
    for name in ("train/lr", "train/ppl", "train/clm/loss", "train/mntp/loss"):
        assert float(rows[-1][name]) != float(rows[-2][name]), name


@pytest.mark.usefixtures("one_thread", "private_cache")
def test_a_resumed_budget_masks_on_from_where_it_stopped(whole, tmp_path, monkeypatch):
    """Stopped half way through the budget and resumed: the first batches after the resume are
    masked at the middle of the schedule (its checkpoint's train_seconds), not at the start rate,
    and every step's share is the uninterrupted run's."""
    expected, _ = whole
    half = int(BUDGET) // 2
    first, _ = hybrid(tmp_path / "parts", monkeypatch, stop=half)
    second, clock = hybrid(tmp_path / "parts", monkeypatch, "resume=auto")
    assert clock.steps == BUDGET
    assert first[:half] == expected[:half]
    assert second[0] == 0.5 and mntp.mask_rate(second[0], START, END) == pytest.approx((START + END) / 2)
    assert second[: half + 1] == pytest.approx(expected[half:], abs=1e-12)
