"""`evaluate`: named evaluations (evaluation/suite.py) on a run, a checkpoint, a final model
directory or an exported transformers directory, outside training. Everything `evaluate` reports
comes through that one suite: the run's own split (`heldout` with `split`, and a translation run's
`translate` of it), `--data` (`heldout` of the file; with `--data-target`, `translate` too), the
recipe's own entries (`--eval`), a suite file (`--suite`), and lm-evaluation-harness tasks. The
numbers are the ones training logs for the same weights: the same evaluation code, the run's
config and tokenizer, the run's autocast (the translations evaluate makes of the split and `--data` decode in `dtype`;
the recipe's and a suite's translate entries as training did).
"""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lit_transformer.errors import RunError
from lit_transformer.evaluation.batch_generate import BATCH_ROWS, BATCH_TOKENS, check_batching
from lit_transformer.evaluation.callback import eval_target
from lit_transformer.evaluation.suite import build_suite, run_suite
from lit_transformer.machine import cpu_threads
from lit_transformer.recipe import registry
from lit_transformer.recipe.eval_schema import EvalConfig
from lit_transformer.recipe.load import load_suite
from lit_transformer.recipe.schema import RunConfig
from lit_transformer.run.loading import (
    Source,
    load_for_evaluation,
    resolve_source,
    source_model_config,
)
from lit_transformer.run.resolve import evaluation_run
from lit_transformer.training.checkpoints import checkpoint_step
from lit_transformer.training.rundir import CHECKPOINT_DIR, CONFIG_YAML

CURVE_CSV = "eval_curve.csv"  # --all-checkpoints' output in the run directory
DATA_ENTRY = "data"  # the entry name of --data's evaluations (eval/data/..., eval/data_translation/...)
TRANSLATION = "_translation"  # after a heldout entry's name: the translate entry of the same pairs


@dataclasses.dataclass(frozen=True)
class EvaluateDecoding:
    """evaluate's decoding flags. The first three set the translate entries evaluate makes itself
    (None: the recipe's objective.num_beams, objective.length_penalty, data.max_target_length);
    the rest apply to them too (dtype None: the weights as loaded); the recipe's and a suite's
    translate entries decode as training did, so that their numbers are training's."""

    num_beams: int | None = None
    length_penalty: float | None = None
    max_new_tokens: int | None = None
    batch_size: int | None = BATCH_ROWS
    batch_tokens: int | None = BATCH_TOKENS
    dtype: str | None = None
    device: str = "auto"
    progress_bar: bool = False


