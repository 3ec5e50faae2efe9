"""The recipe's `eval` section during training: every named evaluation on the initial weights,
at each validation that is due (`every_n_steps`) and once more on the final weights, logged as `eval/<name>/<metric>`
to every logger (W&B, CSV) and returned for metrics.json.

Under DDP and FSDP every rank runs every evaluation on the same data, inside
`gathered_parameters` (FSDP2's shards gathered, so the forward passes need no collectives and
ranks may decode different numbers of steps without deadlocking), and then takes rank 0's
numbers. Running everywhere rather than on rank 0 alone keeps the objectives' metrics, which
synchronise across ranks when they compute, from waiting on ranks that do not; the wall-clock
cost is the same, since rank 0 would otherwise run the same work while the others wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lit_transformer.evaluation.eval_target import EvalTarget, Evaluation
from lit_transformer.evaluation.suite import run_suite
from lit_transformer.recipe.schema import RunConfig
from lit_transformer.recipe.tasks import trains_bidirectional_mode
from lit_transformer.training.distributed import eager_outside_the_step, gathered_parameters


def eval_target(module: Any, cfg: RunConfig, tokenizer: Any, special: Any) -> EvalTarget:
    """The target for an objective module of a run with config cfg (in training and in `evaluate`)."""
    # a classifier holds a backbone, not a language model: its final model wraps a copy of it
    model = module.model if hasattr(module, "model") else module.final_model()
    decoder = model.config.arch == "decoder"
    return EvalTarget(
        model=model,
        tokenizer=tokenizer,
        special=special,
        cfg=cfg,
        module=module,
        bidirectional=decoder and trains_bidirectional_mode(cfg),
        prefix_lm=decoder and any(t.objective == "prefix_lm" for t in cfg.tasks),
        autocast_dtype=torch.bfloat16 if cfg.trainer.precision == "bf16-mixed" else None,
    )


class NamedEvaluations(Callback):
    """Runs `evaluations` after each validation in fit, and `finish` runs what the last one left
    out. commands/train.py builds the evaluations before training starts, so a bad entry or a missing
    file fails before the first step."""

    def __init__(self, evaluations: Sequence[Evaluation], cfg: RunConfig, tokenizer: Any, special: Any):
        self.evaluations = list(evaluations)
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.special = special
        self.done_at: dict[str, int] = {}  # entry name -> the step it last ran at
        self.latest: dict[str, float] = {}  # every metric's newest value

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """At step 0 of a new run (not a resumed one): the initial weights' numbers, the baseline
        that shows what pretraining bought (a probe on random features is well above chance)."""
        if trainer.global_step == 0:
            self._run(trainer, pl_module, final=False)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self._run(trainer, pl_module, final=False)

    def finish(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        """Every evaluation on the final weights that has not already run at this step; returns
        the final value of every evaluation (for metrics.json)."""
        self._run(trainer, pl_module, final=True)
        return dict(self.latest)

    def _run(self, trainer: L.Trainer, pl_module: L.LightningModule, *, final: bool) -> None:
        step = trainer.global_step
        pending = [e for e in self.evaluations if self.done_at.get(e.entry.name) != step]
        if not pending:
            return
        target = eval_target(pl_module, self.cfg, self.tokenizer, self.special)
        with gathered_parameters(pl_module), eager_outside_the_step(pl_module):
            metrics = run_suite(pending, target, step=step, final=final)
        metrics = trainer.strategy.broadcast(metrics, src=0)  # every rank holds rank 0's numbers
        ran = {key.split("/")[1] for key in metrics}
        for evaluation in pending:
            if evaluation.entry.name in ran:
                self.done_at[evaluation.entry.name] = step
        if not metrics:
            return
        self.latest = {**self.latest, **metrics}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
