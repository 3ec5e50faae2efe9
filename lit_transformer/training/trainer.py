"""Trainer factories: strategy, precision, callbacks and loggers. What is specific to DDP and
FSDP2 lives in distributed.py; checkpoint formats in checkpoints.py; the run directory's
layout in rundir.py.
"""

from __future__ import annotations

import netrc
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger

from lit_transformer.recipe.load import to_dict
from lit_transformer.recipe.schema import RunConfig, TrainerConfig
from lit_transformer.training.callbacks import (
    KeepFreedMemory,
    NonFiniteGuard,
    ProgressBar,
    StepCheckpoint,
    StepSeed,
    TimeBudget,
    WeightsEMA,
)
from lit_transformer.training.checkpoints import AtomicCheckpointIO
from lit_transformer.training.distributed import FSDP2Strategy, is_main_process
from lit_transformer.training.float8 import Float8Training
from lit_transformer.training.rundir import CHECKPOINT_DIR, CSV_DIR, WANDB_DIR, WANDB_ID_FILE

# ----------------------------------------------------------------------------- strategy


def build_strategy(t: TrainerConfig) -> Any:
    """Lightning strategy for trainer.strategy.

    ddp: DDPStrategy (gloo on CPU, NCCL on GPUs: Lightning's choice). fsdp: FSDP2 through
    Lightning's ModelParallelStrategy, with every process in one data-parallel mesh dimension
    (`FSDP2Strategy`); the objective's `configure_model` applies `fully_shard` per Block and
    per top-level module. Both run on CPU (gloo) as well as on GPUs."""
    name = t.strategy
    if name == "auto":
        return "auto"
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()
    return FSDP2Strategy()


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
        # stderr: stdout carries the command's result (pretrain's final metrics JSON)
        print(
            "W&B: no API key (WANDB_API_KEY or ~/.netrc): logging offline; sync later with `wandb sync`",
            file=sys.stderr,
        )
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
    # litdata's streaming dataset has a length on purpose (a rank's batches per epoch, for the
    # progress bar and the epoch's end); Lightning warns about any IterableDataset that has one
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")


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
            project=w.project,
            name=w.name or run_dir.resolve().name,
            entity=w.entity,
            tags=list(w.tags),
            save_dir=str(run_dir),
            id=wandb_run_id(run_dir, resume),
            resume="allow",
            mode=mode,
            # W&B's own chatter off (banner, run summary, sync hints; docs/wandb.md says where the
            # offline files are and how to sync): a failing run's one-line error stays the only line
            config=to_dict(cfg),
            settings=wandb.Settings(silent=True),
        )
        # Lightning passes anonymous=None, which this wandb warns about on every run
        logger._wandb_init.pop("anonymous", None)
        loggers.append(logger)
    return loggers


def finish_wandb(run_dir: Path | None = None) -> None:
    """Close the W&B run so the next run in this process starts its own (WandbLogger would
    reuse it), wait until its offline log is whole, then join the run's offline folders into one
    (a resumed run writes another)."""
    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()
    id_file = run_dir / WANDB_ID_FILE if run_dir is not None else None
    if id_file is not None and id_file.is_file() and is_main_process():
        from lit_transformer.training.wandb_offline import fold_segments, wait_until_written

        try:
            run_id = id_file.read_text().strip()
            wait_until_written(run_dir / WANDB_DIR, run_id)  # the run's log whole when train() returns
            fold_segments(run_dir / WANDB_DIR, run_id)
        except Exception as error:  # a damaged log of a killed segment must not fail a finished run
            print(
                f"W&B: could not join the offline folders of {run_dir / WANDB_DIR} ({error}); `wandb sync` each folder",
                file=sys.stderr,
            )


# ----------------------------------------------------------------------------- trainer


def keep_checkpoints(t: TrainerConfig) -> int:
    """step-N checkpoints a run keeps: trainer.keep_checkpoints, and what averaging needs."""
    return max(t.keep_checkpoints, t.average_last or 1)


def build_callbacks(
    t: TrainerConfig, run_dir: Path, extra: Sequence[Callback] = (), progress_bar: bool = True
) -> list[Callback]:
    callbacks: list[Callback] = [
        StepCheckpoint(
            dirpath=str(run_dir / CHECKPOINT_DIR),
            filename="step-{step}",
            auto_insert_metric_name=False,
            every_n_train_steps=t.checkpoint_every_n_steps,
            save_last=True,
            save_on_train_epoch_end=False,
            # the newest k step-N checkpoints ("step" ranks them; k > 1 needs a monitored value)
            save_top_k=keep_checkpoints(t),
            monitor="step" if keep_checkpoints(t) > 1 else None,
            mode="max",
        ),
        StepSeed(t.seed),
        NonFiniteGuard(t.nonfinite_patience, run_dir / CHECKPOINT_DIR),
    ]
    if t.max_time is not None:
        callbacks.append(TimeBudget(t.max_time))
    if progress_bar:
        callbacks.append(ProgressBar(t.max_time))
    if t.keep_freed_memory:
        callbacks.append(KeepFreedMemory())
    if t.float8:
        callbacks.append(Float8Training())
    callbacks += list(extra)
    if t.ema_decay is not None:  # last: see WeightsEMA
        callbacks.append(WeightsEMA(decay=t.ema_decay))
    return callbacks


def build_trainer(
    cfg: RunConfig,
    run_dir: Path,
    *,
    resume: bool = False,
    callbacks: Sequence[Callback] = (),
    progress_bar: bool = True,
) -> L.Trainer:
    """The Lightning Trainer a recipe describes. Validation runs every trainer.val_check_interval
    optimizer steps across epoch boundaries (check_val_every_n_epoch=None)."""
    t = cfg.trainer
    quiet_lightning()
    loggers = build_loggers(cfg, run_dir, resume=resume)
    return L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=build_strategy(t),
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
        callbacks=build_callbacks(t, run_dir, callbacks, progress_bar=progress_bar),
        enable_progress_bar=progress_bar,
        enable_model_summary=False,
        default_root_dir=str(run_dir),
        plugins=[AtomicCheckpointIO()],  # temp file + fsync + rename; weights_only loading
    )
