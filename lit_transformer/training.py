"""Trainer factories: strategy, precision, callbacks and loggers. Everything distributed lives
here (never in model/ or objectives/): the LightningModule stays the same on one CPU or many GPUs.
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

from .config import RecipeError, RunConfig, to_dict

WANDB_ID_FILE = "wandb_id.txt"
CHECKPOINT_DIR = "checkpoints"
CSV_DIR = "csv"
SAMPLES_FILE = "samples.jsonl"


# ----------------------------------------------------------------------------- strategy


def build_strategy(cfg: RunConfig) -> Any:
    """Lightning strategy for trainer.strategy. ddp uses gloo on CPU and NCCL on GPUs (Lightning's
    choice); fsdp needs CUDA: Lightning's FSDPStrategy refuses CPU accelerators."""
    name = cfg.trainer.strategy
    if name == "auto":
        return "auto"
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()
    if not torch.cuda.is_available():
        raise RecipeError(
            "trainer.strategy=fsdp needs CUDA GPUs (Lightning's FSDPStrategy does not run on CPU); "
            "use trainer.strategy=ddp or auto on this machine"
        )
    from lightning.pytorch.strategies import FSDPStrategy

    from .model.transformer import Block

    return FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy=(
        {Block} if cfg.trainer.activation_checkpointing else None))


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


def is_main_process() -> bool:
    """False in the extra processes a multi-device launch starts (LOCAL_RANK / NODE_RANK > 0)."""
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


def wandb_run_id(run_dir: Path, resume: bool) -> str:
    """The W&B run id kept in the run directory: a resumed run continues the same W&B run.
    Only the main process chooses one (the others never open the W&B run)."""
    path = run_dir / WANDB_ID_FILE
    if (resume or not is_main_process()) and path.is_file():
        return path.read_text().strip()
    run_id = secrets.token_hex(4)  # W&B ids are short [a-z0-9] strings; secrets leaves the global RNG alone
    path.write_text(run_id + "\n")
    return run_id


def build_loggers(cfg: RunConfig, run_dir: Path, resume: bool = False) -> list[Logger]:
    """A CSV log (always; a resumed run writes the next csv/version_N) and W&B unless disabled."""
    loggers: list[Logger] = []
    if cfg.logger.csv:
        loggers.append(CSVLogger(save_dir=str(run_dir), name=CSV_DIR))
    mode = wandb_mode(cfg.logger.wandb.mode)
    if mode is not None:
        w = cfg.logger.wandb
        logger = WandbLogger(
            project=w.project, name=w.name or run_dir.resolve().name, entity=w.entity, tags=list(w.tags),
            save_dir=str(run_dir), id=wandb_run_id(run_dir, resume), resume="allow", mode=mode,
            config=to_dict(cfg),
        )
        loggers.append(logger)
    return loggers


def finish_wandb() -> None:
    """Close the W&B run so the next run in this process starts its own (WandbLogger would reuse it)."""
    import sys

    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, float]]:
    """Every CSV row of a run, all versions (a resumed run appends a version) in order; empty
    cells dropped. Rows of a later version replace rows of the same step from an earlier one."""
    import csv

    rows: list[dict[str, float]] = []
    versions = sorted(Path(run_dir, CSV_DIR).glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    for version in versions:
        path = version / "metrics.csv"
        if not path.is_file():
            continue
        with path.open(newline="") as file:
            new = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(file)]
        first = min((r["step"] for r in new if "step" in r), default=None)
        if first is not None:
            rows = [r for r in rows if r.get("step", -1) < first]
        rows.extend(new)
    return rows


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
        from .data.collate import batch_generator

        step_seed = batch_generator(self.seed, trainer.global_rank, trainer.fit_loop.total_batch_idx).initial_seed()
        torch.manual_seed(step_seed)  # seeds every CUDA device too


class ProgressBar(RichProgressBar):
    """Rich progress bar showing the training loss and tokens/s (the objectives log both with
    prog_bar=True) without Lightning's version number."""

    def _get_train_description(self, current_epoch: int) -> str:
        return f"epoch {current_epoch}"  # runs are counted in steps: max_epochs is -1

    def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        speed = trainer.callback_metrics.get("train/tokens_per_s")
        if speed is not None:
            items["tokens/s"] = f"{float(speed):,.0f}"
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
        if trainer.sanity_checking or not trainer.is_global_zero or trainer.state.fn != "fit":
            return
        pairs = self.sample(pl_module)
        step = trainer.global_step
        with (self.run_dir / SAMPLES_FILE).open("a") as file:
            file.write(json.dumps({"step": step, "samples": [{"prompt": p, "completion": c} for p, c in pairs]}) + "\n")
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_table(key="samples", columns=["step", "prompt", "completion"],
                                 data=[[step, p, c] for p, c in pairs], step=step)


# ----------------------------------------------------------------------------- trainer


def build_callbacks(cfg: RunConfig, run_dir: Path, extra: Sequence[Callback] = (),
                    progress_bar: bool = True) -> list[Callback]:
    callbacks: list[Callback] = [
        StepCheckpoint(
            dirpath=str(run_dir / CHECKPOINT_DIR), filename="step-{step}", auto_insert_metric_name=False,
            every_n_train_steps=cfg.trainer.checkpoint_every_n_steps, save_top_k=1, save_last=True,
            save_on_train_epoch_end=False,
        ),
        StepSeed(cfg.trainer.seed),
    ]
    if progress_bar:
        callbacks.append(ProgressBar())
    return callbacks + list(extra)


def build_trainer(cfg: RunConfig, run_dir: Path, *, resume: bool = False, callbacks: Sequence[Callback] = (),
                  progress_bar: bool = True) -> L.Trainer:
    """The Lightning Trainer a recipe describes. Validation runs every trainer.val_check_interval
    optimizer steps across epoch boundaries (check_val_every_n_epoch=None)."""
    t = cfg.trainer
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
    )
