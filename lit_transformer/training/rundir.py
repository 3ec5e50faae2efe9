"""Run directories: their layout, creating one (or refusing one that holds another run),
finding the checkpoint to resume, and reading the CSV log back.

A finished run directory holds:
  config.yaml            the resolved recipe (load_recipe reads it back)
  tokenizer.json         the trained or loaded tokenizer (labels.json for classification)
  config.json, model.safetensors   the final model, lit-transformer's format (load_pretrained reads
                         it); config.json records the objective under "objective"
  classifier.json, classifier.safetensors   classification runs: the head and its labels
  checkpoints/           Lightning checkpoints (last.ckpt is the newest), for resume
  csv/version_N/metrics.csv, wandb/   logs; wandb_id.txt keeps the W&B run id across resumes
  samples.jsonl, metrics.json       sample generations; the final validation metrics
"""

from __future__ import annotations

import csv
import os
import shutil
import sys
from pathlib import Path

from lit_transformer.errors import RecipeError, RunError, first_line
from lit_transformer.recipe.load import load_recipe, to_dict
from lit_transformer.recipe.schema import RunConfig
from lit_transformer.training.checkpoints import checkpoint_step, newest_complete, read_checkpoint, remove_temp_files
from lit_transformer.training.distributed import is_main_process

CONFIG_YAML = "config.yaml"
TOKENIZER_JSON = "tokenizer.json"
LABELS_JSON = "labels.json"
CLASSIFIER_JSON = "classifier.json"
CLASSIFIER_WEIGHTS = "classifier.safetensors"
METRICS_JSON = "metrics.json"
WANDB_ID_FILE = "wandb_id.txt"
SAMPLES_FILE = "samples.jsonl"
CHECKPOINT_DIR = "checkpoints"
CSV_DIR = "csv"
WANDB_DIR = "wandb"
RUN_FILES = (
    CONFIG_YAML,
    "config.json",
    "model.safetensors",
    TOKENIZER_JSON,
    LABELS_JSON,
    CLASSIFIER_JSON,
    CLASSIFIER_WEIGHTS,
    WANDB_ID_FILE,
    SAMPLES_FILE,
    METRICS_JSON,
)
RUN_DIRS = (CHECKPOINT_DIR, CSV_DIR, WANDB_DIR)


