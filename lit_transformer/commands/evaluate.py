"""`evaluate --suite FILE / --eval NAME / --all-checkpoints / --lm-eval TASKS`: the named
evaluations of the recipe's `eval` section (evaluation/), outside training, on a run, a
checkpoint, a final model directory or an exported transformers directory. The numbers are
the ones training logs for the same weights: the same evaluation code, the run's config and
tokenizer, the run's autocast.
"""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lit_transformer.commands.loading import (
    Source,
    load_for_evaluation,
    load_language_model,
    resolve_source,
    source_objective,
)
from lit_transformer.commands.train import cpu_threads, data_module
from lit_transformer.errors import RunError
from lit_transformer.evaluation.callback import eval_target
from lit_transformer.evaluation.suite import build_suite, run_suite
from lit_transformer.recipe import registry
from lit_transformer.recipe.eval_schema import EvalConfig
from lit_transformer.recipe.load import load_suite
from lit_transformer.recipe.schema import RunConfig
from lit_transformer.training.checkpoints import checkpoint_step
from lit_transformer.training.rundir import CHECKPOINT_DIR

CURVE_CSV = "eval_curve.csv"  # --all-checkpoints' output in the run directory


def evaluate_suite(
    target: str,
    *,
    suite: str | None = None,
    eval_names: Sequence[str] = (),
    all_checkpoints: bool = False,
    lm_eval_tasks: str | Sequence[str] | None = None,
    lm_eval_include: str | None = None,
    limit: int | None = None,
    output: str | None = None,
) -> dict[str, Any]:
    """The evaluations of `suite` (a YAML file with an `eval:` list) and the run's own named
    `eval_names` (none of either: all of the run's own), as `eval/<name>/<metric>`, and the
    harness tasks `lm_eval_tasks` as `lm_eval/<task>/<metric>`. `limit` caps every evaluation's
    examples. With `all_checkpoints`, every kept checkpoint of the run in step order: the rows
    go to `output` (CSV; default the run's eval_curve.csv) and come back under "checkpoints"."""
    if limit is not None and limit <= 0:
        raise RunError(f"--limit {limit}: must be a positive number of examples")
    source = resolve_source(target)
    cfg = run_config(source, target)
    entries = chosen_entries(cfg, suite, eval_names, target, harness=bool(lm_eval_tasks))
    if limit is not None:
        entries = [dataclasses.replace(e, max_examples=min(limit, e.max_examples or limit)) for e in entries]
    tasks = [t for t in lm_eval_tasks.split(",") if t] if isinstance(lm_eval_tasks, str) else list(lm_eval_tasks or [])
    with cpu_threads(cfg.trainer.num_threads):
        evaluations = build_suite(entries, cfg)
        dm = data_module(cfg, None)
        if not all_checkpoints:
            return {
                "target": str(source.path),
                **_evaluate_one(source, cfg, dm, evaluations, tasks, lm_eval_include, limit),
            }
        if source.run_dir is None:
            raise RunError(f"{target}: --all-checkpoints needs a run directory (it reads <run>/{CHECKPOINT_DIR}/)")
        rows = []
        for step, path in kept_checkpoints(source.run_dir):
            one = Source("checkpoint", path, source.run_dir, source.tokenizer)
            rows.append({"step": step, **_evaluate_one(one, cfg, dm, evaluations, tasks, lm_eval_include, limit)})
    curve = Path(output) if output is not None else source.run_dir / CURVE_CSV
    write_curve(rows, curve)
    return {"target": str(source.run_dir), "curve": str(curve), "checkpoints": rows}


def _evaluate_one(
    source: Source,
    cfg: RunConfig,
    dm: Any,
    evaluations: list,
    tasks: list[str],
    include: str | None,
    limit: int | None,
) -> dict[str, float]:
    module = load_for_evaluation(source, cfg, dm)
    target = eval_target(module, cfg, dm.tokenizer, dm.special_tokens)
    out = run_suite(evaluations, target, final=True)
    if tasks:
        from lit_transformer.evaluation.harness import run_harness

        harness = run_harness(target, tasks, include_path=include, limit=limit)
        out.update({f"lm_eval/{key}": value for key, value in harness.items()})
    return out


def run_config(source: Source, target: str) -> RunConfig:
    """The run's config with its tokenizer; for a model directory outside a run (an exported
    transformers model), the defaults for its architecture's objective and its tokenizer.json."""
    if source.tokenizer is None:
        raise RunError(f"{target}: evaluate needs the model's tokenizer.json beside it (in the run or model directory)")
    cfg = source.run_config
    if cfg is None:
        arch = load_language_model(source).config.arch
        cfg = RunConfig()
        cfg.objective.name = source_objective(source) if source.kind == "model" else registry.DEFAULT_FOR_ARCH[arch]
        cfg.model.arch = arch
    return dataclasses.replace(cfg, tokenizer=dataclasses.replace(cfg.tokenizer, path=str(source.tokenizer)))


def chosen_entries(
    cfg: RunConfig, suite: str | None, names: Sequence[str], target: str, *, harness: bool
) -> list[EvalConfig]:
    own = {e.name: e for e in cfg.eval}
    for name in names:
        if name not in own:
            listed = ", ".join(own) or "none"
            raise RunError(f"--eval {name}: {target} names no such evaluation (its eval section has: {listed})")
    entries = [own[n] for n in names]
    if suite is not None:
        entries += load_suite(suite)
    if not entries and not harness:
        entries = list(cfg.eval)
        if not entries:
            raise RunError(f"{target}: its recipe has no eval section; give --suite FILE or --lm-eval TASKS")
    seen = set()
    for entry in entries:
        if entry.name in seen:
            raise RunError(f"eval {entry.name}: named twice (by --eval and in --suite); rename one")
        seen.add(entry.name)
    return entries


def kept_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every readable checkpoint in the run, by step; last.ckpt only where no
    step-N checkpoint holds the same step."""
    found: dict[int, Path] = {}
    for path in sorted(Path(run_dir, CHECKPOINT_DIR).glob("*.ckpt"), key=lambda p: p.name == "last.ckpt"):
        step = checkpoint_step(path)
        if step is not None and step not in found:
            found[step] = path
    if not found:
        raise RunError(f"{run_dir}: no readable checkpoint in {CHECKPOINT_DIR}/")
    return sorted(found.items())


def write_curve(rows: list[dict[str, Any]], path: Path) -> None:
    """Rows of step and metrics as CSV (atomically: a failed write leaves the old file)."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(path.name + ".tmp")
    with temp.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    temp.replace(path)
