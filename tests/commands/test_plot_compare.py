"""`plot` and `compare` on run directories written by hand (Lightning's CSVLogger layout and a
metrics.json), and evaluate's suite flags parsed and dispatched; nothing trains."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from lit_transformer.commands import cli
from lit_transformer.commands.compare import compare, format_value, to_markdown
from lit_transformer.commands.plot import plot, plot_data
from lit_transformer.errors import RunError
from lit_transformer.training.rundir import CSV_DIR, METRICS_JSON

ROOT = Path(__file__).resolve().parents[2]


def write_run(root: Path, name: str, versions: list[list[dict]], final: dict | None = None) -> Path:
    """A run directory: one csv/version_N/metrics.csv per list of rows (columns the union of the
    rows' keys, empty cells where a row lacks one, as CSVLogger writes), and metrics.json."""
    run = root / name
    for i, rows in enumerate(versions):
        folder = run / CSV_DIR / f"version_{i}"
        folder.mkdir(parents=True)
        columns = sorted({k for row in rows for k in row})
        with (folder / "metrics.csv").open("w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
    run.mkdir(parents=True, exist_ok=True)
    if final is not None:
        (run / METRICS_JSON).write_text(json.dumps(final))
    return run


def train_rows(steps, losses, tokens_per_step=None):
    rows = []
    for step, loss in zip(steps, losses):
        row = {"epoch": 0, "step": step, "train/loss": loss, "train/lr": 1e-3}
        if tokens_per_step is not None:
            row["train/tokens_seen"] = tokens_per_step * (step + 1)
        rows.append(row)
    return rows


@pytest.fixture
def two_runs(tmp_path):
    """run a: resumed once (version_1 restarts at step 2 and replaces a's step-2 row); run b:
    one version, no metrics.json, a named evaluation with a time."""
    a = write_run(
        tmp_path,
        "a",
        [
            [*train_rows([0, 1, 2], [5.0, 4.0, 9.9]), {"epoch": 0, "step": 1, "val/loss": 4.5, "val/ppl": 90.0}],
            [
                *train_rows([2, 3], [3.0, 2.5]),
                {"epoch": 0, "step": 3, "val/loss": 2.75, "val/ppl": 15.6, "val/bpb": 1.25},
            ],
        ],
        final={"val/loss": 2.7, "val/ppl": 14.87973, "val/bpb": 1.234567, "eval/probe/accuracy": 0.5},
    )
    b = write_run(
        tmp_path,
        "b",
        [
            [
                *train_rows([0, 2, 4], [6.0, 3.5, 2.0]),
                {"epoch": 0, "step": 4, "val/loss": 2.25, "eval/probe/accuracy": 0.625, "eval/probe/seconds": 3.0},
            ]
        ],
    )
    return a, b


# ----------------------------------------------------------------------------- plot


def test_plot_draws_each_runs_logged_values_in_default_panels(two_runs, tmp_path):
    out = tmp_path / "figs" / "curves.png"
    curves = plot(two_runs, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 1000
    # in DEFAULT_PATTERNS' order: train/loss, val/ losses, bpb (not ppl), then eval/ but */seconds
    assert list(curves) == ["train/loss", "val/loss", "val/bpb", "eval/probe/accuracy"]
    # run a's step-2 loss is version_1's, which replaced version_0's rows from step 2 on
    assert curves["train/loss"] == {"a": ([0, 1, 2, 3], [5.0, 4.0, 3.0, 2.5]), "b": ([0, 2, 4], [6.0, 3.5, 2.0])}
    assert curves["val/loss"] == {"a": ([1, 3], [4.5, 2.75]), "b": ([4], [2.25])}
    assert curves["val/bpb"] == {"a": ([3], [1.25])}  # b never logged it: no series
    assert curves["eval/probe/accuracy"] == {"b": ([4], [0.625])}


def test_a_run_keeps_its_colour_in_every_panel(tmp_path, monkeypatch):
    """The second run lacks the first panel's metric: its line must not take the first run's colour."""
    from matplotlib.figure import Figure

    a = write_run(tmp_path, "a", [[{"step": 1, "eval/x/acc": 0.1, "eval/y/acc": 0.2}]])
    b = write_run(tmp_path, "b", [[{"step": 1, "eval/y/acc": 0.3}]])
    drawn = {}
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kwargs: drawn.update(figure=self))
    plot([b, a], tmp_path / "c.png", ["eval/x/acc", "eval/y/acc"])
    colours = [{line.get_label(): line.get_color() for line in ax.get_lines()} for ax in drawn["figure"].axes]
    assert colours[0] == {"a": colours[1]["a"]} and colours[1]["a"] != colours[1]["b"]


def test_metric_patterns_choose_the_panels_in_pattern_order(two_runs):
    curves = plot_data(two_runs, ["val/p*", "eval/*", "train/loss"])
    assert list(curves) == ["val/ppl", "eval/probe/accuracy", "eval/probe/seconds", "train/loss"]
    assert curves["val/ppl"] == {"a": ([1, 3], [90.0, 15.6])}


def test_tokens_axis_reads_the_tokens_seen_column(tmp_path):
    run = write_run(
        tmp_path,
        "t",
        [[*train_rows([0, 1, 3], [3.0, 2.0, 1.0], tokens_per_step=100), {"step": 2, "val/loss": 2.5}]],
    )
    curves = plot_data([run], ["train/loss", "val/loss"], x="tokens")
    assert curves["train/loss"]["t"] == ([100, 200, 400], [3.0, 2.0, 1.0])
    assert curves["val/loss"]["t"] == ([300], [2.5])  # step 2 lies between logged steps 1 and 3


def test_runs_with_one_name_are_labelled_by_path(tmp_path):
    first = write_run(tmp_path / "x", "seed0", [train_rows([0], [1.0])])
    second = write_run(tmp_path / "y", "seed0", [train_rows([0], [2.0])])
    assert plot_data([first, second])["train/loss"] == {str(first): ([0], [1.0]), str(second): ([0], [2.0])}


def test_plot_errors_are_one_line_naming_what_is_wrong(two_runs, tmp_path):
    with pytest.raises(RunError, match=r"nowhere: not a run directory"):
        plot_data([tmp_path / "nowhere"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunError, match=r"empty: no CSV logs \(csv/version_\*/metrics.csv"):
        plot_data([tmp_path / "empty"])
    with pytest.raises(RunError, match=r"--metric 'val/nope\*' matches no metric of the runs \(they have: .*val/loss"):
        plot_data(two_runs, ["train/loss", "val/nope*"])
    with pytest.raises(RunError, match=r"--x tokens: a's logs have no tokens-seen column"):
        plot_data(two_runs, x="tokens")


def test_plot_without_matplotlib_names_the_extra(two_runs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import raises ImportError
    with pytest.raises(RunError, match=r'plot needs matplotlib: pip install "lit-transformer\[plot\]"'):
        plot(two_runs, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


# ----------------------------------------------------------------------------- compare


def test_compare_takes_metrics_json_and_marks_last_logged_values(two_runs):
    comparison = compare(two_runs)
    assert comparison.columns == ["val/bpb", "val/loss", "val/ppl", "eval/probe/accuracy", "eval/probe/seconds"]
    assert comparison.values == {
        "a": {"val/bpb": 1.234567, "val/loss": 2.7, "val/ppl": 14.87973, "eval/probe/accuracy": 0.5},
        "b": {"val/loss": 2.25, "eval/probe/accuracy": 0.625, "eval/probe/seconds": 3.0},  # no metrics.json
    }
    assert comparison.from_csv == {("b", "val/loss"), ("b", "eval/probe/accuracy"), ("b", "eval/probe/seconds")}
    assert to_markdown(comparison).splitlines() == [
        "| run | val/bpb | val/loss | val/ppl | eval/probe/accuracy | eval/probe/seconds |",
        "|---|---:|---:|---:|---:|---:|",
        "| a | 1.235 | 2.700 | 14.88 | 0.5000 | — |",
        "| b | — | 2.250* | — | 0.6250* | 3* |",
        "",
        "* not in the run's metrics.json: the last value in its CSV log.",
    ]


def test_compare_patterns_reach_csv_columns_and_must_match(two_runs):
    comparison = compare(two_runs, ["train/loss", "val/loss"])
    assert comparison.values == {"a": {"train/loss": 2.5, "val/loss": 2.7}, "b": {"train/loss": 2.0, "val/loss": 2.25}}
    assert "*" not in to_markdown(compare([two_runs[0]], ["val/*"]))  # all from metrics.json: no footnote
    with pytest.raises(RunError, match=r"--metric 'bleu' matches no metric"):
        compare(two_runs, ["bleu"])


def test_compare_refuses_a_directory_without_metrics(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunError, match=r"empty: neither metrics.json nor CSV logs"):
        compare([tmp_path / "empty"])
    with pytest.raises(RunError, match=r"missing: not a run directory"):
        compare([tmp_path / "missing"])


@pytest.mark.parametrize(
    "value, text",
    [(2.7, "2.700"), (14.87973, "14.88"), (0.0123456, "0.01235"), (1234.56, "1235"), (123456.7, "1.235e+05"),
     (0.000123456, "0.0001235"), (-3.14159, "-3.142"), (3.0, "3"), (float("nan"), "nan"), ("sig|1.0", "sig|1.0")],
)  # fmt: skip
def test_numbers_keep_four_significant_digits(value, text):
    assert format_value(value) == text


# ----------------------------------------------------------------------------- the command line


def test_cli_compare_json_and_markdown(two_runs, capsys):
    assert cli.main(["compare", *map(str, two_runs), "--json", "--metric", "val/loss"]) == 0
    assert json.loads(capsys.readouterr().out) == {"a": {"val/loss": 2.7}, "b": {"val/loss": 2.25}}
    assert cli.main(["compare", *map(str, two_runs)]) == 0
    assert "| a | 1.235 | 2.700 |" in capsys.readouterr().out


def test_cli_plot_writes_the_image_and_errors_are_one_line(two_runs, tmp_path, capsys):
    out = tmp_path / "c.png"
    assert cli.main(["plot", *map(str, two_runs), "--metric", "val/*", "--output", str(out)]) == 0
    assert out.is_file() and "3 panels (val/bpb, val/loss, val/ppl)" in capsys.readouterr().out
    assert cli.main(["plot", str(two_runs[0]), "--metric", "nope", "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --metric 'nope' matches no metric") and "\n" not in err


def fake_suite(monkeypatch, evaluate_suite) -> None:
    """cli imports commands.evaluate when it dispatches: a stand-in module, so that nothing loads."""
    fake = types.SimpleNamespace(evaluate_suite=evaluate_suite, EvaluateDecoding=dict)
    monkeypatch.setitem(sys.modules, "lit_transformer.commands.evaluate", fake)


DECODING = dict(
    num_beams=None,
    length_penalty=None,
    max_new_tokens=None,
    batch_size=256,
    batch_tokens=8192,
    dtype="auto",
    device="auto",
    progress_bar=True,
)
SUITE_CALL = dict(
    split=None,
    data=None,
    data_target=None,
    task=None,
    max_batches=None,
    suite=None,
    eval_names=(),
    all_checkpoints=False,
    lm_eval_tasks=None,
    lm_eval_include=None,
    limit=None,
    output=None,
    decoding=DECODING,
)


@pytest.mark.parametrize(
    "flags, expected",
    [
        ([], {}),
        (["--suite", "s.yaml"], dict(suite="s.yaml")),
        (["--eval", "probe", "--eval", "heldout"], dict(eval_names=("probe", "heldout"))),
        (["--all-checkpoints", "--output", "c.csv"], dict(all_checkpoints=True, output="c.csv")),
        (
            ["--lm-eval", "hellaswag, arc_easy", "--lm-eval-include", "tasks/", "--limit", "5"],
            dict(lm_eval_tasks="hellaswag, arc_easy", lm_eval_include="tasks/", limit=5),
        ),
        (  # the split and --data entries go with the named ones
            ["--split", "test", "--data", "x.txt", "--task", "clm", "--max-batches", "3", "--suite", "s.yaml"],
            dict(split="test", data="x.txt", task="clm", max_batches=3, suite="s.yaml"),
        ),
        (
            ["--data", "s.de", "--data-target", "s.en", "--num-beams", "4", "--dtype", "float32", "--batch-size", "8"],
            dict(
                data="s.de",
                data_target="s.en",
                decoding={**DECODING, "num_beams": 4, "dtype": "float32", "batch_size": 8},
            ),
        ),
    ],
)
def test_evaluate_flags_dispatch_to_evaluate_suite(flags, expected, monkeypatch, capsys):
    calls = []
    fake_suite(monkeypatch, lambda target, **kw: calls.append((target, kw)) or {"eval/x/acc": 0.5})
    assert cli.main(["evaluate", "runs/r", *flags, "--json"]) == 0
    assert calls == [("runs/r", {**SUITE_CALL, **expected})]
    assert json.loads(capsys.readouterr().out) == {"eval/x/acc": 0.5}


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--output", "c.csv"], "evaluate: --output names the file --all-checkpoints writes"),
        (["--lm-eval-include", "d/"], "evaluate: --lm-eval-include adds task files for --lm-eval"),
        (["--lm-eval", ","], "evaluate: --lm-eval ',' names no task"),
        (["--suite", "s.yaml", "--limit", "0"], "evaluate: --limit 0: at least 1"),
        (["--max-batches", "0"], "evaluate: --max-batches 0: at least 1"),
        (["--data-target", "ref.txt"], "evaluate: --data-target ref.txt needs --data"),
        (["--data", "missing.txt"], "evaluate: --data missing.txt: no such file"),
        (["--suite", "s.yaml", "--task", "clm"], "evaluate: --task applies to the run's split or --data"),
        (["--lm-eval", "hellaswag", "--max-batches", "3"], "evaluate: --max-batches applies to the run's split"),
        (["--batch-tokens", "0"], "--batch-tokens 0 must be at least 1"),
    ],
)
def test_evaluate_flags_that_cannot_apply_are_one_line_errors(flags, message, tmp_path, monkeypatch, capsys):
    """Refused before the run is read: runs/r does not exist."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["evaluate", "runs/r", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {message}") and "\n" not in err


@pytest.mark.parametrize("command", ["plot", "compare"])
def test_help_answers_without_torch(command):
    probe = (
        "import sys\nfrom lit_transformer.commands.cli import main\ntry:\n    main(sys.argv[1:])\n"
        "except SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'lightning', 'matplotlib') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert f"usage: lit-transformer {command}" in done.stdout
    assert done.stdout.strip().endswith("[]"), done.stdout
