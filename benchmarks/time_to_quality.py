"""Time to quality: validation bits per byte after a training budget of 1, 2 and 5 minutes,
optionally beside nanoGPT's CPU configuration on the same text and split for the same time.

    python benchmarks/time_to_quality.py [--recipe recipes/tiny-clm.yaml] [--train FILE --val FILE]
                                         [--budgets 60,120,300] [--nanogpt PATH] [--nanogpt-eval-interval 50]
                                         [--nanogpt-threads N] [--override KEY=VALUE ...] [--out DIR] [--json]

Text: --train and --val (plain text files); by default WikiText-2's test.txt for training and
valid.txt for validation from ../shared/data/wikitext2 when it exists (there is no train.txt
there), else the recipe's own corpus, and no nanoGPT side (it needs the files).

lit-transformer: for each budget B of --budgets (seconds) a separate run, as a user with B
seconds would run it (the learning-rate schedule decays over B):

    lit-transformer pretrain RECIPE trainer.max_time=B trainer.max_steps=1000000
        data.train_files=[TRAIN] data.val_files=[VAL] run.dir=OUT/lit_Bs logger.wandb.mode=disabled
        [--override extras]

each a child process with its own fresh run directory and one token cache for all of them
(LIT_TRANSFORMER_CACHE=OUT/cache, so only the first run trains the tokenizer and tokenizes).
`bpb` is val/bpb of the run's metrics.json: its final validation, on the
recipe's validation split of VAL (the tiny recipes cap it with data.max_val_bytes and
trainer.limit_val_batches; --override data.max_val_bytes=null trainer.limit_val_batches=null
takes all of it). `wall s` is the child's wall clock from launch to exit: start-up, tokenizer
training, tokenization (first run only), B seconds of training, the validations (outside B, see
training.TimeBudget), checkpoints and the final model. `steps` is the optimizer steps taken,
from the run's CSV log.

nanoGPT (with --nanogpt PATH, a checkout of github.com/karpathy/nanoGPT; not a dependency):
its README's CPU configuration,

    python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
        --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
        --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0
        --dataset=lit_time_to_quality --eval_interval=50 --out_dir=OUT/nanogpt_out

with cwd=PATH, on PATH/data/lit_time_to_quality/, prepared from TRAIN and VAL as
data/shakespeare_char/prepare.py does (vocabulary: the sorted set of characters of both files;
train.bin and val.bin as uint16; meta.pkl with vocab_size, itos, stoi) but with train = TRAIN
and val = VAL instead of a 90/10 split of one file. One run for the largest budget, killed
there; every output line is timestamped from launch. At each budget mark, the val loss of the
last evaluation printed before it (`step N: train loss ..., val loss L`: nats per character,
the mean over eval_iters random batches of VAL) becomes bits per byte as
L / ln 2 * characters(VAL) / UTF-8 bytes(VAL); `iters` is the last iteration logged before the
mark, plus one. nanoGPT's time includes its start-up and its evaluations (2 x eval_iters
forward batches every eval_interval iterations); max_iters=2000 may end it before a mark, and
then its final evaluation (step 2000) stands. Its torch threads are torch's default (one per
core) unless --nanogpt-threads sets OMP_NUM_THREADS; ours are the recipe's trainer.num_threads
(1 in the tiny recipes). Two threads on two cores that another process also uses can slow it
several times over (OpenMP threads wait on each other): measure on a quiet machine.

Not part of the test suite. The default budgets take about 15 minutes (ours 8-9, nanoGPT 5);
on a shared machine take the figures in a quiet window.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "tiny-clm.yaml"
DATA = REPO.parent / "shared" / "data"  # the shared corpora the sweeps measure on
WIKITEXT = DATA / "wikitext2"
NANOGPT_DATASET = "lit_time_to_quality"
# nanoGPT README's "I only have a macbook" configuration (CPU, no compile, small model)
NANOGPT_ARGS = [
    "config/train_shakespeare_char.py",
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--max_iters=2000",
    "--lr_decay_iters=2000",
    "--dropout=0.0",
]
QUIET_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled"}
EVAL_LINE = re.compile(r"^step (\d+): train loss (\S+), val loss (\S+)")
ITER_LINE = re.compile(r"^iter (\d+): loss ")


def _tail(text: str, lines: int = 5) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


# ---------------------------------------------------------------------------------------------
# lit-transformer


def _steps(run_dir: Path) -> int | None:
    """Optimizer steps taken: the largest `step` in the run's CSV log (csv/version_N/metrics.csv)
    plus one, since Lightning logs after N steps at step N - 1 (the final validation's row too)."""
    steps = []
    for path in run_dir.glob("csv/version_*/metrics.csv"):
        with open(path, newline="") as f:
            steps += [int(float(row["step"])) for row in csv.DictReader(f) if row.get("step")]
    return max(steps) + 1 if steps else None


def run_ours(budget: float, args, data_overrides: list[str], workdir: Path, env: dict) -> dict:
    run_dir = workdir / f"lit_{budget:g}s"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resume
    overrides = [
        f"trainer.max_time={budget:g}",
        "trainer.max_steps=1000000",
        *data_overrides,
        f"run.dir={run_dir}",
        "logger.wandb.mode=disabled",
        *args.override,
    ]
    log = workdir / f"lit_{budget:g}s.log"
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "lit_transformer.commands.cli", "pretrain", args.recipe, *overrides],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )
        wall = time.perf_counter() - t0
    result = {
        "budget_s": budget,
        "wall_s": round(wall, 1),
        "rc": proc.returncode,
        "command": f"lit-transformer pretrain {args.recipe} " + " ".join(overrides),
    }
    metrics_file = run_dir / "metrics.json"
    if proc.returncode != 0 or not metrics_file.is_file():
        result["error"] = _tail(log.read_text("utf-8", "replace"))
        return result
    metrics = json.loads(metrics_file.read_text())
    result.update(bpb=metrics.get("val/bpb"), val_loss=metrics.get("val/loss"), steps=_steps(run_dir))
    return result


