"""A classification recipe on TREC (question type, 6 coarse classes) with recipe overrides: the
measurements behind minilm-classify.yaml's values (issue #25; docs/time-to-quality.md).

    python benchmarks/classify_sweep.py --recipe recipes/minilm-classify.yaml \
        --variant "lr 1e-4, 100 steps=optim.lr=1e-4 trainer.max_steps=100" \
        --variant "lr 5e-5, 600 steps=optim.lr=5e-5 trainer.max_steps=600" [--json]

TREC's 5,452 training questions are split once, by a fixed shuffle, into 4,952 that train and
500 that validate (the figures that choose values); its 500 test questions (TREC_10.label) are
the recipe's `data.test_files`, scored once at the end of each run (`test/accuracy`). Each
variant is one `lit-transformer finetune RECIPE` in a child process with a fresh run directory
and the variant's overrides (a variant is `LABEL=KEY=VALUE KEY=VALUE ...`). A row reports the
final validation and test accuracy and the wall time of the command.

Not part of the test suite; take figures on a quiet machine (one run at a time).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # lit_transformer from this checkout, installed or not
from time_to_quality import QUIET_ENV, REPO, _tail  # noqa: E402

TREC = REPO.parent / "shared" / "data" / "trec"
VALIDATION_QUESTIONS = 500


def trec_files(trec: Path, out: Path) -> dict[str, Path]:
    """TREC as CSV files (text, label: the coarse class) under OUT: train, valid, test."""
    sources = {"train": trec / "train_5500.label", "test": trec / "TREC_10.label"}
    for path in sources.values():
        if not path.is_file():
            raise SystemExit(f"--trec: no such file {path}")
    files = {split: out / f"trec-{split}.csv" for split in ("train", "valid", "test")}
    if all(p.is_file() for p in files.values()):
        return files
    rows = {split: _read_trec(path) for split, path in sources.items()}
    random.Random(0).shuffle(rows["train"])
    rows["valid"], rows["train"] = rows["train"][:VALIDATION_QUESTIONS], rows["train"][VALIDATION_QUESTIONS:]
    out.mkdir(parents=True, exist_ok=True)
    for split, path in files.items():
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            writer.writerows(rows[split])
    return files


def _read_trec(path: Path) -> list[tuple[str, str]]:
    """`COARSE:fine question words` lines (the training file is ISO-8859-1) as (question, COARSE)."""
    rows = []
    for line in path.read_bytes().decode("latin-1").splitlines():
        label, _, question = line.strip().partition(" ")
        if question:
            rows.append((question, label.split(":", 1)[0]))
    return rows


def run_variant(args, label: str, overrides: list[str], files: dict[str, Path]) -> dict:
    run_dir = Path(args.out) / "runs" / re.sub(r"[^A-Za-z0-9.-]+", "_", label).strip("_")
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resume
    command = [
        "finetune",
        args.recipe,
        f"data.train_files=[{files['train']}]",
        f"data.val_files=[{files['valid']}]",
        f"data.test_files=[{files['test']}]",
        "data.text_column=text",
        "data.label_column=label",
        f"run.dir={run_dir}",
        "logger.wandb.mode=disabled",
        *overrides,
    ]
    env = {**os.environ, **QUIET_ENV, "LIT_TRANSFORMER_CACHE": str(Path(args.out) / "cache")}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "lit_transformer.commands.cli", *command],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    row = {
        "variant": label,
        "wall_s": round(time.perf_counter() - t0, 1),
        "command": "lit-transformer " + " ".join(command),
    }
    metrics_file = run_dir / "metrics.json"
    if proc.returncode != 0 or not metrics_file.is_file():
        return {**row, "error": _tail(proc.stdout + proc.stderr)}
    metrics = json.loads(metrics_file.read_text())
    return {
        **row,
        "val_accuracy": metrics.get("val/accuracy"),
        "test_accuracy": metrics.get("test/accuracy"),
    }


def format_row(row: dict) -> str:
    if row.get("error"):
        return f"{row['variant']:<40} error: {row['error'].splitlines()[-1]}"
    val, test = 100 * row["val_accuracy"], 100 * row["test_accuracy"]
    return f"{row['variant']:<40} {val:>7.1f} {test:>7.1f} {row['wall_s']:>7.1f}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/minilm-classify.yaml", help="a classification recipe")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=OVERRIDES",
        help="a label, '=', then space-separated KEY=VALUE overrides (repeatable; none: the recipe as it is)",
    )
    p.add_argument("--trec", default=str(TREC), help="the TREC folder (default ../shared/data/trec)")
    p.add_argument("--out", default="sweep_runs/classify", help="CSV files, run directories, token cache")
    p.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    args = p.parse_args(argv)
    args.variant = args.variant or ["recipe="]
    for variant in args.variant:
        if "=" not in variant:
            p.error(f"--variant {variant!r} must be LABEL=KEY=VALUE ...")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    files = trec_files(Path(args.trec), Path(args.out))
    print(f"{'variant':<40} {'val %':>7} {'test %':>7} {'wall s':>7}", file=sys.stderr)
    rows = []
    for variant in args.variant:
        label, _, overrides = variant.partition("=")
        rows.append(run_variant(args, label, overrides.split(), files))
        print(format_row(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"recipe": args.recipe, "rows": rows}, indent=2))
    return 1 if any(row.get("error") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
