"""The work after `trainer.fit`: the final model's metrics, the named evaluations and the test
split, the average of the last checkpoints (trainer.average_last), and the final model saved
in lit-transformer's format. `finish` is the third of pretrain's three steps (build, fit,
finish: commands/train.py).

The module is the objective LightningModule, taken by what it offers (final_model, final_head,
measure_bytes_on, from_hparams): this layer imports no objective.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lit_transformer.recipe.schema import RunConfig
from lit_transformer.recipe.tasks import task_datas
from lit_transformer.training.averaging import last_checkpoints, load_average, record_average, write_average
from lit_transformer.training.callbacks import time_budget_spent
from lit_transformer.training.distributed import is_sharded
from lit_transformer.training.final_model import consolidated, save_final


def names_test_files(cfg: RunConfig) -> bool:
    """Whether the recipe names a test split (data.test_files, or a task's)."""
    return any(data.test_files for data in task_datas(cfg))


def finish(
    cfg: RunConfig,
    trainer,
    module,
    dm,
    run_dir: Path,
    evaluations: Any | None,
    guard: Callable[[], Any],
) -> dict[str, float]:
    """The final model's validation metrics (`val/...`), the evaluations' and the test split's,
    with the final model saved in `run_dir`; an interrupted run only reports what it has.
    `guard()` is the context the data loaders run in (one-line errors for a dead worker)."""
    t = cfg.trainer
    # a run whose trainer.max_time ran out is finished, like one that reached max_steps
    spent = time_budget_spent(trainer)
    interrupted = trainer.interrupted or (trainer.global_step < t.max_steps and not spent)
    average = t.average_last or 1
    # FSDP2 shards cannot take a whole state dict: a sharded run's average is written after
    # save_final (its metrics are then those of the last weights)
    averages = not interrupted and average > 1 and not is_sharded(module)
    averaged = load_average(module, run_dir, average) if averages else []
    # Lightning validates at the step where should_stop was set (a spent time budget) too
    at_end = spent or t.max_steps % t.val_check_interval == 0
    # not so after resuming a finished run
    validated_last = not averaged and at_end and any(k.startswith("val/") for k in trainer.callback_metrics)
    if not interrupted and not validated_last:
        with guard():
            trainer.validate(module, datamodule=dm, verbose=False)  # the final model's metrics
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    if interrupted:
        return metrics
    if evaluations is not None:
        if averaged:  # the averaged weights are new: every evaluation runs on them
            evaluations.done_at.clear()
        metrics.update(evaluations.finish(trainer, module))
    if names_test_files(cfg):
        module.measure_bytes_on(dm, "test")
        with guard():
            trainer.test(module, datamodule=dm, verbose=False)  # the final model's, once
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/")})
    final = consolidated(module, trainer.global_rank)  # FSDP: every rank gathers, rank 0 saves
    if trainer.is_global_zero:
        save_final(final, run_dir, metrics)
        if average > 1 and is_sharded(module):
            write_average(last_checkpoints(run_dir, average), run_dir, run_dir, final)
        elif averaged:
            record_average(averaged, run_dir)
    return metrics
