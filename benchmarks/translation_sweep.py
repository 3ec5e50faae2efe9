"""A translation recipe over several parallel corpora with one time budget: issue #25's protocol
for translation (the table in docs/translation.md).

    python benchmarks/translation_sweep.py --recipes recipes/small-corpus-translation.yaml \
        --corpora tatoeba_de_en,tatoeba_en_de,news_short_de_en --held-out news_short_de_en [--json]
    python benchmarks/translation_sweep.py --corpora tatoeba_de_en --budget 390 --split valid \
        --override optim.optimizer=muon

Each cell is the command a user runs: `lit-transformer pretrain RECIPE` with the corpus's
data.* files and trainer.max_time=BUDGET (the recipe's own budget unless --budget), in a child
process with a fresh run directory, then `lit-transformer evaluate RUN --data SRC --data-target
TGT --json` on the corpus's test split (or, with --split valid, its validation split: screens
that choose values must not look at the test sentences), decoded as the recipe says. A row
reports BLEU and chrF (sacrebleu's defaults), the optimizer steps taken, and the wall time of
both commands. One token cache per corpus, shared by the recipes that tokenize it alike.

Corpora (from ../shared/data; source -> target, train / valid / test):
  tatoeba_de_en      Tatoeba German -> English: 15k short everyday sentence pairs
  tatoeba_en_de      the same pairs, English -> German
  news_short_de_en   WMT news German -> English, the pairs whose sides both have at most 20
                     words (19,780 / 1,820 / 1,700 of newstest 2008-2022, 2013, 2014): news
                     text in sentences as short as Tatoeba's; written once under --out
  wmt_de_en          WMT news German -> English, every pair (36,826; newstest2013; newstest2014)

Not part of the test suite; take figures on a quiet machine (one run at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # lit_transformer from this checkout, installed or not
from time_to_quality import DATA, QUIET_ENV, _tail, run_ours  # noqa: E402

CORPORA = {  # name: (folder, source language, target language, most words a side or None)
    "tatoeba_de_en": ("tatoeba_de_en", "de", "en", None),
    "tatoeba_en_de": ("tatoeba_de_en", "en", "de", None),
    "news_short_de_en": ("wmt_news_de_en", "de", "en", 20),
    "wmt_de_en": ("wmt_news_de_en", "de", "en", None),
}
SPLITS = ("train", "valid", "test")


def corpus_files(name: str, data_dir: Path, out: Path) -> dict[str, tuple[Path, Path]]:
    """{split: (source file, target file)} of corpus `name`; a filtered corpus is written once
    under OUT. One-line errors for an unknown name or a missing file."""
    if name not in CORPORA:
        raise SystemExit(f"--corpora: unknown corpus {name!r}; choose from {', '.join(CORPORA)}")
    folder, src, tgt, max_words = CORPORA[name]
    files = {}
    for split in SPLITS:
        pair = (data_dir / folder / f"{split}.{src}", data_dir / folder / f"{split}.{tgt}")
        for path in pair:
            if not path.is_file():
                raise SystemExit(f"--corpora: {name}: no such file {path}")
        files[split] = pair if max_words is None else _short_pairs(pair, max_words, out / name, split)
    return files


def _short_pairs(pair: tuple[Path, Path], max_words: int, out: Path, split: str) -> tuple[Path, Path]:
    """The pairs of PAIR whose two sides both have at most MAX_WORDS words, written under OUT."""
    written = (out / f"{split}.{pair[0].suffix[1:]}", out / f"{split}.{pair[1].suffix[1:]}")
    if all(p.is_file() for p in written):
        return written
    sources, targets = (p.read_text("utf-8").splitlines() for p in pair)
    kept = [(s, t) for s, t in zip(sources, targets) if len(s.split()) <= max_words and len(t.split()) <= max_words]
    out.mkdir(parents=True, exist_ok=True)
    for path, side in zip(written, zip(*kept)):
        path.write_text("\n".join(side) + "\n", "utf-8")
    return written


def evaluate(run_dir: Path, pair: tuple[Path, Path], env: dict, log: Path) -> dict:
    command = ["evaluate", str(run_dir), "--data", str(pair[0]), "--data-target", str(pair[1]), "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "lit_transformer.commands.cli", *command], capture_output=True, text=True, env=env
    )
    wall = time.perf_counter() - t0
    log.write_text(proc.stdout + proc.stderr, "utf-8")
    if proc.returncode != 0:
        return {"error": _tail(proc.stderr)}
    scores = json.loads(proc.stdout)
    return {  # evaluate's entry for --data with --data-target (docs/commands.md)
        "bleu": scores.get("eval/data_translation/bleu"),
        "chrf": scores.get("eval/data_translation/chrf"),
        "eval_wall_s": round(wall, 1),
        "eval_command": "lit-transformer " + " ".join(command),
    }


def sweep(args) -> list[dict]:
    rows = []
    for corpus in args.corpora:
        files = corpus_files(corpus, Path(args.data_dir), Path(args.out))
        (train_src, train_tgt), (val_src, val_tgt) = files["train"], files["valid"]
        data = [
            f"data.source_files=[{train_src}]",
            f"data.target_files=[{train_tgt}]",
            f"data.val_source_files=[{val_src}]",
            f"data.val_target_files=[{val_tgt}]",
        ]
        for recipe in args.recipes:
            workdir = Path(args.out) / f"{Path(recipe).stem}-{corpus}"
            workdir.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, **QUIET_ENV, "LIT_TRANSFORMER_CACHE": str(Path(args.out) / f"cache-{corpus}")}
            budget = args.budget or recipe_budget(recipe)
            cell = run_ours(budget, SimpleNamespace(recipe=recipe, override=args.override), data, workdir, env)
            row = {"recipe": recipe, "corpus": corpus, "held_out": corpus == args.held_out, "split": args.split}
            row.update({k: cell.get(k) for k in ("budget_s", "wall_s", "steps", "command", "error")})
            if not cell.get("error"):
                run_dir = workdir / f"lit_{budget:g}s"
                row.update(evaluate(run_dir, files[args.split], env, workdir / "evaluate.log"))
            rows.append({k: v for k, v in row.items() if v is not None})
            print(format_row(rows[-1]), file=sys.stderr, flush=True)
    return rows


def recipe_budget(recipe: str) -> float:
    """The recipe's own trainer.max_time, read the way a run reads it (extends included)."""
    from lit_transformer.recipe.load import load_recipe

    return float(load_recipe(recipe).trainer.max_time)


