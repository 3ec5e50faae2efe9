"""A recipe over several corpora with one time budget: the tuning protocol's table (issue #25).

    python benchmarks/recipe_sweep.py --recipes recipes/speedrun-clm.yaml,recipes/tiny-clm.yaml \
        --corpora wikitext2,wmt_en,tatoeba_en,stdlib --held-out tatoeba_en --budget 300 [--json]
    python benchmarks/recipe_sweep.py --corpora wikitext2 --budget 20 --override model.n_layers=2

A recipe is tuned on some corpora and reported on one that took no part in tuning (DESIGN.md,
principle 14): `--held-out NAME` marks that corpus in the table, so that a row tuned on it by
mistake shows. Each cell is one `lit-transformer pretrain RECIPE trainer.max_time=BUDGET` in a
child process with a fresh run directory (time_to_quality.run_ours: the same command a user runs),
and reports the final validation's bits per byte (val/bpb of metrics.json) and the optimizer
steps taken. Every recipe validates on the whole validation file (data.max_val_bytes=null
trainer.limit_val_batches=null come first, before --override: the tiny recipes otherwise cap
validation at a few batches, and the cells of a row would not measure the same text). One token
cache per corpus, shared by the recipes that tokenize it alike.

Corpora (from ../shared/data, train / validation files; `stdlib` is the embedded corpus):
  wikitext2   WikiText-2 test.txt / valid.txt (encyclopedic English)
  wmt_en      WMT news English train.en / valid.en (one sentence a line)
  wmt_de      the same in German
  tatoeba_en  Tatoeba's English side, short everyday sentences (a dialogue-like style)
  tatoeba_de  the same in German
  stdlib      the embedded Python standard library corpus (code and docstrings)
or NAME=TRAIN:VAL for any two text files.

With --nanogpt PATH (a checkout of github.com/karpathy/nanoGPT; not a dependency), each corpus
also gets nanoGPT's CPU configuration (time_to_quality.NANOGPT_ARGS: character level, 4 layers,
128 wide) with its iterations scaled to the budget and the run killed there: its last evaluation
(20 random batches of the validation file) in bits per byte.

Not part of the test suite; take figures on a quiet machine (one run at a time: each cell trains
with the recipe's threads for the whole budget).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # lit_transformer from this checkout, installed or not
from time_to_quality import DATA, QUIET_ENV, prepare_nanogpt_data, run_nanogpt, run_ours  # noqa: E402

CORPORA = {
    "wikitext2": ("wikitext2/test.txt", "wikitext2/valid.txt"),
    "wmt_en": ("wmt_news_de_en/train.en", "wmt_news_de_en/valid.en"),
    "wmt_de": ("wmt_news_de_en/train.de", "wmt_news_de_en/valid.de"),
    "tatoeba_en": ("tatoeba_de_en/train.en", "tatoeba_de_en/valid.en"),
    "tatoeba_de": ("tatoeba_de_en/train.de", "tatoeba_de_en/valid.de"),
    "stdlib": None,  # the embedded corpus: no files
}
SAME_VALIDATION = ["data.max_val_bytes=null", "trainer.limit_val_batches=null"]


def corpus_overrides(name: str, data_dir: Path) -> list[str]:
    """The data.* overrides that train and validate on corpus `name` (a CORPORA key or
    NAME=TRAIN:VAL). One-line errors for an unknown name or a missing file."""
    if "=" in name:
        _, files = name.split("=", 1)
        train, sep, val = files.partition(":")
        if not sep:
            raise SystemExit(f"--corpora: {name!r} must be NAME=TRAIN:VAL")
        paths = (Path(train), Path(val))
    elif name not in CORPORA:
        raise SystemExit(f"--corpora: unknown corpus {name!r}; choose from {', '.join(CORPORA)} or NAME=TRAIN:VAL")
    elif CORPORA[name] is None:
        return ["data.train_files=[]", "data.val_files=[]"]
    else:
        paths = tuple(data_dir / p for p in CORPORA[name])
    for path in paths:
        if not path.is_file():
            raise SystemExit(f"--corpora: {name}: no such file {path}")
    return [f"data.train_files=[{paths[0]}]", f"data.val_files=[{paths[1]}]"]


def corpus_label(name: str) -> str:
    return name.split("=", 1)[0]


def corpus_files(name: str, data_dir: Path, out: Path) -> tuple[Path, Path]:
    """(train, validation) text files of a corpus, for nanoGPT: the embedded corpus's splits are
    written out once under OUT (the files its training split reads, whole, and its validation)."""
    overrides = corpus_overrides(name, data_dir)
    if overrides[0] != "data.train_files=[]":
        return tuple(Path(o.split("=[", 1)[1].rstrip("]")) for o in overrides)  # type: ignore[return-value]
    from lit_transformer.data.sources.stdlib import corpus_split

    paths = (out / "stdlib-train.txt", out / "stdlib-valid.txt")
    for path, split in zip(paths, ("train", "validation")):
        if not path.is_file():
            out.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(p.read_text("utf-8", "replace") for _, p in corpus_split(split)), "utf-8")
    return paths


def nanogpt_cell(args, corpus: str, label: str) -> dict:
    """nanoGPT's CPU configuration on the corpus, iterations scaled to the budget, killed at it;
    its last evaluation (20 random validation batches, characters) as bits per byte."""
    train, val = corpus_files(corpus, Path(args.data_dir), Path(args.out))
    workdir = Path(args.out) / f"nanogpt-{label}"
    workdir.mkdir(parents=True, exist_ok=True)
    data = prepare_nanogpt_data(Path(args.nanogpt), train, val)
    iters = args.nanogpt_max_iters or round(19 * args.budget)
    result = run_nanogpt(Path(args.nanogpt), [args.budget], data, workdir, 50, None, max_iters=iters)
    mark = result["marks"][0]
    row = {"recipe": "nanoGPT (CPU configuration)", "corpus": label, "held_out": label == args.held_out}
    row.update(bpb=mark.get("bpb"), steps=mark["iters"], wall_s=result["ended_s"], command=result["command"])
    if result.get("error") or mark.get("bpb") is None:
        row["error"] = result.get("error", "no evaluation within the budget")
    return row


def sweep(args) -> list[dict]:
    rows = []
    for corpus in args.corpora:
        data = corpus_overrides(corpus, Path(args.data_dir))
        label = corpus_label(corpus)
        for recipe in args.recipes:
            workdir = Path(args.out) / f"{Path(recipe).stem}-{label}"
            workdir.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, **QUIET_ENV, "LIT_TRANSFORMER_CACHE": str(Path(args.out) / f"cache-{label}")}
            overrides = [*SAME_VALIDATION, *args.override]
            cell = run_ours(args.budget, SimpleNamespace(recipe=recipe, override=overrides), data, workdir, env)
            row = {"recipe": recipe, "corpus": label, "held_out": label == args.held_out, **cell}
            rows.append(row)
            print(format_row(row), file=sys.stderr, flush=True)
        if args.nanogpt:
            rows.append(nanogpt_cell(args, corpus, label))
            print(format_row(rows[-1]), file=sys.stderr, flush=True)
    return rows


def format_row(row: dict) -> str:
    corpus = row["corpus"] + (" (held out)" if row["held_out"] else "")
    if row.get("error"):
        return f"{row['recipe']:<34} {corpus:<24} error: {row['error'].splitlines()[-1]}"
    return f"{row['recipe']:<34} {corpus:<24} {row['bpb']:>7.3f} {row['steps'] or 0:>7} {row['wall_s'] or 0:>7.1f}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="recipes/tiny-clm.yaml", help="comma-separated recipe files")
    p.add_argument("--corpora", default="wikitext2,wmt_en,stdlib", help="comma-separated corpus names (see above)")
    p.add_argument("--held-out", help="the corpus that took no part in tuning (marked in the table)")
    p.add_argument("--budget", type=float, default=60.0, help="training seconds per run (trainer.max_time)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="extra recipe overrides")
    p.add_argument("--data-dir", default=str(DATA), help="where the shared corpora are (default ../shared/data)")
    p.add_argument("--out", default="sweep_runs", help="run directories and token caches")
    p.add_argument("--nanogpt", help="a nanoGPT checkout: its CPU configuration on each corpus, for the budget")
    p.add_argument(
        "--nanogpt-max-iters",
        type=int,
        help="nanoGPT's max_iters and lr_decay_iters (default 19 x budget: its pace on 2 cores, to end by the budget)",
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    args = p.parse_args(argv)
    args.recipes = [r for r in args.recipes.split(",") if r]
    args.corpora = [c for c in args.corpora.split(",") if c]
    if args.held_out and args.held_out not in {corpus_label(c) for c in args.corpora}:
        p.error(f"--held-out {args.held_out!r} is not one of --corpora")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"{'recipe':<34} {'corpus':<24} {'bpb':>7} {'steps':>7} {'wall s':>7}", file=sys.stderr)
    rows = sweep(args)
    if args.json:
        print(json.dumps({"budget_s": args.budget, "rows": rows}, indent=2))
    return 1 if any(row.get("error") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
