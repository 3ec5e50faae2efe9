"""A mixture's training speed against the causal LM's, as shipped (issue #52).

    python benchmarks/mixture_speed.py                                  # 5 alternating rounds
    python benchmarks/mixture_speed.py --recipes tiny-clm,tiny-gptbert --rounds 5 --steps 200
    python benchmarks/mixture_speed.py --profile                        # where each step's time goes
    python benchmarks/mixture_speed.py --parts --rounds 2               # the same, without a profiler

Each cell is one recipe pretrained in a fresh process and a fresh run directory on the embedded
corpus, its recipe as shipped (batch, block, precision, threads) with validation, checkpoints and
sample generation moved past the end, and training tokens per second taken between the end of
optimizer step `--warmup` and the end of step `--warmup + --steps` (wall clock, the data loader
included; tokens: batch x block, as every row of these recipes is packed full). Rounds alternate
the recipes' order, so a machine that slows down over the run costs each recipe alike; the
headline is the median over rounds with the range, and each mixture's ratio to the first recipe.

--profile: one run per recipe under torch.profiler over `--steps` steps after the warm-up,
printing the self time of each operator group as a share of the step (as profile_step.py groups
them), the data loader's share (batches drawn from the loader with no model), and the top
operators. --parts: the wall time of each part of a step without a profiler (whose cost per
operator call distorts a comparison of steps with different operator counts): the loop between
steps (the data loader included), the training step (forward, loss and `self.log`), backward, the
optimizer step and the rest; and, of the training step, `self.log`. Not part of the test suite;
take figures on a quiet machine, one run at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Past the measured steps: validation, named evaluations, checkpoints and samples stay out of the
# window (they run once at the very end, after the timer stops).
QUIET = ["generation.enabled=false", "logger.wandb.mode=disabled"]


def step_parts(warmup: int, total: int):
    """A Lightning callback timing each part of the steps after `warmup` (see --parts)."""
    import lightning as L

    class StepParts(L.Callback):
        def __init__(self):
            self.seconds: dict[str, float] = defaultdict(float)
            self.at: dict[str, float] = {}
            self.on = False

        def setup(self, trainer, pl_module, stage):
            log = pl_module.log

            def timed_log(*args, **kwargs):
                start = time.perf_counter()
                out = log(*args, **kwargs)
                if self.on:
                    self.seconds["of which self.log"] += time.perf_counter() - start
                return out

            pl_module.log = timed_log

        def _part(self, name: str, since: str, mark: str) -> None:
            now = time.perf_counter()
            if self.on and since in self.at:
                self.seconds[name] += now - self.at[since]
            self.at[mark] = now

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.on = warmup <= trainer.global_step < total
            self._part("between steps (loader)", "end", "start")

        def on_before_backward(self, trainer, pl_module, loss):
            self._part("training_step", "start", "backward")

        def on_after_backward(self, trainer, pl_module):
            self._part("backward", "backward", "optimizer")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._part("optimizer and the rest", "optimizer", "end")

        def ms_per_step(self) -> dict[str, float]:
            return {name: 1000 * s / (total - warmup) for name, s in self.seconds.items()}

    return StepParts()


def run_one(recipe: str, steps: int, warmup: int, profile: bool, seed: int, parts: bool = False) -> dict:
    """Train `recipe` in this process and return its timing (and profile) as a dict."""
    import lightning as L
    import torch

    from lit_transformer.commands.train import train
    from lit_transformer.recipe.load import load_recipe

    total = warmup + steps
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [
            f"run.dir={run_dir}",
            f"trainer.max_steps={total}",
            f"trainer.val_check_interval={total}",
            "trainer.limit_val_batches=1",
            f"trainer.checkpoint_every_n_steps={total}",
            f"trainer.seed={seed}",
            *QUIET,
        ]
        cfg = load_recipe(recipe, overrides)
        cfg.eval = []  # the recipe's named evaluations run after training; none here
        marks: dict[str, float] = {}
        profiler = {}

        class StepTimer(L.Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                step = trainer.global_step
                if step == warmup and "start" not in marks:
                    marks["start"] = time.perf_counter()
                    if profile:
                        profiler["p"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                        profiler["p"].__enter__()
                if step == total and "end" not in marks:
                    marks["end"] = time.perf_counter()
                    if profile:
                        profiler["p"].__exit__(None, None, None)

        timers = [StepTimer()] + ([step_parts(warmup, total)] if parts else [])
        train(cfg, callbacks=timers, progress_bar=False)
        seconds = marks["end"] - marks["start"]
        tokens = steps * cfg.data.batch_size * cfg.data.block_size * max(cfg.trainer.accumulate_grad_batches, 1)
        out = {
            "recipe": recipe,
            "seconds": seconds,
            "steps_per_s": steps / seconds,
            "tokens_per_s": tokens / seconds,
            "precision": cfg.trainer.precision,
        }
        if parts:
            out["parts"] = timers[1].ms_per_step()
        if profile:
            out["profile"] = _groups(profiler["p"], steps)
            out["loader_ms"] = _loader_ms(cfg, steps)
        return out


def _groups(prof, steps: int) -> dict:
    """Self CPU time per operator group (ms per step) and the top operators."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from profile_step import GROUPS

    groups: dict[str, float] = {}
    ops = []
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1000 / steps
        ops.append((ms, event.key))
        group = next((g for g, names in GROUPS if any(n in event.key for n in names)), "other")
        groups[group] = groups.get(group, 0.0) + ms
    ops.sort(reverse=True)
    return {"groups": groups, "top": [(round(ms, 3), name) for ms, name in ops[:15]]}


