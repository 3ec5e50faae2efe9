"""A mixture against the specialists at equal compute (issue #39): the table of docs/multitask.md.

    python benchmarks/multitask_compare.py --recipes tiny-clm,tiny-mlm,tiny-unilm,tiny-gptbert \
        --corpora wikitext2,wmt_en,tatoeba_en --held-out tatoeba_en --steps 600 --seeds 0 [--json OUT]

Each cell is one recipe pretrained on one corpus for `--steps` optimizer steps (the same steps,
batch and block for every tiny recipe: equal training tokens; the wall clock is reported beside
it, and `--budget S` caps it), then measured on the same weights:

- causal bits per byte of the corpus's validation file (a mixture: its clm task's), from the run's
  final validation (every batch of the file: data.max_val_bytes=null trainer.limit_val_batches=null);
- minimal pairs built from the validation file (`build_pairs`: each pair a sentence and the same
  sentence with two adjacent words swapped, or with one word replaced by another word of the file),
  scored `causal` and, where the model trained a bidirectional task, `masked` (pseudo-log-likelihood);
- the recipe's own named evaluations at the end (base/tiny-eval.yaml: the docstring probe,
  function names, next_line on the embedded corpus), from metrics.json;
- TREC question classification (6 classes) fine-tuned from the run with
  tiny-classify-from-pretrained.yaml for `--finetune-steps` (validation: 500 held-back training
  questions; test: TREC_10).

Corpora as benchmarks/recipe_sweep.py names them (wikitext2, wmt_en, tatoeba_en, stdlib, or
NAME=TRAIN:VAL). `--held-out NAME` marks the corpus no recipe was tuned on. Not part of the test
suite; take figures on a quiet machine, one run at a time.
"""

from __future__ import annotations

import argparse
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
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from classify_sweep import task_files  # noqa: E402
from recipe_sweep import SAME_VALIDATION, corpus_label, corpus_overrides  # noqa: E402
from time_to_quality import DATA, QUIET_ENV, REPO, _tail  # noqa: E402

PAIR_WORDS = (6, 30)  # sentences of this many words become pairs
WORD = re.compile(r"^[A-Za-z][a-z]+$")  # the words a perturbation moves or replaces: plain lower-case words


def sentences(path: Path) -> list[str]:
    """The file's sentences of PAIR_WORDS words: its lines split after '. ', without WikiText's
    headings (lines in '=')."""
    out = []
    for line in path.read_text("utf-8", "replace").splitlines():
        line = line.strip()
        if not line or line.startswith("="):
            continue
        for sentence in re.split(r"(?<=[.!?]) +", line):
            words = sentence.split()
            if PAIR_WORDS[0] <= len(words) <= PAIR_WORDS[1]:
                out.append(" ".join(words))
    return out


def build_pairs(path: Path, count: int, seed: int = 0) -> list[dict]:
    """Up to `count` minimal pairs from the sentences of `path`, half of each group:
    swap     two adjacent plain words of the sentence exchanged (word order);
    replace  one plain word replaced by a plain word drawn from the file (a word that does not fit)."""
    rng = random.Random(seed)
    pool = sentences(path)
    rng.shuffle(pool)
    vocabulary = sorted({w for s in pool for w in s.split() if WORD.match(w)})
    rows = []
    for index, sentence in enumerate(pool):
        if len(rows) >= count:
            break
        words = sentence.split()
        plain = [i for i, w in enumerate(words) if WORD.match(w)]
        if index % 2 == 0:
            spots = [i for i in plain if i + 1 < len(words) and WORD.match(words[i + 1]) and words[i] != words[i + 1]]
            if not spots:
                continue
            i = rng.choice(spots)
            bad = [*words[:i], words[i + 1], words[i], *words[i + 2 :]]
            group = "swap"
        else:
            if not plain:
                continue
            i = rng.choice(plain)
            other = rng.choice(vocabulary)
            if other == words[i]:
                continue
            bad = [*words[:i], other, *words[i + 1 :]]
            group = "replace"
        rows.append({"sentence_good": sentence, "sentence_bad": " ".join(bad), "group": group})
    return rows