# ----------------------------------------------------------------------------- creating


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint: the readable checkpoint with the highest global step
    (last.ckpt on a tie). A kill between writing step-N.ckpt and last.ckpt leaves last.ckpt a
    step behind, so the step decides, not the name; temporary files of interrupted writes and
    unreadable files are never chosen: each one skipped is named on stderr, beside the file taken
    instead (a damaged newer checkpoint means resuming further back than expected)."""
    unreadable: list[Path] = []
    ckpt = newest_complete(run_dir / CHECKPOINT_DIR, unreadable)
    if ckpt is not None and is_main_process():
        for path in unreadable:
            try:
                read_checkpoint(path, mmap=True)
                reason = "no global step"
            except Exception as error:  # the reason it was skipped, whatever it is
                reason = first_line(error)
            print(
                f"note: skipping {path}, which cannot be read ({reason}); taking {ckpt} "
                f"(step {checkpoint_step(ckpt)}), the newest readable checkpoint",
                file=sys.stderr,
            )
    return ckpt


def resume_checkpoint(cfg: RunConfig) -> Path | None:
    """The checkpoint `cfg.resume` names (auto: the run directory's newest), read enough to
    refuse a truncated or unsafe file in one line; None to start from step 0. Writes nothing."""
    run_dir = Path(cfg.run.dir)
    if cfg.resume == "auto":
        ckpt = latest_checkpoint(run_dir)
        unreadable = [p for p in sorted((run_dir / CHECKPOINT_DIR).glob("*.ckpt")) if not p.name.startswith(".")]
        if ckpt is None and unreadable:  # never silently start over beside checkpoints that exist
            read_checkpoint(unreadable[-1], mmap=True)  # raises the one-line reason
        if ckpt is None:
            print(f"resume=auto: no checkpoint in {run_dir / CHECKPOINT_DIR}; starting from step 0", file=sys.stderr)
        else:
            print(f"resume=auto: continuing from {ckpt} (step {checkpoint_step(ckpt)})", file=sys.stderr)
        return ckpt
    if cfg.resume is None:
        return None
    ckpt = Path(cfg.resume)
    if not ckpt.exists():
        raise RunError(f"resume={cfg.resume}: no such checkpoint file")
    if ckpt.is_file():
        read_checkpoint(ckpt, mmap=True)  # a one-line error for a truncated or unsafe file, before any work
    return ckpt


def open_run_dir(cfg: RunConfig, ckpt: Path | None) -> Path:
    """The run directory, created; refuses one that holds a different run, or the same run's
    checkpoints, unless run.overwrite=true or resuming from `ckpt` (resume_checkpoint's)."""
    run_dir = Path(cfg.run.dir)
    if ckpt is not None and is_main_process():
        remove_temp_files(ckpt.parent)  # what writes killed mid-way left behind
    if ckpt is None and run_dir.is_dir() and any(run_dir.iterdir()) and is_main_process():
        if cfg.run.overwrite:
            clear_run_dir(run_dir)
        else:
            _refuse_other_run(run_dir, cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def _refuse_other_run(run_dir: Path, cfg: RunConfig) -> None:
    hint = "pass run.overwrite=true to replace it, resume=auto to continue it, or another run.dir"
    saved = run_dir / CONFIG_YAML
    if not saved.is_file():
        raise RunError(f"run directory {run_dir} is not empty and holds no {CONFIG_YAML}; {hint}")
    try:
        old = load_recipe(saved)
    except RecipeError as error:
        raise RunError(f"run directory {run_dir} holds an unreadable {CONFIG_YAML} ({error}); {hint}") from None
    difference = first_difference(to_dict(old), to_dict(cfg))
    if difference is not None:
        raise RunError(f"run directory {run_dir} holds a different run ({difference}); {hint}")
    if latest_checkpoint(run_dir) is not None or (run_dir / "model.safetensors").exists():
        raise RunError(f"run directory {run_dir} already holds this run's checkpoints; {hint}")


def first_difference(old: dict, new: dict, prefix: str = "") -> str | None:
    """'key: old -> new' for the first differing key (resume and run.overwrite do not count)."""
    for key in sorted(set(old) | set(new)):
        path = f"{prefix}{key}"
        if path in ("resume", "run.overwrite"):
            continue
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found = first_difference(a, b, path + ".")
            if found:
                return found
        elif a != b:
            return f"{path}: {a!r} -> {b!r}"
    return None


def clear_run_dir(run_dir: Path) -> None:
    """Remove what a run writes (and nothing else a user may have put there)."""
    for name in RUN_DIRS:
        shutil.rmtree(run_dir / name, ignore_errors=True)
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)


# ----------------------------------------------------------------------------- logs


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, float]]:
    """Every CSV row of a run, all versions (a resumed run appends a version) in order; empty
    cells dropped. A later version replaces what an earlier one logged from the step it starts
    at: every row after that step, and at that step the values it logs again. A run resumed
    from step N logs the loss of its first step at N, where the earlier version logged that step
    too (or a killed run's replayed steps) but also its validation and evaluations of the
    weights after N steps, which the resumed run does not repeat: those are kept."""
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
            again = {k for r in new if r.get("step") == first for k in r} - {"step", "epoch"}
            kept = []
            for row in rows:
                step = row.get("step", -1)
                if step == first:
                    row = {k: v for k, v in row.items() if k not in again}
                if step < first or (step == first and set(row) - {"step", "epoch"}):
                    kept.append(row)
            rows = kept
        rows.extend(new)
    return rows
