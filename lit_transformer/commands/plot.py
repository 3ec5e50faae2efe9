"""`lit-transformer plot`: the curves of one or more runs from their CSV logs, one panel per
metric and one series per run, into an image file, for runs trained offline (no W&B page).

The rows come from `rundir.read_metrics` (every CSV version of a resumed run, in order). The x
axis is the optimizer step, or with `x="tokens"` the training tokens seen, read from a cumulative
tokens column where the logs have one (TOKEN_COLUMNS). matplotlib is an optional dependency (the
`plot` extra) and is imported only when a figure is drawn.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from fnmatch import fnmatchcase
from pathlib import Path

from lit_transformer.errors import RunError
from lit_transformer.training.rundir import CSV_DIR, read_metrics

PLOT_EXTRA = 'pip install "lit-transformer[plot]"'
# What is drawn without --metric: the training loss, the validation metrics that say how good
# the model is (ppl repeats the loss on another scale), and every named evaluation's metric
# except its wall-clock time, which measures the machine, not the model.
DEFAULT_PATTERNS = ("train/loss", "val/*loss", "val/*bpb", "val/*accuracy", "val/*macro_f1", "val/*bleu", "eval/*")
DEFAULT_EXCLUDED = ("eval/*/seconds",)
# Columns of cumulative training tokens (summed over ranks), the first found wins. Not a rate:
# train/tokens_per_s is averaged over a logging window of unknown length and cannot be summed.
TOKEN_COLUMNS = ("train/tokens_seen", "train/tokens")
# Columns every CSV row carries: the axes, never a panel.
AXIS_COLUMNS = ("step", "epoch")
XS = ("step", "tokens")

Curves = dict[str, dict[str, tuple[list[float], list[float]]]]  # {metric: {run: (xs, ys)}}


def run_labels(runs: Sequence[str | Path]) -> list[str]:
    """Each run's legend entry and table row: its directory's name, or the path as given where
    two runs share a name (runs/a/seed0 and runs/b/seed0)."""
    names = [Path(run).resolve().name for run in runs]
    return [name if names.count(name) == 1 else str(run) for name, run in zip(names, runs)]


def read_runs(runs: Sequence[str | Path]) -> dict[str, list[dict[str, float]]]:
    """{label: CSV rows}; a RunError naming the run where it is not a directory or has no rows."""
    if not runs:
        raise RunError("no run directory given")
    out: dict[str, list[dict[str, float]]] = {}
    for label, run in zip(run_labels(runs), runs):
        if not Path(run).is_dir():
            raise RunError(f"{run}: not a run directory")
        rows = read_metrics(run)
        if not rows:
            raise RunError(f"{run}: no CSV logs ({CSV_DIR}/version_*/metrics.csv with rows; was logger.csv=false?)")
        out[label] = rows
    return out


def select_metrics(
    available: Sequence[str], patterns: Sequence[str] = (), *, excluded: Sequence[str] = (), what: str = "metric"
) -> list[str]:
    """The available names matching any of the glob patterns, in pattern order (each pattern's
    matches sorted), without repeats. Given patterns must each match something: a RunError names
    the one that does not and a few names it could have matched. Without patterns, the defaults."""
    chosen: list[str] = []
    for pattern in patterns or DEFAULT_PATTERNS:
        found = sorted(
            name for name in available if fnmatchcase(name, pattern) and not any(fnmatchcase(name, x) for x in excluded)
        )
        if patterns and not found:
            some = ", ".join(sorted(available)[:8]) + (", ..." if len(available) > 8 else "")
            raise RunError(f"--metric {pattern!r} matches no {what} of the runs (they have: {some or 'none'})")
        chosen.extend(name for name in found if name not in chosen)
    if not chosen:
        raise RunError(f"the runs log none of the default metrics ({', '.join(DEFAULT_PATTERNS)}); pass --metric")
    return chosen


def _tokens_at(run: str, rows: list[dict[str, float]]):
    """A function step -> training tokens seen, from the rows that log both: linear between
    logged points, from (0, 0) before the first, at the last rate after the last one (a
    validation row's step need not be a logging step)."""
    column = next((c for c in TOKEN_COLUMNS if any(c in row for row in rows)), None)
    if column is None:
        raise RunError(
            f"--x tokens: {run}'s logs have no tokens-seen column ({' or '.join(TOKEN_COLUMNS)}; "
            "train/tokens_per_s is a rate, not a count); use --x step"
        )
    known = sorted({row["step"]: row[column] for row in rows if "step" in row and column in row}.items())
    steps = [0.0] + [s for s, _ in known]
    tokens = [0.0] + [t for _, t in known]

    def at(step: float) -> float:
        i = min(max(bisect.bisect_right(steps, step), 1), len(steps) - 1)
        s0, s1, t0, t1 = steps[i - 1], steps[i], tokens[i - 1], tokens[i]
        return t0 if s1 == s0 else t0 + (t1 - t0) * (step - s0) / (s1 - s0)

    return at


def plot_data(runs: Sequence[str | Path], metrics: Sequence[str] = (), *, x: str = "step") -> Curves:
    """What `plot` draws: {metric: {run label: (xs, ys)}}, each series in logged order, rows
    with a non-finite value kept (a diverged run shows as a gap). `metrics`: glob patterns
    (fnmatch; `*` also crosses `/`), default DEFAULT_PATTERNS less DEFAULT_EXCLUDED."""
    if x not in XS:
        raise RunError(f"--x {x!r}: not one of {', '.join(XS)}")
    logs = read_runs(runs)
    available = sorted({k for rows in logs.values() for row in rows for k in row} - set(AXIS_COLUMNS))
    chosen = select_metrics(available, metrics, excluded=() if metrics else DEFAULT_EXCLUDED)
    curves: Curves = {metric: {} for metric in chosen}
    for label, rows in logs.items():
        to_x = _tokens_at(label, rows) if x == "tokens" else float
        for metric in chosen:
            points = [(to_x(row["step"]), row[metric]) for row in rows if metric in row and "step" in row]
            if points:
                curves[metric][label] = ([p[0] for p in points], [p[1] for p in points])
    return curves


def plot(runs: Sequence[str | Path], output: str | Path, metrics: Sequence[str] = (), *, x: str = "step") -> Curves:
    """Draw `plot_data(runs, metrics, x=x)` into `output` (PNG, or what its suffix names: .pdf,
    .svg): one panel per metric, up to three a row, one line per run with its label in the
    legend. Returns the data drawn."""
    curves = plot_data(runs, metrics, x=x)
    try:
        # a Figure of its own (Agg canvas), not pyplot: no GUI backend and no global state
        # changed in a notebook or program that calls this
        from matplotlib.figure import Figure
    except ImportError:
        raise RunError(f"plot needs matplotlib: {PLOT_EXTRA}") from None
    columns = min(3, len(curves))
    rows = math.ceil(len(curves) / columns)
    figure = Figure(figsize=(5 * columns, 3.5 * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    # one colour per run in every panel, even where a run lacks a panel's metric
    labels = list(dict.fromkeys(label for series in curves.values() for label in series))
    colours = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    for ax, (metric, series) in zip(axes, curves.items()):
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, label=label, color=colours[label], marker="." if len(xs) < 30 else None)
        ax.set_title(metric)
        ax.set_xlabel("tokens seen" if x == "tokens" else "step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes[len(curves) :]:
        ax.set_visible(False)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        figure.savefig(output, dpi=120)
    except ValueError as error:  # an unknown image format, named by matplotlib
        raise RunError(f"{output}: {error}") from None
    return curves
