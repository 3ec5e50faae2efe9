"""What a training step costs beyond its arithmetic: a recipe's model trained by the full
`lit-transformer pretrain` path (Lightning, callbacks, logging, data loading, the progress
bar) against a bare PyTorch loop over the same model, batch shape, loss and optimizer, and both
against the machine's measured matrix-product peak (MFU).

    python benchmarks/step_overhead.py [--recipe recipes/tiny-clm.yaml] [--steps 60] [--rounds 5] [--override K=V ...]
    python benchmarks/step_overhead.py --before d742744   # also the full path of that commit, alternately

Bare loop: the objective's own loss function on random token rows of data.block_size,
data.batch_size rows, backward, gradient clipping, the recipe's optimizer (AdamW or Muon +
AdamW) and schedule step; timed after 5 warm-up steps. Full path: `pretrain` with
trainer.max_steps=--steps, validation and checkpoints pushed past the end, generation and W&B
off, the progress bar on (as a user runs it); its train/tokens_per_s from the CSV log (the
window after the first logging step, so start-up is not in it). MFU: model FLOPs per token
(model/accounting.py) times tokens/s over the peak of a 2048^3 matrix product in the run's
precision on this machine with the recipe's threads. Not part of the test suite.

Every figure is the median over --rounds rounds (default 5) with the range (min-max) beside it,
never the best round: a round runs the bare loop, then the full path. Ratios (overhead,
speed-up) are taken within each round, whose runs share the machine's load of the moment, and
summarised the same way. The matmul peak alone is the best of its repeats: it is a peak.

--before REF: the full path of git revision REF as well (its own code and its own copy of the
recipe, checked out into a temporary directory), run in each round just before this tree's, so
that background load falls on both alike; each side's MFU is against the peak of the
precision that side's recipe resolved to on this machine. Before/after in one run.
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
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lit_transformer.model.accounting import train_flops  # noqa: E402
from lit_transformer.objectives import CausalLM  # noqa: E402
from lit_transformer.objectives.causal_lm import causal_terms  # noqa: E402
from lit_transformer.objectives.optim import build_optimizer, make_scheduler, parameter_groups  # noqa: E402
from lit_transformer.recipe.load import load_recipe  # noqa: E402
from lit_transformer.recipe.model_section import model_config  # noqa: E402
from lit_transformer.training.callbacks import keep_freed_memory  # noqa: E402
from lit_transformer.training.rundir import read_metrics  # noqa: E402


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeat: int = 5) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)
    best = 0.0
    for _ in range(repeat):
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


def bare_loop(cfg, steps: int) -> float:
    """Tokens per second of fwd + loss + bwd + clip + optimizer + schedule, nothing else."""
    model_cfg = model_config(cfg)
    module = CausalLM(model_cfg, optim=cfg.optim, max_steps=cfg.trainer.max_steps)
    groups = parameter_groups(module, cfg.optim.weight_decay, muon=cfg.optim.optimizer == "muon")
    optimizer = build_optimizer(groups, cfg.optim)
    scheduler = make_scheduler(optimizer, cfg.optim, cfg.trainer.max_steps, model_cfg.d_model)
    B, T = cfg.data.batch_size, cfg.data.block_size
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(5, model_cfg.vocab_size, (B, T + 1), generator=g)
    batch = {"input_ids": rows[:, :-1], "attention_mask": torch.ones(B, T, dtype=torch.long), "labels": rows[:, 1:]}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.trainer.precision == "bf16-mixed")

    def step():
        with autocast:
            loss_sum, _, count = causal_terms(module.model, batch, 0.0, fused=True)
            loss = loss_sum / count
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.trainer.gradient_clip_val or 1e9)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

    # as `pretrain` does during fit; malloc left alone when the key is false
    kept = cfg.trainer.keep_freed_memory and keep_freed_memory(True)
    try:
        for _ in range(5):
            step()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return B * T * steps / (time.perf_counter() - start)
    finally:
        if kept:
            keep_freed_memory(False)


def full_path(recipe: str, overrides: list[str], steps: int, root: Path = ROOT) -> float:
    """train/tokens_per_s of `pretrain` run from the source tree `root`."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        args = [
            sys.executable,
            "-m",
            "lit_transformer.commands.cli",
            "pretrain",
            str(root / recipe),
            *overrides,
            f"trainer.max_steps={steps}",
            f"trainer.val_check_interval={steps * 10}",
            f"trainer.checkpoint_every_n_steps={steps * 10}",
            "trainer.log_every_n_steps=10",
            "trainer.max_time=null",
            "generation.enabled=false",
            "logger.wandb.mode=disabled",
            f"run.dir={run}",
        ]
        env = {**os.environ, "PYTHONPATH": str(root)}
        subprocess.run(args, check=True, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        speeds = [r["train/tokens_per_s"] for r in read_metrics(run) if "train/tokens_per_s" in r]
    return sum(speeds[1:]) / max(len(speeds) - 1, 1)  # after the first window (start-up)


def checkout(revision: str, into: Path) -> Path:
    """The tree of git `revision` (a commit, tag or branch) written under `into`."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", revision], cwd=ROOT, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def resolved_precision(root: Path, recipe: str, overrides: list[str]) -> str:
    """trainer.precision as the tree at `root` resolves the recipe on this machine."""
    code = (
        "import sys; from lit_transformer.recipe.load import load_recipe; "
        "print(load_recipe(sys.argv[1], sys.argv[2:]).trainer.precision)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(root / recipe), *overrides],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    return out.stdout.strip().splitlines()[-1]


def spread(values: list[float]) -> dict[str, float]:
    """The median over rounds with the range: the project's rule for a figure (never the best)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def spread_text(s: dict[str, float]) -> str:
    return f"{s['median']:,.4g} ({s['min']:,.4g}-{s['max']:,.4g})"


def peak_of(precision: str, peaks: dict) -> float:
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float32
    if dtype not in peaks:
        peaks[dtype] = matmul_peak(dtype)
    return peaks[dtype]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default=str(ROOT / "recipes" / "tiny-clm.yaml"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--before", metavar="REF", help="also measure the full path of this git revision")
    p.add_argument(
        "--rounds",
        "--repeats",
        type=int,
        default=5,
        help="rounds of bare loop and full path (and --before's full path): the median is reported, with the range",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.steps < 20:  # the full path logs every 10 steps and its first window is start-up
        p.error(f"--steps {args.steps}: needs at least 20 (the first 10-step window is start-up, not measured)")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: needs at least 1 (5 or more for a figure: the median with its range)")
    recipe = str(Path(args.recipe).resolve().relative_to(ROOT))
    cfg = load_recipe(ROOT / recipe, args.override)
    torch.set_num_threads(cfg.trainer.num_threads or torch.get_num_threads())
    model_cfg = model_config(cfg)
    flops_per_token = train_flops(model_cfg, cfg.data.block_size).total / cfg.data.block_size
    peaks: dict = {}
    peak = peak_of(cfg.trainer.precision, peaks)
    bares, fulls, befores = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        old_root = checkout(args.before, Path(tmp)) if args.before else None
        for _ in range(args.rounds):  # one round's runs share the load of the moment
            bares.append(bare_loop(cfg, args.steps))
            if old_root is not None:
                befores.append(full_path(recipe, args.override, args.steps, old_root))
            fulls.append(full_path(recipe, args.override, args.steps))
        old_precision = resolved_precision(old_root, recipe, args.override) if old_root else None
    bare, full = spread(bares), spread(fulls)
    out = {
        "recipe": Path(recipe).stem,
        "threads": torch.get_num_threads(),
        "precision": cfg.trainer.precision,
        "rounds": args.rounds,
        "flops_per_token": flops_per_token,
        "matmul_peak_gflops": peak / 1e9,
        "bare_tokens_per_s": bare,
        "bare_mfu": bare["median"] * flops_per_token / peak,
        "full_tokens_per_s": full,
        "full_mfu": full["median"] * flops_per_token / peak,
        "overhead": spread([1 - f / b for f, b in zip(fulls, bares)]),
    }
    if old_root is not None:
        before = spread(befores)
        old_peak = peak_of(old_precision, peaks)
        out.update(
            {
                "before": args.before,
                "before_precision": old_precision,
                "before_matmul_peak_gflops": old_peak / 1e9,
                "before_tokens_per_s": before,
                "before_mfu": before["median"] * flops_per_token / old_peak,
                "speedup": spread([f / b for f, b in zip(fulls, befores)]),
            }
        )
    out.update({"bare_runs": bares, "full_runs": fulls, **({"before_runs": befores} if befores else {})})
    if args.json:
        print(json.dumps(out))
        return
    for key, value in out.items():
        if isinstance(value, dict):
            text = spread_text(value)
        elif isinstance(value, list):
            text = ", ".join(f"{v:,.4g}" for v in value)
        else:
            text = f"{value:,.4g}" if isinstance(value, float) else str(value)
        print(f"{key:<26} {text}")


if __name__ == "__main__":
    main()
