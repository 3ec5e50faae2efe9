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
from lightning.pytorch.strategies import ModelParallelStrategy

from .checkpointing import AtomicCheckpointIO
from .config import RecipeError, RunConfig, to_dict
from .objectives.base import gathered_parameters

WANDB_ID_FILE = "wandb_id.txt"
CHECKPOINT_DIR = "checkpoints"
CSV_DIR = "csv"
SAMPLES_FILE = "samples.jsonl"


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


class FSDP2Strategy(ModelParallelStrategy):
    """ModelParallelStrategy as pure FSDP2: data_parallel_size = world size and
    tensor_parallel_size = 1, fixed once the launcher knows the world size (its "auto"
    defaults are data_parallel = nodes and tensor_parallel = devices per node, i.e. tensor
    parallelism inside a node, which the objectives do not implement). The device mesh takes
    the root device's type, so on CPU it is a gloo mesh and on GPUs an NCCL one.

    Checkpoints are distributed: a directory holding one shard file per rank and meta.pt."""

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether FSDP2 has sharded the module's parameters (they are DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's whole state dict on CPU. Under FSDP2 every rank must call this (the
    shards are all-gathered); rank 0 receives the tensors, the other ranks an empty dict."""
    if not is_sharded(module):
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def consolidated(module: L.LightningModule, rank: int) -> L.LightningModule | None:
    """The objective with whole (unsharded) CPU weights, for saving the final model. Without
    FSDP this is the module itself. Under FSDP2 every rank must call it (the shards are
    all-gathered); rank 0 gets a fresh copy rebuilt from the module's hyperparameters and
    loaded with the gathered weights, the other ranks None."""
    if not is_sharded(module):
        return module
    state = full_state_dict(module)
    if rank != 0:
        return None
    extra = {"bleu": False} if "task" in module.hparams else {}  # Seq2SeqLM: BLEU needs a detokenizer
    with torch.device("cpu"):
        copy = type(module)(**{**module.hparams, **extra})
    copy.load_state_dict(state)
    return copy


SHARDED_META = "meta.pt"  # what ModelParallelStrategy writes beside the shards (rank 0, last)


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """A distributed (FSDP2) checkpoint: a directory of per-rank shard files plus meta.pt."""
    return Path(path).is_dir() and (Path(path) / SHARDED_META).is_file()


def read_sharded_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A distributed checkpoint as one ordinary Lightning checkpoint dict (meta.pt's contents
    plus a whole `state_dict`), in this process without a process group: every weight is
    read in full from the shards (torch.distributed.checkpoint.load, no_dist=True) into a
    tensor allocated from the checkpoint's metadata. Optimizer states are not read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    checkpoint = torch.load(path / SHARDED_META, map_location="cpu", weights_only=True)
    entries = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = "state_dict."  # Lightning saves {"state_dict": ..., "optimizer_0": ...}
    weights = {key[len(prefix):]: torch.empty(meta.size, dtype=meta.properties.dtype)
               for key, meta in entries.items()
               if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    dcp.load({"state_dict": weights}, checkpoint_id=str(path), no_dist=True)
    checkpoint["state_dict"] = weights
    return checkpoint


def materialize(module: torch.nn.Module, device: torch.device) -> None:
    """Allocate and initialise a module built on the meta device after FSDP2 sharded it: each
    rank allocates only its shards (`to_empty`), and `init_weights` then draws every weight
    in full, one tensor at a time on the CPU, keeping this rank's rows. The draws come from
    the global generator in the order an unsharded `init_weights` takes them, so the sharded
    model starts from exactly the weights a one-process run starts from, at a peak of one
    whole tensor beyond the shards. (DTensor's own random ops would draw each shard locally on
    CPU meshes; torch.distributed.tensor._random supports only CUDA-like devices.)"""
    from .model.init import init_weights
    from .model.language_model import LanguageModel

    if not any(p.is_meta for p in module.parameters()):
        return
    module.to_empty(device=device)
    for sub in module.modules():
        if isinstance(sub, LanguageModel):
            sub.tie_weights()  # to_empty allocates a tied weight once per name
            state = getattr(sub, "init_rng_state", None)  # set by the runner when it built the model
            with torch.random.fork_rng(devices=[]), _WholeTensorDraws():
                if state is not None:
                    torch.set_rng_state(state)
                init_weights(sub, sub.config)
    left = [name for name, p in module.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"meta-device parameters left without initialisation: {left[:3]}")


class _WholeTensorDraws(torch.overrides.TorchFunctionMode):
    """Inside: `normal_` on a sharded DTensor draws the whole tensor from the global
    generator on the CPU and copies this rank's dim-0 chunk into the local shard (FSDP2
    shards dim 0 as torch.chunk does)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor, Shard

        kwargs = dict(kwargs or {})
        # nn.init.normal_ dispatches itself (keyword arguments) while a mode is active
        if func not in (torch.Tensor.normal_, torch.nn.init.normal_):
            return func(*args, **kwargs)
        target = args[0] if args else kwargs.pop("tensor")
        if not isinstance(target, DTensor):
            return func(target, *args[1:], **kwargs)
        (placement,) = target.placements
        whole = torch.empty(target.shape, dtype=target.dtype)
        func(whole, *args[1:], **kwargs)  # the draws of an unsharded init
        local = target.to_local()
        if isinstance(placement, Shard):
            mesh = target.device_mesh
            pieces = torch.chunk(whole, mesh.size(), dim=placement.dim)
            rank = mesh.get_local_rank()
            whole = pieces[rank] if rank < len(pieces) else whole[:0]
        if whole.shape != local.shape:
            raise RuntimeError(f"shard shape {tuple(local.shape)} is not torch.chunk's {tuple(whole.shape)}")
        with torch.no_grad():
            local.copy_(whole)
        return target


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
        # flushed at every logging step (not every 100): rows up to a kill -9 survive for resume
        loggers.append(CSVLogger(save_dir=str(run_dir), name=CSV_DIR, flush_logs_every_n_steps=1))
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
            from .checkpointing import newest_complete
            from .rundir import RunError

            last = newest_complete(self.checkpoint_dir)
            kept = f"the newest checkpoint, {last}, holds the last good weights" if last else "no checkpoint was written"
            raise RunError(
                f"training stopped at step {trainer.global_step}: {self._run} steps in a row had a non-finite loss "
                f"or gradient (trainer.nonfinite_patience={self.patience}); {kept}; lower optim.lr, or use bf16 "
                "instead of fp16, then resume=auto")


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
        NonFiniteGuard(cfg.trainer.nonfinite_patience, run_dir / CHECKPOINT_DIR),
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
        plugins=[AtomicCheckpointIO()],  # temp file + fsync + rename; weights_only loading
    )