def write_suite(folder: Path, pairs: Path, scoring: list[str]) -> Path:
    entries = [
        {"name": f"pairs_{how}", "kind": "pairs", "files": [str(pairs)], "group_column": "group", "scoring": how}
        for how in scoring
    ]
    suite = folder / f"suite-{'-'.join(scoring)}.json"
    suite.write_text(json.dumps({"eval": entries}))  # JSON is YAML
    return suite


def scorings(run_dir: Path) -> list[str]:
    """How the run's model scores a sentence: causal where it predicts the next token (a decoder,
    an encoder-decoder), masked where it trained a bidirectional task (an encoder, or a decoder's
    mlm or mntp task)."""
    from lit_transformer.recipe.load import load_recipe

    cfg = load_recipe(run_dir / "config.yaml")
    if cfg.model.arch == "encoder":
        return ["masked"]
    return ["causal"] + (["masked"] if any(t.objective in ("mlm", "mntp") for t in cfg.tasks) else [])


def cli(args: list[str], env: dict, log: Path) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "lit_transformer.commands.cli", *args], capture_output=True, text=True, env=env, cwd=REPO
    )
    log.write_text(proc.stdout + proc.stderr)
    return proc.returncode, time.perf_counter() - t0, proc.stdout


def causal_bpb(metrics: dict) -> float | None:
    for key in ("val/bpb", "val/clm/bpb"):
        if key in metrics:
            return metrics[key]
    return None


def cell(args, recipe: str, corpus: str, seed: int, pairs: Path, trec: dict[str, Path]) -> dict:
    out = Path(args.out)
    label = corpus_label(corpus)
    run_dir = out / "runs" / label / f"{Path(recipe).stem}-s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, **QUIET_ENV, "LIT_TRANSFORMER_CACHE": str(out / "cache")}
    pretrain = [
        "pretrain",
        recipe,
        *corpus_overrides(corpus, DATA),
        *SAME_VALIDATION,
        f"trainer.max_steps={args.steps}",
        f"trainer.val_check_interval={args.steps}",
        f"trainer.seed={seed}",
        f"run.dir={run_dir}",
        "logger.wandb.mode=disabled",
        *([f"trainer.max_time={args.budget:g}"] if args.budget else []),
        *args.override,
    ]
    row = {
        "recipe": Path(recipe).stem,
        "corpus": label,
        "seed": seed,
        "command": "lit-transformer " + " ".join(pretrain),
    }
    code, wall, _ = cli(pretrain, env, out / f"{label}-{row['recipe']}-s{seed}.pretrain.log")
    metrics_file = run_dir / "metrics.json"
    if code != 0 or not metrics_file.is_file():
        return {**row, "error": _tail((out / f"{label}-{row['recipe']}-s{seed}.pretrain.log").read_text())}
    from lit_transformer.training.rundir import read_metrics

    metrics = json.loads(metrics_file.read_text())
    logged = [r for r in read_metrics(run_dir) if "train/tokens_seen" in r]
    row.update(
        wall_s=round(wall, 1),
        steps=int(logged[-1]["step"]) + 1 if logged else None,
        tokens=logged[-1]["train/tokens_seen"] if logged else None,
        bpb=causal_bpb(metrics),
        # the named evaluations' headline: a probe's accuracy, a choice set's acc
        **{k.split("/")[1]: metrics[k] for k in metrics if k.startswith("eval/") and k.endswith(("/accuracy", "/acc"))},
    )
    suite = write_suite(out, pairs, scorings(run_dir))
    code, _, stdout = cli(
        ["evaluate", str(run_dir), "--suite", str(suite), "--json"],
        env,
        out / f"{label}-{row['recipe']}-s{seed}.pairs.log",
    )
    if code == 0:
        result = json.loads(stdout.strip().splitlines()[-1])
        for name in ("pairs_causal", "pairs_masked"):
            if f"eval/{name}/accuracy" in result:
                row[name] = result[f"eval/{name}/accuracy"]
    else:
        row["pairs_error"] = _tail((out / f"{label}-{row['recipe']}-s{seed}.pairs.log").read_text())
    if args.finetune_steps:
        tuned = run_dir.parent / f"{run_dir.name}-trec"
        shutil.rmtree(tuned, ignore_errors=True)
        finetune = [
            "finetune",
            str(REPO / "recipes" / "tiny-classify-from-pretrained.yaml"),
            f"finetune.from={run_dir}",
            f"data.train_files=[{trec['train']}]",
            f"data.val_files=[{trec['valid']}]",
            f"data.test_files=[{trec['test']}]",
            "data.text_column=text",
            "data.label_column=label",
            f"trainer.max_steps={args.finetune_steps}",
            f"trainer.seed={seed}",
            f"run.dir={tuned}",
            "logger.wandb.mode=disabled",
        ]
        code, _, _ = cli(finetune, env, out / f"{label}-{row['recipe']}-s{seed}.trec.log")
        tuned_metrics = tuned / "metrics.json"
        if code == 0 and tuned_metrics.is_file():
            m = json.loads(tuned_metrics.read_text())
            row.update(trec_val=m.get("val/accuracy"), trec_test=m.get("test/accuracy"))
        else:
            row["trec_error"] = _tail((out / f"{label}-{row['recipe']}-s{seed}.trec.log").read_text())
    return row


