"""Trainer factories: strategy, precision, callbacks and loggers. What is specific to DDP and
FSDP2 lives in distributed.py; checkpoint formats in checkpointing.py; the run directory's
layout in rundir.py.
"""

from __future__ import annotations

import json
import netrc
import os
import secrets
from pathlib import Path
from typing import Any, Callable, Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, RichProgressBar
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger

from .checkpointing import AtomicCheckpointIO, newest_complete
from .config import to_dict
from .data.collate import batch_generator
from .distributed import FSDP2Strategy, gathered_parameters, is_main_process, is_sharded
from .errors import RecipeError, RunError
from .rundir import CHECKPOINT_DIR, CSV_DIR, SAMPLES_FILE, WANDB_DIR, WANDB_ID_FILE
from .schema import RunConfig


# ----------------------------------------------------------------------------- strategy


def build_strategy(cfg: RunConfig) -> Any:
    """Lightning strategy for trainer.strategy.

    ddp: DDPStrategy (gloo on CPU, NCCL on GPUs: Lightning's choice). fsdp: FSDP2 through
    Lightning's ModelParallelStrategy, with every process in one data-parallel mesh dimension
    (`FSDP2Strategy`); the objective's `configure_model` applies `fully_shard` per Block and
    per top-level module. Both run on CPU (gloo) as well as on GPUs."""
    check_precision(cfg)
    name = cfg.trainer.strategy
    if name == "auto":
        return "auto"
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()
    return FSDP2Strategy()


def check_precision(cfg: RunConfig) -> None:
    """16-mixed needs a GPU: on CPU Lightning would autocast to float16, which the CPU kernels
    run slowly and without the loss scaling that keeps fp16 gradients finite."""
    t = cfg.trainer
    on_cpu = t.accelerator == "cpu" or (t.accelerator == "auto" and not torch.cuda.is_available())
    if t.precision == "16-mixed" and on_cpu:
        raise RecipeError("trainer.precision=16-mixed needs CUDA GPUs; on CPU use bf16-mixed, bf16-true or 32-true")


# ----------------------------------------------------------------------------- loggers


def wandb_credentials() -> bool:
    """Whether this machine can log in to W&B: WANDB_API_KEY or a ~/.netrc entry for api.wandb.ai."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def wandb_mode(requested: str) -> str | None:
    """The W&B mode to run with: None when disabled; online only with credentials, since a
    login prompt would hang an unattended run (the offline run syncs later with `wandb sync`)."""
    if requested == "disabled":
        return None
    if requested == "online" and not wandb_credentials():
        print("W&B: no API key (WANDB_API_KEY or ~/.netrc): logging offline; sync later with `wandb sync`")
        return "offline"
    return requested


def wandb_run_id(run_dir: Path, resume: bool) -> str:
    """The W&B run id kept in the run directory: a resumed run continues the same W&B run.
    Only the main process chooses one (the others never open the W&B run)."""
    path = run_dir / WANDB_ID_FILE
    if (resume or not is_main_process()) and path.is_file():
        return path.read_text().strip()
    run_id = secrets.token_hex(4)  # W&B ids are short [a-z0-9] strings; secrets leaves the global RNG alone
    path.write_text(run_id + "\n")
    return run_id


def quiet_lightning() -> None:
    """Lightning's start-up banners (accelerators, AMP, a logging tip) and a deprecation warning
    of its own code off stderr; its warnings stay. Our progress bar shows what matters."""
    import logging
    import warnings

    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")


def build_loggers(cfg: RunConfig, run_dir: Path, resume: bool = False) -> list[Logger]:
    """A CSV log (always; a resumed run writes the next csv/version_N) and W&B unless disabled."""
    loggers: list[Logger] = []
    if cfg.logger.csv:
        # flushed at every logging step (not every 100): rows up to a kill -9 survive for resume
        loggers.append(CSVLogger(save_dir=str(run_dir), name=CSV_DIR, flush_logs_every_n_steps=1))
    mode = wandb_mode(cfg.logger.wandb.mode)
    if mode is not None:
        import wandb

        w = cfg.logger.wandb
        logger = WandbLogger(
            project=w.project, name=w.name or run_dir.resolve().name, entity=w.entity, tags=list(w.tags),
            save_dir=str(run_dir), id=wandb_run_id(run_dir, resume), resume="allow", mode=mode,
            # W&B's own chatter off (banner, run summary, sync hints; the README says where the
            # offline files are and how to sync): a failing run's one-line error stays the only line
            config=to_dict(cfg), settings=wandb.Settings(silent=True),
        )
        # Lightning passes anonymous=None, which this wandb warns about on every run
        logger._wandb_init.pop("anonymous", None)
        loggers.append(logger)
    return loggers


def finish_wandb(run_dir: Path | None = None) -> None:
    """Close the W&B run so the next run in this process starts its own (WandbLogger would
    reuse it), then join the run's offline folders into one (a resumed run writes another)."""
    import sys

    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()
    id_file = run_dir / WANDB_ID_FILE if run_dir is not None else None
    if id_file is not None and id_file.is_file() and is_main_process():
        from .wandb_offline import fold_segments

        try:
            fold_segments(run_dir / WANDB_DIR, id_file.read_text().strip())
        except Exception as error:  # a damaged log of a killed segment must not fail a finished run
            print(f"W&B: could not join the offline folders of {run_dir / WANDB_DIR} ({error}); "
                  "`wandb sync` each folder")


