"""The share of the run done that the data schedules follow (data/batches/progress.py): over
trainer.max_steps as before time budgets, over trainer.max_time from the training clock's marks
where a budget is set, and read by the mixture samplers when they draw each key."""

import pytest
from helpers import RECIPES

from lit_transformer.data.batches.mixture_sampling import MixtureBatchSampler
from lit_transformer.data.batches.mntp import mask_rate
from lit_transformer.data.batches.progress import ScheduleProgress
from lit_transformer.data.batches.row_mixing import RowMixtureBatchSampler
from lit_transformer.data.batches.sampler import ResumableBatchSampler
from lit_transformer.data.modules.builder import build_data_module
from lit_transformer.errors import DataError
from lit_transformer.recipe.load import load_recipe
from lit_transformer.recipe.tasks import data_plan


def step_mask_rate(step, start, end, steps):
    """mask_rate as it was before time budgets (a verbatim copy): a function of the optimizer step."""
    if step is None or not steps:
        return end
    return start + (end - start) * min(max(step, 0) / steps, 1.0)


@pytest.mark.parametrize("max_steps", [1, 7, 300, None])
def test_without_a_time_budget_the_rate_is_the_step_schedule_bit_for_bit(max_steps):
    progress = ScheduleProgress(max_steps=max_steps)
    for step in range(0, 400, 3):
        got = mask_rate(progress.at(step), 0.3, 0.15)
        assert got == step_mask_rate(step, 0.3, 0.15, max_steps), step  # the same float
    progress.mark(40, 1e9)  # a clock's marks change nothing without max_time
    assert mask_rate(progress.at(5), 0.3, 0.15) == step_mask_rate(5, 0.3, 0.15, max_steps)
    assert ScheduleProgress().at(10) is None and ScheduleProgress(max_steps=0).at(10) is None


def test_under_max_time_the_share_is_the_clocks_seconds_over_the_budget():
    """max_time wins over max_steps (as lr_multiplier's decay); the seconds at a step are the
    last mark carried on at the pace so far (a batch is drawn before its step's mark)."""
    progress = ScheduleProgress(max_steps=100_000, max_time=60.0)
    assert progress.at(0) == progress.at(5) == 0.0  # no mark yet: nothing spent
    progress.mark(10, 30.0)  # 3 s a step
    assert progress.at(10) == 0.5  # the mark the learning rate reads at step 10
    assert progress.at(12) == pytest.approx(36.0 / 60.0)  # two steps ahead, at 3 s a step
    assert progress.at(20) == progress.at(10_000) == 1.0  # capped: the budget is spent
    assert mask_rate(progress.at(10), 0.3, 0.15) == pytest.approx(0.225)
    assert mask_rate(progress.at(20), 0.3, 0.15) == 0.15


def test_a_resumed_run_goes_on_from_its_saved_seconds():
    progress = ScheduleProgress(max_steps=100_000, max_time=40.0)
    progress.mark(50, 20.0)  # the checkpoint's global_step and train_seconds
    assert progress.at(50) == 0.5 and progress.at(55) == pytest.approx(22.0 / 40.0)
    assert mask_rate(progress.at(50), 0.3, 0.15) == pytest.approx(0.225)  # the midpoint, not the start rate


def test_a_bad_budget_is_a_one_line_error_naming_the_key():
    with pytest.raises(DataError, match=r"^trainer\.max_time=0 must be positive or null$"):
        ScheduleProgress(max_time=0)


def test_the_samplers_read_the_progress_when_they_draw_each_key():
    progress = ScheduleProgress(max_steps=1000, max_time=10.0)
    tasks = [ResumableBatchSampler(n, 2, seed=t) for t, n in enumerate((40, 30))]
    keys = iter(MixtureBatchSampler(tasks, [0.5, 0.5], accumulate=2, progress=progress))
    assert [next(keys)[2] for _ in range(4)] == [0.0] * 4  # steps 0 and 1, before any mark
    progress.mark(2, 4.0)  # 2 s a step
    assert [next(keys)[2] for _ in range(4)] == pytest.approx([0.4, 0.4, 0.6, 0.6])  # steps 2 and 3
    progress.mark(4, 10.0)  # the budget spent
    assert next(keys)[2] == 1.0  # step 4
    rows = [ResumableBatchSampler(n, 1, seed=t) for t, n in enumerate((40, 30))]
    row_keys = iter(RowMixtureBatchSampler(rows, [0.5, 0.5], batch_size=4, progress=progress))
    assert [next(row_keys)[1] for _ in range(3)] == pytest.approx([0.0, 0.25, 0.5])  # 2.5 s a step
    unscheduled = MixtureBatchSampler(tasks, [0.5, 0.5])  # no progress: the collators read the end rate
    assert next(iter(unscheduled))[2] is None


@pytest.mark.parametrize("budget, share", [(None, 0.5), (300.0, 0.25)])
def test_the_recipes_budget_reaches_the_mixtures_progress(budget, share):
    """trainer.max_time and max_steps, recipe -> DataPlan -> MixtureDataModule; built, not prepared."""
    plan = data_plan(
        load_recipe(RECIPES / "tiny-gptbert.yaml", ["trainer.max_steps=40", f"trainer.max_time={budget or 'null'}"])
    )
    assert (plan.mixture.max_steps, plan.mixture.max_time) == (40, budget)
    progress = build_data_module(plan).schedule_progress
    progress.mark(20, 75.0)
    assert progress.at(20) == share  # 20 of 40 steps, or 75 of 300 seconds