# ---------------------------------------------------------------------------------------------
# nanoGPT


def prepare_nanogpt_data(nanogpt: Path, train: Path, val: Path) -> dict:
    """PATH/data/NANOGPT_DATASET/ as shakespeare_char/prepare.py writes it, with TRAIN and VAL as
    the two splits. Returns what the bits-per-byte conversion needs."""
    import numpy as np

    # text mode, as prepare.py reads (universal newlines), but always UTF-8
    train_text, val_text = train.read_text(encoding="utf-8"), val.read_text(encoding="utf-8")
    chars = sorted(set(train_text) | set(val_text))
    if len(chars) > 65536:
        raise SystemExit(f"{len(chars)} distinct characters do not fit nanoGPT's uint16 token ids")
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}
    folder = nanogpt / "data" / NANOGPT_DATASET
    folder.mkdir(parents=True, exist_ok=True)
    np.array([stoi[c] for c in train_text], dtype=np.uint16).tofile(folder / "train.bin")
    np.array([stoi[c] for c in val_text], dtype=np.uint16).tofile(folder / "val.bin")
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)
    return {
        "folder": str(folder),
        "vocab_size": len(chars),
        "train_chars": len(train_text),
        "val_chars": len(val_text),
        "val_bytes": val.stat().st_size,
    }


