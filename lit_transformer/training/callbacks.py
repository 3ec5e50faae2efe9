"""The callbacks a run's Trainer carries: step checkpoints, per-step seeds, the non-finite guard,
the wall-clock budget, the progress bar, sample generations, the freed-memory policy and the
weights' moving average.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, EMAWeightAveraging, ModelCheckpoint, RichProgressBar

from lit_transformer.data.batches.collate import batch_generator
from lit_transformer.errors import RunError
from lit_transformer.training.checkpoints import newest_complete


class StepCheckpoint(ModelCheckpoint):
    """Every N optimizer steps and once more at the end of training (ModelCheckpoint alone
    skips the end when `last.ckpt` was already written at an earlier step)."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._last_global_step_saved != trainer.global_step and not trainer.sanity_checking:
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        super().on_train_end(trainer, pl_module)


class StepSeed(Callback):
    """Reseeds torch's global generator before every training batch from (seed, rank, batch
    number), so dropout draws depend on nothing else: a resumed run draws exactly what the
    uninterrupted run drew, although building dataloader iterators (and validation) takes
    numbers from the global generator a different number of times in the two runs. The data
    module's collators use their own per-batch generators, and its state_dict the data position."""

    def __init__(self, seed: int):
        self.seed = seed

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step_seed = batch_generator(self.seed, trainer.global_rank, trainer.fit_loop.total_batch_idx).initial_seed()
        torch.manual_seed(step_seed)  # seeds every CUDA device too


class NonFiniteGuard(Callback):
    """Stops training when `patience` optimizer steps in a row were skipped for a non-finite
    loss or gradient (the count the objective declares and keeps, ObjectiveBase.skipped_steps;
    skipped steps leave the weights alone). Raises a RunError before the step's checkpoint is
    written (Lightning runs checkpoint callbacks last), so the newest checkpoint holds the last
    good weights."""

    def __init__(self, patience: int, checkpoint_dir: Path):
        self.patience, self.checkpoint_dir = patience, checkpoint_dir
        self._seen = 0  # the objective's counter at the previous batch end
        self._run = 0  # consecutive skipped steps so far

    def on_train_start(self, trainer, pl_module) -> None:
        self._seen, self._run = pl_module.skipped_steps, 0  # restored by a resume

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        skipped = pl_module.skipped_steps
        self._run = self._run + (skipped - self._seen) if skipped > self._seen else 0
        self._seen = skipped
        if self._run >= self.patience:
            last = newest_complete(self.checkpoint_dir)
            kept = (
                f"the newest checkpoint, {last}, holds the last good weights" if last else "no checkpoint was written"
            )
            raise RunError(
                f"training stopped at step {trainer.global_step}: {self._run} steps in a row had a non-finite loss "
                f"or gradient (trainer.nonfinite_patience={self.patience}); {kept}; lower optim.lr, or use bf16 "
                "instead of fp16, then resume=auto"
            )


class TimeBudget(Callback):
    """trainer.max_time: stops training once `max_time` seconds of training are spent; the run
    then finishes as at max_steps (final validation, final model, metrics.json).

    What counts is the objective's `train_clock`, which this callback runs: from the start of
    the first training batch (not the start-up before it: tokenizer, packing, building the model,
    the first batch's loading), through every training step, its data loading, logging and
    checkpoint writing, and not through validation (stopped from on_validation_start to the next
    training batch). Lightning's own max_time counts from fit's start and through validation,
    so the steps it leaves depend on those. Once per optimizer step, before the update, the
    clock is marked (with the largest reading of all ranks, so that every rank schedules the
    same learning rate and stops at the same step): the learning-rate schedule reads that mark,
    and the step that marks the budget spent is the last. A resumed run goes on from the time
    its checkpoint saved.

    The data module's schedules read the same marks (`schedule_progress`, data/batches/progress.py:
    mntp's mask rate): each mark is passed on, and a resumed run's saved seconds as its
    checkpoint is loaded, before the first training batch is drawn (Lightning draws it before
    on_train_start), so the schedule goes on where it stopped instead of starting again."""

    def __init__(self, max_time: float):
        self.max_time = max_time
        self.spent = False  # whether the budget ran out (the run is then finished, not interrupted)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._pass_on(trainer, int(checkpoint.get("global_step", 0)), float(checkpoint.get("train_seconds", 0.0)))

    def on_train_start(self, trainer, pl_module) -> None:
        self._pass_on(trainer, trainer.global_step, pl_module.train_clock.elapsed)
        if pl_module.train_clock.elapsed >= self.max_time:  # resuming a run that spent its budget
            self.spent = trainer.should_stop = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        pl_module.train_clock.start()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        seconds = pl_module.train_clock.read()
        if trainer.world_size > 1:
            reading = torch.tensor(seconds, dtype=torch.float64, device=pl_module.device)
            seconds = float(trainer.strategy.reduce(reading, reduce_op="max"))
        if pl_module.train_clock.mark(seconds) >= self.max_time:
            self.spent = trainer.should_stop = True  # this step still runs; the loop ends after it
        self._pass_on(trainer, trainer.global_step + 1, seconds)  # the clock after this step's batches

    @staticmethod
    def _pass_on(trainer, steps: int, seconds: float) -> None:
        """`seconds` of training over the first `steps` optimizer steps, to the data schedules."""
        progress = getattr(trainer.datamodule, "schedule_progress", None)  # a mixture's; None elsewhere
        if progress is not None:
            progress.mark(steps, seconds)

    def on_validation_start(self, trainer, pl_module) -> None:
        pl_module.train_clock.stop()

    def on_train_end(self, trainer, pl_module) -> None:
        pl_module.train_clock.stop()