COLUMNS = ("bpb", "pairs_causal", "pairs_masked", "docstrings", "names", "next_line", "trec_val", "trec_test")


def format_row(row: dict, held_out: str | None) -> str:
    mark = " (held out)" if row["corpus"] == held_out else ""
    cells = [f"{row.get(c):.3f}" if isinstance(row.get(c), float) else "-" for c in COLUMNS]
    lead = [
        row["recipe"],
        row["corpus"] + mark,
        str(row["seed"]),
        str(row.get("steps", "-")),
        str(row.get("wall_s", "-")),
    ]
    return "| " + " | ".join(lead + cells) + " |"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="tiny-clm,tiny-mlm,tiny-unilm,tiny-gptbert")
    p.add_argument("--corpora", default="wikitext2,wmt_en,tatoeba_en")
    p.add_argument("--held-out", default=None)
    p.add_argument("--steps", type=int, default=600, help="optimizer steps of every pretraining run")
    p.add_argument("--budget", type=float, default=None, help="also stop a run after this many seconds")
    p.add_argument("--seeds", default="0")
    p.add_argument("--pairs", type=int, default=2000, help="minimal pairs built per corpus")
    p.add_argument("--finetune-steps", type=int, default=300, help="TREC fine-tuning steps (0: none)")
    p.add_argument("--override", action="append", default=[], help="a recipe override for every pretraining run")
    p.add_argument("--out", default="/tmp/lit-multitask-compare")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trec = task_files("trec", DATA, out) if args.finetune_steps else {}
    recipes = [r if r.endswith(".yaml") else str(REPO / "recipes" / f"{r}.yaml") for r in args.recipes.split(",")]
    rows = []
    print("| recipe | corpus | seed | steps | wall s | " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * (5 + len(COLUMNS)))
    for corpus in args.corpora.split(","):
        val = Path(corpus_overrides(corpus, DATA)[1].split("=[", 1)[1].rstrip("]"))
        pairs = out / f"pairs-{corpus_label(corpus)}.jsonl"
        pairs.write_text("".join(json.dumps(r) + "\n" for r in build_pairs(val, args.pairs)))
        for recipe in recipes:
            for seed in (int(s) for s in args.seeds.split(",")):
                row = cell(args, recipe, corpus, seed, pairs, trec)
                rows.append(row)
                print(
                    format_row(row, args.held_out)
                    if "error" not in row
                    else f"{row['recipe']} {corpus}: {row['error']}",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
