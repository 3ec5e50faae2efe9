"""Checkpoint averaging (trainer.average_last, and the `average` command): the elementwise mean
of the model weights of a run's last N checkpoints, written as a model directory that generate,
evaluate, finetune and export read.

Vaswani et al. 2017 (section 6.1) report their base models with "a single model obtained by
averaging the last 5 checkpoints, which were written at 10-minute intervals"; averaging points
along the end of the trajectory lands nearer the middle of the minimum the optimizer circles
around. The mean is taken in float32 whatever the weights' dtype, and cast back; non-float
buffers are taken from the newest checkpoint. Checkpoints are read one at a time (memory-mapped;
sharded FSDP2 directories consolidated by training.checkpoints.read_checkpoint), so memory holds the
running sum and one checkpoint's weights.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

from lit_transformer.errors import RunError
from lit_transformer.training.checkpoints import checkpoint_step, is_temp, read_checkpoint
from lit_transformer.training.final_model import save_final
from lit_transformer.training.rundir import CHECKPOINT_DIR, CONFIG_YAML, LABELS_JSON, TOKENIZER_JSON

AVERAGED_JSON = "averaged.json"  # which checkpoints a model directory averages


def last_checkpoints(run_dir: str | Path, n: int) -> list[Path]:
    """The newest n checkpoints of a run by global step, oldest first; last.ckpt counts only
    when no step-N checkpoint holds the same step."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        raise RunError(f"{run_dir}: no {CHECKPOINT_DIR}/ directory (a run directory with checkpoints)")
    by_step: dict[int, Path] = {}
    for path in sorted(folder.glob("*.ckpt"), key=lambda p: p.name == "last.ckpt"):  # step-N files first
        if is_temp(path):
            continue
        step = checkpoint_step(path)
        if step is not None and step >= 0 and step not in by_step:
            by_step[step] = path
    return [by_step[s] for s in sorted(by_step)[-n:]]


def average_state_dicts(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Elementwise float32 mean of the checkpoints' floating-point weights (cast back to their
    dtype); other tensors from the last checkpoint. All must hold the same names and shapes."""
    if not paths:
        raise RunError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    last: dict[str, torch.Tensor] = {}
    for index, path in enumerate(paths):
        state = read_checkpoint(path, mmap=True)["state_dict"]
        if index and set(state) != set(total):
            diff = sorted(set(state) ^ set(total))[:3]
            raise RunError(
                f"{path}: holds other weights than {paths[0]} (e.g. {diff}); checkpoints of one run "
                "average, others do not"
            )
        for name, tensor in state.items():
            if not tensor.is_floating_point():
                last[name] = tensor.clone()
                total.setdefault(name, tensor.new_zeros(()))
                continue
            if index and total[name].shape != tensor.shape:
                raise RunError(f"{path}: {name} has shape {tuple(tensor.shape)}, {paths[0]} {tuple(total[name].shape)}")
            value = tensor.to(torch.float32)
            total[name] = total[name] + value if index else value.clone()
            last[name] = tensor  # for its dtype
        del state
    return {
        name: (total[name] / len(paths)).to(last[name].dtype) if last[name].is_floating_point() else last[name]
        for name in total
    }


def load_average(module, run_dir: Path, last: int) -> list[Path]:
    """End of training (trainer.average_last): load the mean of the run's last `last`
    checkpoints into the (unsharded) module, so that the final validation and the saved final
    model are the average. Fewer checkpoints than asked (a short run): those there are, said on
    stderr; fewer than two: nothing to average, []."""
    paths = last_checkpoints(run_dir, last)
    if len(paths) < 2:
        print(
            f"trainer.average_last={last}: the run holds {len(paths)} checkpoint(s); the final model is "
            "the last weights, not an average",
            file=sys.stderr,
        )
        return []
    if len(paths) < last:
        print(f"trainer.average_last={last}: the run holds {len(paths)} checkpoints; averaging those", file=sys.stderr)
    module.load_state_dict(average_state_dicts(paths))
    return paths


def record_average(paths: list[Path], out_dir: Path) -> None:
    steps = [checkpoint_step(p) for p in paths]
    (out_dir / AVERAGED_JSON).write_text(
        json.dumps({"checkpoints": [str(p) for p in paths], "steps": steps}, indent=1) + "\n"
    )


def write_average(paths: list[Path], out_dir: Path, run_dir: Path, module) -> None:
    """The averaged model of `paths` as a model directory (commands/average.py), `module` an
    unsharded objective of the run's hyperparameters that takes the averaged weights."""
    if out_dir.resolve() != run_dir.resolve() and (out_dir / CHECKPOINT_DIR).exists():
        raise RunError(f"{out_dir}: holds a run's checkpoints; write the average to a new directory")
    module.load_state_dict(average_state_dicts(paths))
    out_dir.mkdir(parents=True, exist_ok=True)
    if out_dir.resolve() != run_dir.resolve():
        for name in (CONFIG_YAML, TOKENIZER_JSON, LABELS_JSON):  # before save_final, which reads labels.json
            if (run_dir / name).is_file():
                shutil.copyfile(run_dir / name, out_dir / name)
    save_final(module, out_dir)
    record_average(paths, out_dir)