def evaluate_suite(
    target: str,
    *,
    split: str | None = None,
    data: str | None = None,
    data_target: str | None = None,
    task: str | None = None,
    max_batches: int | None = None,
    suite: str | None = None,
    eval_names: Sequence[str] = (),
    all_checkpoints: bool = False,
    lm_eval_tasks: str | Sequence[str] | None = None,
    lm_eval_include: str | None = None,
    limit: int | None = None,
    output: str | None = None,
    decoding: EvaluateDecoding = EvaluateDecoding(),
) -> dict[str, Any]:
    """Every evaluation asked for, as `eval/<name>/<metric>`: the run's own `split` (validation
    or test; entry `<split>`), the file `data` (entry `data`; with `data_target`, the aligned
    reference file, also `data_translation`), the run's own named `eval_names`, the entries of
    `suite` (a YAML file with an `eval:` list), and the harness tasks `lm_eval_tasks` as
    `lm_eval/<task>/<metric>`. Nothing named: the run's validation split and its recipe's eval
    section, everything training measured. `task`: a mixture's one task (its metrics under the
    single objective's names). `max_batches` caps the split and `data` entries (N evaluation
    batches: max_examples N x data.eval_batch_size), `limit` every evaluation's examples.
    With `all_checkpoints`, every kept checkpoint of the run in step order: the rows go to
    `output` (CSV; default the run's eval_curve.csv) and come back under "checkpoints"."""
    # every flag is checked before the run is read: one that would change nothing is an error
    check_batching(decoding.batch_size, decoding.batch_tokens)
    for flag, value in (("--limit", limit), ("--max-batches", max_batches)):
        if value is not None and value < 1:
            raise RunError(f"evaluate: {flag} {value}: at least 1")
    if output is not None and not all_checkpoints:
        raise RunError("evaluate: --output names the file --all-checkpoints writes; add --all-checkpoints")
    tasks = harness_tasks(lm_eval_tasks, lm_eval_include)
    named = bool(suite or eval_names or tasks or data)
    own = split or (None if named else "validation")
    check_data_flags(own, data, data_target, task, max_batches)
    source = resolve_source(target)
    cfg = evaluation_run(source, target)
    entries = chosen_entries(cfg, suite, eval_names, target, everything=not named)
    cap = None if max_batches is None else max_batches * (cfg.data.eval_batch_size or cfg.data.batch_size)
    made = made_entries(source, cfg, target, own, data, data_target, task, cap, decoding)
    entries = made + entries
    check_unique(entries)
    if limit is not None:
        entries = [dataclasses.replace(e, max_examples=min(limit, e.max_examples or limit)) for e in entries]
    with cpu_threads(cfg.trainer.num_threads):
        evaluations = build_suite(entries, cfg)
        for evaluation in evaluations:
            # the translations evaluate makes of the split and --data decode as asked; the recipe's and a
            # suite's translate entries decode as training did, so that their numbers are training's
            made_here = evaluation.entry.name in {entry.name for entry in made}  # names are unique
            if evaluation.entry.kind == "translate" and decoding.dtype is not None and made_here:
                evaluation.decode_with(
                    batch_size=decoding.batch_size,
                    batch_tokens=decoding.batch_tokens,
                    dtype=decoding.dtype,
                    device=decoding.device,
                    progress_bar=decoding.progress_bar,
                )
        if not all_checkpoints:
            objective, metrics = _evaluate_one(source, cfg, evaluations, tasks, lm_eval_include, limit)
            return {"target": str(source.path), "objective": objective, **metrics}
        if source.run_dir is None:
            raise RunError(f"{target}: --all-checkpoints needs a run directory (it reads <run>/{CHECKPOINT_DIR}/)")
        rows = []
        for step, path in kept_checkpoints(source.run_dir):
            one = Source("checkpoint", path, source.run_dir, source.tokenizer)
            rows.append({"step": step, **_evaluate_one(one, cfg, evaluations, tasks, lm_eval_include, limit)[1]})
    curve = Path(output) if output is not None else source.run_dir / CURVE_CSV
    write_curve(rows, curve)
    return {"target": str(source.run_dir), "curve": str(curve), "checkpoints": rows}


def harness_tasks(tasks: str | Sequence[str] | None, include: str | None) -> list[str]:
    """--lm-eval's task names (comma-separated, or a list)."""
    names = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else tasks
    names = [t for t in names or [] if t]
    if tasks is not None and not names:
        raise RunError(f"evaluate: --lm-eval {tasks!r} names no task (comma-separated names, e.g. hellaswag)")
    if include is not None and not names:
        raise RunError("evaluate: --lm-eval-include adds task files for --lm-eval; add --lm-eval TASKS")
    return names


def check_data_flags(
    split: str | None, data: str | None, data_target: str | None, task: str | None, max_batches: int | None
) -> None:
    """The flags of the entries evaluate makes (made_entries) name something to apply to."""
    if data_target is not None and data is None:
        raise RunError(f"evaluate: --data-target {data_target} needs --data (the source file it aligns with)")
    for flag, path in (("--data", data), ("--data-target", data_target)):
        if path is not None and not Path(path).exists():
            raise RunError(f"evaluate: {flag} {path}: no such file")
    for flag, value in (("--task", task), ("--max-batches", max_batches)):
        if value is not None and split is None and data is None:
            raise RunError(f"evaluate: {flag} applies to the run's split or --data; add --split or --data")