def run_nanogpt(
    nanogpt: Path,
    budgets: list[float],
    data: dict,
    workdir: Path,
    eval_interval: int,
    threads: int | None,
    max_iters: int = 2000,
) -> dict:
    """One nanoGPT run for the largest budget, killed there; its val loss and iterations at each
    budget mark, from its output lines timestamped since launch."""
    out_dir = workdir / "nanogpt_out"
    if "=" in str(out_dir):  # configurator.py splits --key=value on every "="
        raise SystemExit(f"nanoGPT cannot take an --out_dir with '=' in it: {out_dir}")
    shutil.rmtree(out_dir, ignore_errors=True)
    # the README's 2000 iterations end in well under 5 minutes on 2 cores: --nanogpt-max-iters
    # scales max_iters (and the cosine decay with it) to fill a budget
    iters = [f"--max_iters={max_iters}", f"--lr_decay_iters={max_iters}"]
    cmd = [
        sys.executable,
        "train.py",
        *[a for a in NANOGPT_ARGS if not a.startswith(("--max_iters", "--lr_decay"))],
        *iters,
        f"--dataset={NANOGPT_DATASET}",
        f"--eval_interval={eval_interval}",
        f"--out_dir={out_dir}",
    ]
    limit = max(budgets)
    lines: list[tuple[float, str]] = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # every line as it is printed, for its timestamp
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)  # torch's intra-op threads (train.py never sets them)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=nanogpt, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, errors="replace"
    )

    def read():
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=limit)
        killed = False
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        killed = True
    ended = time.perf_counter() - t0
    reader.join(timeout=10)
    (workdir / "nanogpt.log").write_text("".join(f"{t:9.2f}  {line}\n" for t, line in lines))

    evals = [(t, int(m[1]), float(m[3])) for t, line in lines if (m := EVAL_LINE.match(line))]
    iters = [(t, int(m[1])) for t, line in lines if (m := ITER_LINE.match(line))]
    bytes_per_char = data["val_bytes"] / data["val_chars"]
    marks = []
    for budget in budgets:
        before = [e for e in evals if e[0] <= budget]
        done = [i for i in iters if i[0] <= budget]
        row = {"budget_s": budget, "iters": done[-1][1] + 1 if done else 0}
        if before:
            t, step, loss = before[-1]
            row.update(val_loss=loss, bpb=loss / math.log(2) / bytes_per_char, eval_step=step, eval_at_s=round(t, 1))
        marks.append(row)
    result = {
        "command": "python train.py " + " ".join(cmd[2:]),
        "cwd": str(nanogpt),
        "threads": threads,
        "rc": proc.returncode,
        "killed_at_budget": killed,
        "ended_s": round(ended, 1),
        "marks": marks,
        "first_eval_at_s": round(evals[0][0], 1) if evals else None,
    }
    if not killed and proc.returncode != 0:
        result["error"] = _tail("\n".join(line for _, line in lines))
    return result


# ---------------------------------------------------------------------------------------------


def _fmt(value, spec: str, width: int) -> str:
    return f"{value:{width}{spec}}" if value is not None else f"{'-':>{width}}"