def format_row(row: dict) -> str:
    corpus = row["corpus"] + (" (held out)" if row["held_out"] else "")
    if row.get("error"):
        return f"{row['recipe']:<36} {corpus:<30} error: {row['error'].splitlines()[-1]}"
    return (
        f"{row['recipe']:<36} {corpus:<30} {row['bleu']:>6.1f} {row['chrf']:>6.1f} {row.get('steps') or 0:>7}"
        f" {row['wall_s']:>7.1f} {row['eval_wall_s']:>6.1f}"
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="recipes/small-corpus-translation.yaml", help="comma-separated recipe files")
    p.add_argument("--corpora", default="tatoeba_de_en", help="comma-separated corpus names (see above)")
    p.add_argument("--held-out", help="the corpus that took no part in tuning (marked in the table)")
    p.add_argument("--budget", type=float, help="training seconds per run (default: each recipe's trainer.max_time)")
    p.add_argument("--split", choices=("valid", "test"), default="test", help="the sentences evaluate scores")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="extra recipe overrides")
    p.add_argument("--data-dir", default=str(DATA), help="where the shared corpora are (default ../shared/data)")
    p.add_argument("--out", default="sweep_runs/translation", help="run directories, token caches, filtered corpora")
    p.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    args = p.parse_args(argv)
    args.recipes = [r for r in args.recipes.split(",") if r]
    args.corpora = [c for c in args.corpora.split(",") if c]
    if args.held_out and args.held_out not in args.corpora:
        p.error(f"--held-out {args.held_out!r} is not one of --corpora")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    header = f"{'recipe':<36} {'corpus':<30} {'BLEU':>6} {'chrF':>6} {'steps':>7} {'train s':>7} {'eval s':>6}"
    print(header, file=sys.stderr)
    rows = sweep(args)
    if args.json:
        print(json.dumps({"budget_s": args.budget, "split": args.split, "rows": rows}, indent=2))
    return 1 if any(row.get("error") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
