"""The margin of the option table's fine-tune check (helpers.assert_learned_keywords), measured.

    python tests/finetune_margins.py [--seeds 0,1,2,3,4] [--configs 1e-2@200,3e-2@40]
                                     [--precisions row,32-true] [--random]

For each backbone that tests/option_pairs.py fine-tunes from (FINETUNE_FROM), pretrain it as its
row does (in one process: the ddp and fsdp rows' options otherwise kept) under each seed and
precision, then fine-tune it on the keyword task as option_pairs.finetune does, once per
learning rate and step count in --configs; print each run's validation accuracy and loss, then per
config the worst over backbones, seeds and precisions. The pretraining seeds stand in for another
CPU's kernels: both only perturb the backbone the fine-tune starts from. Run it again under
ONEDNN_MAX_CPU_ISA (docs/guarantees.md, "CPU kinds") for another kernel path. --random adds a
fine-tune from each backbone re-initialised, which learns the task as well: accuracy alone cannot
tell that a fine-tune started from the pretrained weights (helpers.assert_tuned_from does).
Not part of the suite: the defaults take about 8 minutes on 2 cores with inductor's cache warm.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import option_pairs  # noqa: E402
import torch  # noqa: E402

from lit_transformer.commands.cli import main  # noqa: E402


def quietly(args: list[str]) -> None:
    """Run a command with its progress bar and metrics kept back, shown only if it fails."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = main(args)
    assert status == 0, (args, out.getvalue()[-4000:])


def pretrain(row: option_pairs.Row, seed: int, folder: Path) -> Path:
    run_dir = folder / f"{row.id}-{seed}"
    for args in option_pairs.stop_and_resume(row, run_dir):
        quietly([*args, f"trainer.seed={seed}"])
    return run_dir


def reinitialised(run_dir: Path) -> Path:
    """A copy of the run's model directory with freshly initialised weights of the same config."""
    from safetensors.torch import load_file, save_file

    from lit_transformer.model import LanguageModel
    from lit_transformer.model.config import TransformerConfig
    from lit_transformer.model.init import init_weights

    out = run_dir.with_name(run_dir.name + "-random")
    shutil.copytree(run_dir, out, ignore=shutil.ignore_patterns("checkpoints", "csv", "wandb"))
    cfg = TransformerConfig.from_dict(json.loads((out / "config.json").read_text())["model"], where=str(out))
    torch.manual_seed(0)
    fresh = init_weights(LanguageModel(cfg), cfg).state_dict()
    saved = load_file(str(out / "model.safetensors"))
    tensors = {name: fresh[name].to(t.dtype).contiguous() for name, t in saved.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def finetune(source: Path, lr: float, steps: int, folder: Path) -> dict:
    run_dir = folder / f"{source.name}-ft-{lr}-{steps}"
    steps_args = [f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}"]
    quietly(option_pairs.finetune_args(source, run_dir, f"optim.lr={lr}", *steps_args))
    return json.loads((run_dir / "metrics.json").read_text())


def main_cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--configs", default="1e-2@200,3e-2@40", help="learning rate@steps, comma-separated")
    parser.add_argument("--precisions", default="row,32-true", help="'row' is the row's own")
    parser.add_argument("--random", action="store_true", help="also fine-tune each backbone re-initialised")
    args = parser.parse_args()
    configs = [(float(c.split("@")[0]), int(c.split("@")[1])) for c in args.configs.split(",")]
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="finetune-margins-"))
    os.environ["LIT_TRANSFORMER_CACHE"] = str(folder / "cache")
    results: dict[tuple, list[tuple[str, float, float]]] = {}
    for base in sorted(option_pairs.FINETUNE_FROM, key=lambda r: r.id):
        for precision in args.precisions.split(","):
            row = dataclasses.replace(
                base, strategy="single", precision=base.precision if precision == "row" else precision
            )
            for seed in (int(s) for s in args.seeds.split(",")):
                source = pretrain(row, seed, folder)
                sources = [("pretrained", source)] + ([("random", reinitialised(source))] if args.random else [])
                for kind, path in sources:
                    for lr, steps in configs:
                        m = finetune(path, lr, steps, folder)
                        label = f"{base.id} {row.precision} seed {seed}"
                        results.setdefault((kind, lr, steps), []).append((label, m["val/accuracy"], m["val/loss"]))
                        print(
                            f"{kind} {label} lr {lr} steps {steps}: accuracy {m['val/accuracy']:.3f} "
                            f"loss {m['val/loss']:.3f}",
                            flush=True,
                        )
    print("\nper config, over every backbone, seed and precision:")
    for (kind, lr, steps), runs in results.items():
        worst = min(runs, key=lambda r: r[1])
        median = statistics.median(r[1] for r in runs)
        print(
            f"{kind} lr {lr} steps {steps}: {len(runs)} runs, accuracy median {median:.3f} "
            f"min {worst[1]:.3f} ({worst[0]}), loss max {max(r[2] for r in runs):.3f}"
        )
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main_cli()
