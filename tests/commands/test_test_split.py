"""data.test_files: a run that names a test split evaluates it once training ends (test/... in
metrics.json and the CSV log), `evaluate --split test` evaluates it again, and a data source
that cannot read a test split refuses the key instead of ignoring it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import RECIPES, TINY_RUN

from lit_transformer.commands.cli import main
from lit_transformer.training.rundir import read_metrics

# TINY_RUN for 3 steps, validated (and tested) at the last
TINY = [
    *TINY_RUN,
    "trainer.max_steps=3",
    "trainer.val_check_interval=3",
    "trainer.checkpoint_every_n_steps=3",
]


def paragraphs(seed: int, count: int) -> str:
    """Different English-like text per seed (one document per blank-line separated paragraph)."""
    words = "the a model reads text and writes tokens into blocks of data for every step of training".split()
    out = []
    for p in range(count):
        n = 20 + (seed * 7 + p * 3) % 17
        out.append(" ".join(words[(seed + p * 5 + i * (i + seed)) % len(words)] for i in range(n)) + ".")
    return "\n\n".join(out) + "\n"


def corpus(tmp_path: Path) -> dict[str, Path]:
    files = {"train": (1, 200), "val": (2, 20), "test": (3, 20)}
    out = {}
    for split, (seed, count) in files.items():
        out[split] = tmp_path / f"{split}.txt"
        out[split].write_text(paragraphs(seed, count))
    return out


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread", "private_cache")
def test_a_named_test_split_is_evaluated_after_training_and_by_evaluate(tmp_path, capsys):
    files = corpus(tmp_path)
    run = tmp_path / "run"
    args = [
        "pretrain",
        str(RECIPES / "tiny-clm.yaml"),
        *TINY,
        f"data.train_files=[{files['train']}]",
        f"data.val_files=[{files['val']}]",
        f"data.test_files=[{files['test']}]",
        f"run.dir={run}",
    ]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    metrics = json.loads((run / "metrics.json").read_text())
    assert math.isfinite(metrics["test/loss"]) and metrics["test/bpb"] > 0
    assert printed["test/loss"] == pytest.approx(metrics["test/loss"])
    # other text than validation: a different loss (the test split is really read)
    assert metrics["test/loss"] != pytest.approx(metrics["val/loss"], abs=1e-6)
    assert any("test/loss" in row for row in read_metrics(run))  # the CSV logger got it too

    assert main(["evaluate", str(run), "--split", "test", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["eval/test/loss"] == pytest.approx(metrics["test/loss"], rel=1e-5)
    assert out["eval/test/bits_per_byte"] == pytest.approx(metrics["test/bpb"], rel=1e-5)
    # the test split beside a file: two entries, the file read as it is
    assert main(["evaluate", str(run), "--split", "test", "--data", str(files["val"]), "--json"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert both["eval/test/loss"] == out["eval/test/loss"]
    assert both["eval/data/loss"] != pytest.approx(out["eval/test/loss"], abs=1e-6)
    assert main(["evaluate", str(run), "--json"]) == 0  # validation stays the default
    validation = json.loads(capsys.readouterr().out)
    assert "eval/test/loss" not in validation
    assert validation["eval/validation/loss"] != pytest.approx(out["eval/test/loss"], abs=1e-6)


@pytest.mark.usefixtures("private_cache")
def test_a_source_without_a_test_split_refuses_test_files(tmp_path, capsys):
    files = corpus(tmp_path)
    # the embedded corpus (no data.train_files) has no test split to take the files
    args = ["prepare", str(RECIPES / "tiny-clm.yaml"), f"data.test_files=[{files['test']}]", f"run.dir={tmp_path}/r"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "data.test_files" in err and "embedded corpus" in err


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread", "private_cache")
def test_a_mixture_evaluates_every_task_on_its_test_split(tmp_path, capsys):
    files = corpus(tmp_path)
    run = tmp_path / "run"
    args = [
        "pretrain",
        str(RECIPES / "tiny-unilm.yaml"),
        *TINY,
        f"data.train_files=[{files['train']}]",
        f"data.val_files=[{files['val']}]",
        f"data.test_files=[{files['test']}]",
        f"run.dir={run}",
    ]
    assert main(args) == 0
    capsys.readouterr()
    metrics = json.loads((run / "metrics.json").read_text())
    for task in ("mlm", "clm", "prefix_lm"):
        assert math.isfinite(metrics[f"test/{task}/loss"])
        assert (f"test/{task}/bpb" in metrics) == (task != "mlm")  # a masked loss is no bits per byte
    assert main(["evaluate", str(run), "--split", "test", "--task", "clm", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["eval/test/loss"] == pytest.approx(metrics["test/clm/loss"], rel=1e-5)
    assert out["eval/test/bits_per_byte"] == pytest.approx(metrics["test/clm/bpb"], rel=1e-5)
