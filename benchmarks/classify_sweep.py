"""A classification recipe on a labelled task built from ../shared/data, with recipe overrides:
the measurements behind minilm-classify.yaml's values (issue #25; docs/time-to-quality.md).

    python benchmarks/classify_sweep.py --recipe recipes/minilm-classify.yaml \
        --variant "lr 1e-4, 100 steps=optim.lr=1e-4 trainer.max_steps=100" \
        --variant "lr 5e-5, 600 steps=optim.lr=5e-5 trainer.max_steps=600" [--task trec_fine] [--json]

Tasks (--task):
  trec        TREC question type, 6 coarse classes (DESC, ENTY, ...): "Who was Galileo ?" -> HUM
  trec_fine   the same questions, 50 fine classes (HUM:ind, LOC:city, ...)
  genre       where an English sentence of 6-40 words comes from, 3 classes: Tatoeba (everyday
              sentences), WMT news, Wikipedia (WikiText-2, detokenized); 1,650 / 167 / 167
              sentences of each for train / validation / test, drawn by a fixed shuffle from
              the corpora's own splits (WikiText-2's test.txt trains and validates, its
              valid.txt tests), so no sentence is in two splits

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
from time_to_quality import DATA, QUIET_ENV, REPO, _tail  # noqa: E402

TASKS = ("trec", "trec_fine", "genre")
VALIDATION_QUESTIONS = 500
GENRE_SENTENCES = {"train": 1650, "valid": 167, "test": 167}  # of each class
GENRE_WORDS = (6, 40)  # sentences of this many words, so that length alone tells little


def task_files(task: str, data: Path, out: Path) -> dict[str, Path]:
    """Task `task` as CSV files (text, label) under OUT: train, valid, test; written once."""
    files = {split: out / f"{task}-{split}.csv" for split in ("train", "valid", "test")}
    if all(p.is_file() for p in files.values()):
        return files
    rows = trec_rows(data / "trec", fine=task == "trec_fine") if task.startswith("trec") else genre_rows(data)
    out.mkdir(parents=True, exist_ok=True)
    for split, path in files.items():
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            writer.writerows(rows[split])
    return files


def trec_rows(trec: Path, fine: bool) -> dict[str, list[tuple[str, str]]]:
    """TREC's questions with their coarse (or fine) class; 500 training questions validate."""
    rows = {
        split: _read_trec(_need(trec / name), fine)
        for split, name in (("train", "train_5500.label"), ("test", "TREC_10.label"))
    }
    random.Random(0).shuffle(rows["train"])
    rows["valid"], rows["train"] = rows["train"][:VALIDATION_QUESTIONS], rows["train"][VALIDATION_QUESTIONS:]
    return rows


def _read_trec(path: Path, fine: bool) -> list[tuple[str, str]]:
    """`COARSE:fine question words` lines (the training file is ISO-8859-1) as (question, class)."""
    rows = []
    for line in path.read_bytes().decode("latin-1").splitlines():
        label, _, question = line.strip().partition(" ")
        if question:
            rows.append((question, label if fine else label.split(":", 1)[0]))
    return rows


def genre_rows(data: Path) -> dict[str, list[tuple[str, str]]]:
    """English sentences labelled by the corpus they come from, the same number of each."""
    wiki = {
        "train": _wiki_sentences(_need(data / "wikitext2" / "test.txt")),
        "test": _wiki_sentences(_need(data / "wikitext2" / "valid.txt")),
    }
    sources = {
        "tatoeba": {split: _lines(_need(data / "tatoeba_de_en" / f"{split}.en")) for split in ("train", "test")},
        "news": {split: _lines(_need(data / "wmt_news_de_en" / f"{split}.en")) for split in ("train", "test")},
        "wikipedia": wiki,
    }
    rows = {split: [] for split in GENRE_SENTENCES}
    for label, splits in sources.items():
        test_pool = _eligible(splits["test"])
        train_pool = _eligible(set(splits["train"]) - set(splits["test"]))  # a sentence in both files only tests
        n_train, n_valid = GENRE_SENTENCES["train"], GENRE_SENTENCES["valid"]
        if len(train_pool) < n_train + n_valid or len(test_pool) < GENRE_SENTENCES["test"]:
            raise SystemExit(f"genre: too few {label} sentences of {GENRE_WORDS[0]}-{GENRE_WORDS[1]} words")
        rows["train"] += [(s, label) for s in train_pool[:n_train]]
        rows["valid"] += [(s, label) for s in train_pool[n_train : n_train + n_valid]]
        rows["test"] += [(s, label) for s in test_pool[: GENRE_SENTENCES["test"]]]
    for split, split_rows in rows.items():
        random.Random(1).shuffle(split_rows)
    return rows


def _eligible(sentences) -> list[str]:
    """The distinct sentences of GENRE_WORDS words, in a fixed shuffled order."""
    pool = sorted({s for s in sentences if GENRE_WORDS[0] <= len(s.split()) <= GENRE_WORDS[1]})
    random.Random(0).shuffle(pool)
    return pool


def _wiki_sentences(path: Path) -> list[str]:
    """WikiText-2's paragraphs as sentences in ordinary spelling: its tokenized punctuation
    (`word @-@ word`, `1 @,@ 000`, ` , `) joined again, headings and sentences with <unk> left out,
    so that spacing gives the source away no more than words do."""
    sentences = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("="):
            continue
        line = re.sub(r" @(.)@ ", r"\1", line)
        line = re.sub(r" ([,.;:!?)'\]]|'s|n't)", r"\1", line)
        line = re.sub(r"([(\[]) ", r"\1", line)
        sentences += [s.strip() for s in re.split(r"(?<=[.!?]) (?=[A-Z])", line) if "<unk>" not in s]
    return sentences


def _lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _need(path: Path) -> Path:
    if not path.is_file():
        raise SystemExit(f"--data: no such file {path}")
    return path


def run_variant(args, label: str, overrides: list[str], files: dict[str, Path]) -> dict:
    run_dir = Path(args.out) / "runs" / args.task / re.sub(r"[^A-Za-z0-9.-]+", "_", label).strip("_")
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
    p.add_argument("--task", choices=TASKS, default="trec", help="the labelled task (see above)")
    p.add_argument("--data", default=str(DATA), help="the shared corpora (default ../shared/data)")
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
    files = task_files(args.task, Path(args.data), Path(args.out))
    print(f"{'variant':<40} {'val %':>7} {'test %':>7} {'wall s':>7}", file=sys.stderr)
    rows = []
    for variant in args.variant:
        label, _, overrides = variant.partition("=")
        rows.append(run_variant(args, label, overrides.split(), files))
        print(format_row(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"recipe": args.recipe, "task": args.task, "rows": rows}, indent=2))
    return 1 if any(row.get("error") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
