"""`lit-transformer average`: the mean of a run's last N checkpoints as a model directory
(the averaging itself: training/averaging.py)."""

from __future__ import annotations

from pathlib import Path

from lit_transformer.errors import RunError
from lit_transformer.run.loading import load_checkpoint_module
from lit_transformer.training.averaging import last_checkpoints, write_average
from lit_transformer.training.rundir import CONFIG_YAML


def average(run_dir: str | Path, out_dir: str | Path, last: int) -> Path:
    """Average the last `last` checkpoints of `run_dir` into the model directory `out_dir`
    (config.json + model.safetensors, the task head, and the run's config.yaml, tokenizer.json
    and labels.json, so that it reads like the run's final model)."""
    if isinstance(last, bool) or not isinstance(last, int) or last < 1:
        raise RunError(f"--last {last!r} must be a positive integer")
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if not (run_dir / CONFIG_YAML).is_file():
        raise RunError(f"{run_dir}: not a run directory (no {CONFIG_YAML})")
    paths = last_checkpoints(run_dir, last)
    if len(paths) < last:
        found = ", ".join(p.name for p in paths) or "none"
        raise RunError(
            f"{run_dir}: --last {last} but the run keeps {len(paths)} checkpoint(s) ({found}); "
            "trainer.keep_checkpoints keeps more"
        )
    # the newest checkpoint's module: its hyperparameters and any non-float buffers
    write_average(paths, out_dir, run_dir, load_checkpoint_module(paths[-1]))
    return out_dir