def made_entries(
    source: Source,
    cfg: RunConfig,
    target: str,
    split: str | None,
    data: str | None,
    data_target: str | None,
    task: str | None,
    max_examples: int | None,
    decoding: EvaluateDecoding,
) -> list[EvalConfig]:
    """The entries evaluate makes itself: heldout of the run's `split` and of `data`, and translate
    of the same pairs for a translation run (split) or with `data_target` (checked by the caller)."""
    if split is not None and source.run_config is None:
        raise RunError(
            f"{target}: the run's own {split} split is read with the run's {CONFIG_YAML}, which is not beside "
            "this model; name what to evaluate with --data, --suite or --lm-eval"
        )
    # a translation run (seq2seq with objective.bleu) is scored on its split as training scored it
    translation = (
        split is not None
        and source.run_config.objective.bleu
        and not cfg.tasks
        and registry.spec(cfg.objective.name).prompt_for(source_model_config(source).arch) == "transform"
    )
    beams = dict(
        num_beams=decoding.num_beams, length_penalty=decoding.length_penalty, max_new_tokens=decoding.max_new_tokens
    )
    out = []
    common = dict(max_examples=max_examples)
    if split is not None:
        out.append(EvalConfig(name=split, kind="heldout", split=split, task=task, **common))
        if translation:
            out.append(EvalConfig(name=split + TRANSLATION, kind="translate", split=split, **common, **beams))
    if data is not None:
        files = dict(files=[data], target_files=[data_target] if data_target else [])
        out.append(EvalConfig(name=DATA_ENTRY, kind="heldout", task=task, **files, **common))
        if data_target is not None:
            out.append(EvalConfig(name=DATA_ENTRY + TRANSLATION, kind="translate", **files, **common, **beams))
    unused = [f"--{k.replace('_', '-')}" for k, v in beams.items() if v is not None]
    if unused and not any(e.kind == "translate" for e in out):
        raise RunError(
            f"evaluate: {unused[0]} sets the translation of a translation run's split or of --data with "
            "--data-target; nothing here is translated"
        )
    return out


def _evaluate_one(
    source: Source, cfg: RunConfig, evaluations: list, tasks: list[str], include: str | None, limit: int | None
) -> tuple[str, dict[str, Any]]:
    """(the objective the source holds, its metrics)."""
    from lit_transformer.data.tokens.tokenizer import SpecialTokens, load_tokenizer

    tokenizer = load_tokenizer(source.tokenizer)
    special = SpecialTokens.from_tokenizer(tokenizer)
    module = load_for_evaluation(source, cfg, ModelData(tokenizer, special))
    target = eval_target(module, cfg, tokenizer, special)
    out: dict[str, Any] = run_suite(evaluations, target, final=True)
    for evaluation in evaluations:  # translate's signatures (strings), dtype and speed
        out.update({f"eval/{evaluation.entry.name}/{k}": v for k, v in getattr(evaluation, "details", {}).items()})
    if tasks:
        from lit_transformer.evaluation.harness import run_harness

        harness = run_harness(target, tasks, include_path=include, limit=limit)
        out.update({f"lm_eval/{key}": value for key, value in harness.items()})
    return module.objective_name, out


@dataclasses.dataclass
class ModelData:
    """What an objective reads of its data when evaluate rebuilds it around saved weights
    (from_final): the tokenizer, and bytes per token, which every heldout evaluation measures on
    its own set before it reports bits per byte (measure_bytes_on). 1.0 stands in until then: a
    module built with None would never report them."""

    tokenizer: Any
    special_tokens: Any
    bytes_per_token: float = 1.0
    label_names: list | None = None

    def bytes_per_token_of(self, task: int, split: str = "validation") -> float:
        return self.bytes_per_token


def chosen_entries(cfg: RunConfig, suite: str | None, names: Sequence[str], target: str, *, everything: bool):
    """The run's own entries named `names` (`everything`: all of them) and those of `suite`."""
    own = {e.name: e for e in cfg.eval}
    for name in names:
        if name not in own:
            listed = ", ".join(own) or "none"
            raise RunError(f"--eval {name}: {target} names no such evaluation (its eval section has: {listed})")
    entries = list(cfg.eval) if everything else [own[n] for n in names]
    return entries + (load_suite(suite) if suite is not None else [])


def check_unique(entries: Sequence[EvalConfig]) -> None:
    seen = set()
    for entry in entries:
        if entry.name in seen:
            raise RunError(f"eval {entry.name}: named twice (by --eval, --suite, --split or --data); rename one")
        seen.add(entry.name)


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