# ----------------------------------------------------------------------------- callbacks


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
    loss or gradient (the objective's `skipped_steps` counter; skipped steps leave the weights
    alone). Raises a RunError before the step's checkpoint is written (Lightning runs
    checkpoint callbacks last), so the newest checkpoint holds the last good weights."""

    def __init__(self, patience: int, checkpoint_dir: Path):
        self.patience, self.checkpoint_dir = patience, checkpoint_dir
        self._seen = 0  # the objective's counter at the previous batch end
        self._run = 0  # consecutive skipped steps so far

    def on_train_start(self, trainer, pl_module) -> None:
        self._seen, self._run = int(getattr(pl_module, "skipped_steps", 0)), 0  # restored by a resume

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        skipped = int(getattr(pl_module, "skipped_steps", 0))
        self._run = self._run + (skipped - self._seen) if skipped > self._seen else 0
        self._seen = skipped
        if self._run >= self.patience:
            last = newest_complete(self.checkpoint_dir)
            kept = f"the newest checkpoint, {last}, holds the last good weights" if last else "no checkpoint was written"
            raise RunError(
                f"training stopped at step {trainer.global_step}: {self._run} steps in a row had a non-finite loss "
                f"or gradient (trainer.nonfinite_patience={self.patience}); {kept}; lower optim.lr, or use bf16 "
                "instead of fp16, then resume=auto")


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
    its checkpoint saved."""

    def __init__(self, max_time: float):
        self.max_time = max_time
        self.spent = False  # whether the budget ran out (the run is then finished, not interrupted)

    def on_train_start(self, trainer, pl_module) -> None:
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
        super().__init__()
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


