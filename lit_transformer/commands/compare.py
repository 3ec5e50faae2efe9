"""`lit-transformer compare`: the final metrics of several runs side by side, one row per run,
as a markdown table or JSON, without W&B.

A run's values are its metrics.json (the final validation and test metrics, and named
evaluations' `eval/<name>/<metric>`). A val/, test/, eval/ or lm_eval/ metric that the CSV log
holds and metrics.json does not (a run stopped before its end writes no metrics.json) is taken
as its last logged value: the table marks it with `*` and says so under the table.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lit_transformer.commands.plot import run_labels, select_metrics
from lit_transformer.errors import RunError
from lit_transformer.training.rundir import METRICS_JSON, read_metrics

# CSV columns that count as final metrics when metrics.json lacks them; training curves
# (train/loss, train/lr, ...) are no run's result and stay out, unless a --metric names them.
CSV_PREFIXES = ("val/", "test/", "eval/", "lm_eval/")
CSV_MARK = "*"
MISSING = "—"


@dataclass(frozen=True)
class Comparison:
    values: dict[str, dict[str, float | str]]  # {run label: {metric: value}}
    columns: list[str]  # the metrics shown, in order
    from_csv: set[tuple[str, str]] = field(default_factory=set)  # (run, metric): a last logged value


def _read_json(run: Path) -> dict[str, float | str]:
    path = run / METRICS_JSON
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise RunError(f"{path}: not JSON ({error})") from None
    if not isinstance(data, dict):
        raise RunError(f"{path}: not a JSON object of metrics")
    return data


def _order(name: str) -> tuple[int, str]:
    """Validation first, then test, then named evaluations and harness tasks, then the rest; by
    name within each."""
    return next((i for i, p in enumerate(CSV_PREFIXES) if name.startswith(p)), len(CSV_PREFIXES)), name


def compare(runs: Sequence[str | Path], metrics: Sequence[str] = ()) -> Comparison:
    """Each run's final metrics. `metrics`: glob patterns (fnmatch; `*` also crosses `/`) over
    metrics.json's keys and the CSV log's columns, each of which must match something; default:
    every key of metrics.json and every val/, test/, eval/ and lm_eval/ column of the CSV log."""
    if not runs:
        raise RunError("no run directory given")
    found: dict[str, dict[str, float | str]] = {}
    logged: dict[str, dict[str, float]] = {}
    for label, run in zip(run_labels(runs), runs):
        run = Path(run)
        if not run.is_dir():
            raise RunError(f"{run}: not a run directory")
        found[label] = _read_json(run)
        last: dict[str, float] = {}
        for row in read_metrics(run):
            last.update(row)  # rows are in logged order: the last value of each column wins
        logged[label] = last
        if not found[label] and not last:
            raise RunError(f"{run}: neither {METRICS_JSON} nor CSV logs (not a run directory, or not trained yet)")
    if metrics:
        available = sorted({k for d in (*found.values(), *logged.values()) for k in d} - {"step", "epoch"})
        columns = select_metrics(available, metrics)
    else:
        names = {k for d in found.values() for k in d}
        names |= {k for d in logged.values() for k in d if k.startswith(CSV_PREFIXES)}
        columns = sorted(names, key=_order)
    values: dict[str, dict[str, float | str]] = {}
    from_csv: set[tuple[str, str]] = set()
    for label in found:
        values[label] = {}
        for metric in columns:
            if metric in found[label]:
                values[label][metric] = found[label][metric]
            elif metric in logged[label]:
                values[label][metric] = logged[label][metric]
                from_csv.add((label, metric))
    return Comparison(values=values, columns=columns, from_csv=from_csv)


def format_value(value: float | str) -> str:
    """4 significant digits, without an exponent between 0.001 and 100000 (0.01234, 3.142,
    1235, 12346); integers as they are; text as it is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    magnitude = abs(value)
    if 1e-3 <= magnitude < 1e5:
        decimals = max(0, 3 - math.floor(math.log10(magnitude)))
        return f"{value:.{decimals}f}"
    return f"{value:.4g}"


def to_markdown(comparison: Comparison) -> str:
    """One row per run, one column per metric, numbers right-aligned; a missing value is `—`,
    a last logged CSV value is marked `*` and footnoted."""
    header = ["run", *comparison.columns]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * len(comparison.columns)]
    for label, row in comparison.values.items():
        cells = [label]
        for metric in comparison.columns:
            if metric not in row:
                cells.append(MISSING)
                continue
            mark = CSV_MARK if (label, metric) in comparison.from_csv else ""
            cells.append(format_value(row[metric]) + mark)
        lines.append("| " + " | ".join(cells) + " |")
    if comparison.from_csv:
        lines += ["", f"{CSV_MARK} not in the run's {METRICS_JSON}: the last value in its CSV log."]
    return "\n".join(lines)