def main() -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__[__doc__.index("Text:") :],
    )
    parser.add_argument("--recipe", default=str(RECIPE.relative_to(REPO)), help="default recipes/tiny-clm.yaml")
    parser.add_argument("--train", help="training text file (default: WikiText-2 test.txt)")
    parser.add_argument("--val", help="validation text file (default: WikiText-2 valid.txt)")
    parser.add_argument("--budgets", default="60,120,300", help="training budgets in seconds, comma-separated")
    parser.add_argument("--nanogpt", help="a nanoGPT checkout: run its CPU configuration beside ours")
    parser.add_argument(
        "--nanogpt-max-iters",
        type=int,
        default=2000,
        help="nanoGPT's max_iters and lr_decay_iters (the README's CPU configuration: 2000)",
    )
    parser.add_argument(
        "--nanogpt-eval-interval",
        type=int,
        default=50,
        help="nanoGPT's --eval_interval: iterations between its evaluations (default 50)",
    )
    parser.add_argument(
        "--nanogpt-threads",
        type=int,
        help="OMP_NUM_THREADS for nanoGPT (default: unset, torch's default of one per core)",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a further recipe override for our runs (repeatable)",
    )
    parser.add_argument("--out", help="work folder: runs, caches, logs (default: a temporary folder, removed)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the table goes to stderr)")
    args = parser.parse_args()
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))

    budgets = sorted(float(b) for b in args.budgets.split(","))
    if (args.train is None) != (args.val is None):
        parser.error("give --train and --val together (the same split on both sides)")
    train = Path(args.train).resolve() if args.train else (WIKITEXT / "test.txt").resolve()
    val = Path(args.val).resolve() if args.val else (WIKITEXT / "valid.txt").resolve()
    have_files = train.is_file() and val.is_file()
    if args.train and not have_files:
        parser.error(f"no such file: {train if not train.is_file() else val}")
    if args.nanogpt and not have_files:
        parser.error("the nanoGPT side needs text files: give --train and --val")
    nanogpt = Path(args.nanogpt).resolve() if args.nanogpt else None
    if nanogpt and not (nanogpt / "train.py").is_file():
        parser.error(f"{nanogpt} has no train.py (a nanoGPT checkout is expected)")
    recipe = Path(args.recipe)
    recipe = recipe if recipe.is_file() else REPO / recipe  # relative to here, or to the repository
    if not recipe.is_file():
        parser.error(f"no such recipe: {args.recipe}")
    args.recipe = str(recipe.resolve())

    tmp = None if args.out else tempfile.TemporaryDirectory(prefix="time_to_quality_")
    workdir = Path(args.out or tmp.name).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        **QUIET_ENV,
        LIT_TRANSFORMER_CACHE=str(workdir / "cache"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    data_overrides = [f"data.train_files=[{train}]", f"data.val_files=[{val}]"] if have_files else []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    recipe_name = os.path.relpath(args.recipe, REPO)
    try:
        say(
            f"text       train {train if have_files else 'the recipe corpus'}"
            + (
                f" ({train.stat().st_size / 1e6:.2f} MB), val {val} ({val.stat().st_size / 1e6:.2f} MB)"
                if have_files
                else ""
            )
        )
        say(f"machine    {cores} cores, load average {os.getloadavg()[0]:.2f}")
        ours = []
        for budget in budgets:
            ours.append(run_ours(budget, args, data_overrides, workdir, env))
            r = ours[-1]
            done = f"bpb {_fmt(r.get('bpb'), '.4f', 0)}, {r.get('steps')} steps, wall {r['wall_s']:.1f} s"
            say(f"ours {budget:>6g} s  " + (f"fails (exit {r['rc']}):\n{r['error']}" if "error" in r else done))
        theirs = None
        if nanogpt:
            data = prepare_nanogpt_data(nanogpt, train, val)
            say(
                f"nanoGPT    {data['folder']}: vocabulary {data['vocab_size']} characters, val "
                f"{data['val_chars']:,} characters in {data['val_bytes']:,} bytes; running {max(budgets):g} s"
            )
            theirs = run_nanogpt(
                nanogpt,
                budgets,
                data,
                workdir,
                args.nanogpt_eval_interval,
                args.nanogpt_threads,
                args.nanogpt_max_iters,
            )
            theirs["data"] = data
            if "error" in theirs:
                say(f"nanoGPT    fails (exit {theirs['rc']}):\n{theirs['error']}")

        say("")
        say(f"{'':>8} | {'lit-transformer ' + recipe_name:<28}" + (" | nanoGPT, CPU configuration" if theirs else ""))
        say(
            f"{'budget s':>8} | {'val bpb':>9} {'wall s':>8} {'steps':>9}"
            + (f" | {'val bpb':>9} {'iters':>7} {'eval at':>18}" if theirs else "")
        )
        for i, budget in enumerate(budgets):
            o = ours[i]
            row = (
                f"{budget:>8g} | {_fmt(o.get('bpb'), '.4f', 9)} {_fmt(o.get('wall_s'), '.1f', 8)} "
                f"{_fmt(o.get('steps'), 'd', 9)} |"
            )
            if theirs is not None:
                m = theirs["marks"][i]
                at = f"step {m['eval_step']}, {m['eval_at_s']:.0f} s" if "eval_step" in m else "-"
                row += f" {_fmt(m.get('bpb'), '.4f', 9)} {m['iters']:>7} {at:>18}"
            say(row)
        notes = [
            "ours: wall s is launch to exit (start-up, tokenizer, tokenization in the first run only, "
            "validations and checkpoints); the budget counts training alone",
        ]
        if theirs is not None:
            notes += [
                f"nanoGPT: one run of {max(budgets):g} s timed from launch, start-up and its evaluations "
                f"(every {args.nanogpt_eval_interval} iterations) included; bpb at the last evaluation before "
                "each mark (val loss / ln 2 * characters / bytes of VAL)",
                f"nanoGPT: max_iters={args.nanogpt_max_iters} may end it before a mark "
                "(then its final evaluation stands); this run "
                + (
                    f"was killed at {max(budgets):g} s"
                    if theirs["killed_at_budget"]
                    else f"ended by itself at {theirs['ended_s']:.0f} s"
                ),
                "threads: nanoGPT "
                + (
                    f"OMP_NUM_THREADS={args.nanogpt_threads}"
                    if args.nanogpt_threads
                    else "torch's default (one per core)"
                )
                + ", ours the recipe's trainer.num_threads",
            ]
        for note in notes:
            say(f"note       {note}")
        result = {
            "recipe": recipe_name,
            "train": str(train) if have_files else None,
            "val": str(val) if have_files else None,
            "budgets_s": budgets,
            "cores": cores,
            "load_average_1min": round(os.getloadavg()[0], 2),
            "overrides": args.override,
            "ours": ours,
            "nanogpt": theirs,
            "notes": notes,
        }
    finally:
        if tmp is not None:
            tmp.cleanup()
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