def _loader_ms(cfg, steps: int) -> float:
    """Milliseconds per batch the training loader takes on its own (collation, no model)."""
    from lit_transformer.commands.train import data_module
    from lit_transformer.run.resolve import resolve_run

    run = resolve_run(cfg, quiet=True)
    dm = data_module(run.data, run.run_dir, cfg.trainer, cfg.data.num_workers, run.model.vocab_size)
    loader = iter(dm.train_dataloader())
    next(loader)
    start = time.perf_counter()
    for _ in range(steps):
        next(loader)
    return (time.perf_counter() - start) * 1000 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default="tiny-clm,tiny-gptbert,tiny-unilm")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--parts", action="store_true", help="time each part of a step, without a profiler")
    parser.add_argument("--json", help="write every cell here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one recipe, JSON on stdout
    args = parser.parse_args()
    if args.one:
        result = run_one(args.one, args.steps, args.warmup, args.profile, args.seed, args.parts)
        print("RESULT " + json.dumps(result))
        return
    recipes = args.recipes.split(",")
    rounds = 1 if args.profile else args.rounds
    cells: dict[str, list[dict]] = {r: [] for r in recipes}
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    for round_ in range(rounds):
        order = recipes if round_ % 2 == 0 else recipes[::-1]
        for recipe in order:
            command = [sys.executable, __file__, "--one", recipe, "--steps", str(args.steps)]
            command += (
                ["--warmup", str(args.warmup), "--seed", str(args.seed)]
                + (["--profile"] if args.profile else [])
                + (["--parts"] if args.parts else [])
            )
            done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if done.returncode != 0 or line is None:
                sys.exit(f"{recipe} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
            cell = json.loads(line[len("RESULT ") :])
            cells[recipe].append(cell)
            print(f"round {round_ + 1} {recipe}: {cell['tokens_per_s']:,.0f} tokens/s", flush=True)
    print(f"\n{'recipe':<16}{'tokens/s median':>16}{'range':>22}{'vs ' + recipes[0]:>14}")
    base = statistics.median(c["tokens_per_s"] for c in cells[recipes[0]])
    for recipe in recipes:
        values = [c["tokens_per_s"] for c in cells[recipe]]
        median = statistics.median(values)
        print(f"{recipe:<16}{median:>16,.0f}{f'{min(values):,.0f}-{max(values):,.0f}':>22}{median / base:>13.2f}x")
    if args.parts:
        names = ["between steps (loader)", "training_step", "of which self.log", "backward", "optimizer and the rest"]
        print(f"\nms per step, median over rounds:\n{'':<26}" + "".join(f"{r:>16}" for r in recipes))
        for name in names:
            values = [statistics.median(c["parts"].get(name, 0.0) for c in cells[r]) for r in recipes]
            print(f"{name:<26}" + "".join(f"{v:>16.2f}" for v in values))
    if args.profile:
        for recipe in recipes:
            cell = cells[recipe][0]
            step_ms = 1000 / cell["steps_per_s"]
            print(f"\n{recipe}: {step_ms:.1f} ms per step; loader alone {cell['loader_ms']:.1f} ms per batch")
            for group, ms in sorted(cell["profile"]["groups"].items(), key=lambda kv: -kv[1]):
                print(f"  {group:<20}{ms:8.2f} ms")
            for ms, name in cell["profile"]["top"]:
                print(f"    {ms:8.3f} ms  {name}")
    if args.json:
        Path(args.json).write_text(json.dumps(cells, indent=1))


if __name__ == "__main__":
    main()