class SampleGenerations(Callback):
    """After every validation of a generative objective (clm, span, seq2seq), generate from a few
    fixed prompts and log them as a W&B table `samples` (and a JSON line in samples.jsonl).

    `sample` returns (prompt, completion) pairs; the runner builds it from the objective's model,
    tokenizer and validation data, so this file knows nothing about either. It must not draw
    from the global random generator (use greedy decoding or its own torch.Generator)."""

    def __init__(self, sample: Callable[[L.LightningModule], list[tuple[str, str]]], run_dir: Path):
        self.sample = sample
        self.run_dir = run_dir

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        if not trainer.is_global_zero and not is_sharded(pl_module):
            return
        with gathered_parameters(pl_module):  # FSDP2: every rank gathers, rank 0 generates
            pairs = self.sample(pl_module) if trainer.is_global_zero else []
        if not trainer.is_global_zero:
            return
        step = trainer.global_step
        with (self.run_dir / SAMPLES_FILE).open("a") as file:
            file.write(json.dumps({"step": step, "samples": [{"prompt": p, "completion": c} for p, c in pairs]}) + "\n")
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_table(key="samples", columns=["step", "prompt", "completion"],
                                 data=[[step, p, c] for p, c in pairs], step=step)


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
    zero-filled by the kernel: 7.1 million page faults in 400 Tatoeba steps, 0.5 million kept.
    Costs: the process's resident memory stays near its peak, plus fragmentation (tatoeba-
    translation's peak 1.69 -> 2.02 GB, measured). not keep: glibc's default limits again, and what
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


# ----------------------------------------------------------------------------- trainer


def keep_checkpoints(cfg: RunConfig) -> int:
    """step-N checkpoints a run keeps: trainer.keep_checkpoints, and what averaging needs."""
    return max(cfg.trainer.keep_checkpoints, cfg.trainer.average_last or 1)


def build_callbacks(cfg: RunConfig, run_dir: Path, extra: Sequence[Callback] = (),
                    progress_bar: bool = True) -> list[Callback]:
    callbacks: list[Callback] = [
        StepCheckpoint(
            dirpath=str(run_dir / CHECKPOINT_DIR), filename="step-{step}", auto_insert_metric_name=False,
            every_n_train_steps=cfg.trainer.checkpoint_every_n_steps, save_last=True, save_on_train_epoch_end=False,
            # the newest k step-N checkpoints ("step" ranks them; k > 1 needs a monitored value)
            save_top_k=keep_checkpoints(cfg), monitor="step" if keep_checkpoints(cfg) > 1 else None, mode="max",
        ),
        StepSeed(cfg.trainer.seed),
        NonFiniteGuard(cfg.trainer.nonfinite_patience, run_dir / CHECKPOINT_DIR),
    ]
    if cfg.trainer.max_time is not None:
        callbacks.append(TimeBudget(cfg.trainer.max_time))
    if progress_bar:
        callbacks.append(ProgressBar(cfg.trainer.max_time))
    if cfg.trainer.keep_freed_memory:
        callbacks.append(KeepFreedMemory())
    return callbacks + list(extra)


def build_trainer(cfg: RunConfig, run_dir: Path, *, resume: bool = False, callbacks: Sequence[Callback] = (),
                  progress_bar: bool = True) -> L.Trainer:
    """The Lightning Trainer a recipe describes. Validation runs every trainer.val_check_interval
    optimizer steps across epoch boundaries (check_val_every_n_epoch=None)."""
    t = cfg.trainer
    quiet_lightning()
    loggers = build_loggers(cfg, run_dir, resume=resume)
    return L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=build_strategy(cfg),
        precision=t.precision,
        max_steps=t.max_steps,
        max_epochs=-1,
        accumulate_grad_batches=t.accumulate_grad_batches,
        gradient_clip_val=t.gradient_clip_val,
        # Lightning counts val_check_interval in batches, the recipe in optimizer steps
        val_check_interval=t.val_check_interval * t.accumulate_grad_batches,
        check_val_every_n_epoch=None,
        limit_val_batches=t.limit_val_batches if t.limit_val_batches is not None else 1.0,
        log_every_n_steps=t.log_every_n_steps,
        deterministic=t.deterministic,
        num_sanity_val_steps=0,
        logger=loggers or False,
        callbacks=build_callbacks(cfg, run_dir, callbacks, progress_bar=progress_bar),
        enable_progress_bar=progress_bar,
        enable_model_summary=False,
        default_root_dir=str(run_dir),
        plugins=[AtomicCheckpointIO()],  # temp file + fsync + rename; weights_only loading
    )