def time_budget_spent(trainer: L.Trainer) -> bool:
    """Whether the run stopped because trainer.max_time ran out (TimeBudget)."""
    return any(isinstance(c, TimeBudget) and c.spent for c in trainer.callbacks)


class ProgressBar(RichProgressBar):
    """Rich progress bar counting optimizer steps toward trainer.max_steps across epochs (a
    resumed run starts at its step), with elapsed and remaining time, the training loss and
    tokens/s (the objectives log both with prog_bar=True), and no Lightning version number.
    With a time budget the bar still counts steps (max_steps is its upper bound) and the
    metrics show the seconds of training spent out of trainer.max_time."""

    def __init__(self, max_time: float | None = None):
        # stderr, beside the other notes: stdout carries the command's result (pretrain's metrics JSON)
        super().__init__(console_kwargs={"stderr": True})
        self.max_time = max_time

    @property
    def total_train_batches(self) -> int:
        return self.trainer.max_steps

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self.is_disabled or self.progress is None:
            return
        if self.train_progress_bar_id is None:  # once per run, not per epoch: the bar counts steps
            self.train_progress_bar_id = self._add_task(trainer.max_steps, "training")
        self._update(self.train_progress_bar_id, trainer.global_step)

    def _initialize_train_progress_bar_id(self) -> None:
        self.train_progress_bar_id = self._add_task(self.trainer.max_steps, "training")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()

    def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        speed = trainer.callback_metrics.get("train/tokens_per_s")
        if speed is not None:
            items["tokens/s"] = f"{float(speed):,.0f}"
        clock = getattr(pl_module, "train_clock", None)
        if self.max_time is not None and clock is not None:
            items["budget"] = f"{clock.read():,.0f}/{self.max_time:,.0f} s"
        return items


class KeepFreedMemory(Callback):
    """trainer.keep_freed_memory: during fit, glibc's malloc keeps the memory a step frees for
    the next step (keep_freed_memory below); its defaults are back after fit, or an error."""

    def on_fit_start(self, trainer, pl_module) -> None:
        keep_freed_memory(True)

    def on_fit_end(self, trainer, pl_module) -> None:
        keep_freed_memory(False)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        keep_freed_memory(False)


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters (<malloc.h>)
DEFAULT_TRIM_THRESHOLD, DEFAULT_MMAP_MAX = 128 * 1024, 65536  # glibc's own values (mallopt(3))


def keep_freed_memory(keep: bool) -> bool:
    """Process-wide, glibc only (returns whether it applied). keep: every allocation comes from
    malloc's heap (no mmap) and freed memory is not returned to the OS below 2 GB at the heap's
    top. By default glibc maps each block over 32 MB afresh and unmaps it when freed, so each
    training step page-faults its large tensors (activations, logits, gradients) in again,
    zero-filled by the kernel; kept, most of those page faults are gone. Costs: the process's
    resident memory stays near its peak, plus fragmentation (the figures: docs/defaults.md,
    "trainer.keep_freed_memory"). not keep: glibc's default limits again, and what
    was kept is given back (malloc_trim); glibc's sliding mmap threshold stays where it was, as any
    mallopt call fixes it."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
    except (AttributeError, ValueError, OSError):  # not glibc (macOS, Windows, musl)
        return False
    import ctypes

    libc = ctypes.CDLL(None)
    if keep:
        return bool(libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    done = bool(libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX) and libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD))
    libc.malloc_trim(0)
    return done


class WeightsEMA(EMAWeightAveraging):
    """trainer.ema_decay: Lightning's exponential moving average of the weights, updated after
    every optimizer step (ema = d ema + (1 - d) w), put in place for every validation and the
    named evaluations that follow it, and copied into the model when training ends, so that the
    final validation, evaluations and model.safetensors are the average's. A checkpoint's
    `state_dict` holds the average (what `evaluate` and `export` read) and `current_model_state`
    the trained weights, which a resume continues from.

    It must come last among the callbacks: the named evaluations run in their on_validation_end,
    before this one puts the trained weights back in its own."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        # Lightning warns that configure_model may shard layers; the objectives only shard under
        # FSDP, which trainer.ema_decay refuses (recipe/schema.py)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*overrides the configure_model")
            super().setup(trainer, pl_module, stage)

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        pass  # swapped over the whole validation instead (on_validation_start / _end)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        pass

    def on_validation_start(self, trainer, pl_module) -> None:
        if self._average_model is not None:
            self._swap_models(pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._average_model is not None:
            self._swap_models(pl_module)
