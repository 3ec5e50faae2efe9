"""Streaming runs end to end through the command line: clm and span
runs train with sample generation on, evaluate reads a streaming run's validation stream, and a
stopped streaming run resumes. Each is checked against what it wrote, not only its exit code."""

from __future__ import annotations

import json
import math

import pytest
from helpers import pretrain_args

from lit_transformer.commands.cli import main
from lit_transformer.training.rundir import read_metrics

pytestmark = [pytest.mark.usefixtures("one_thread", "private_cache"), pytest.mark.slow]

STREAMING = [
    "data.streaming=true",
    "data.shuffle_buffer=64",
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.checkpoint_every_n_steps=3",
]


def train_losses(run_dir) -> list[float]:
    return [r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r]


@pytest.mark.parametrize("name", ["tiny-clm", "tiny-span"])
def test_generative_streaming_run_samples_during_validation(name, tmp_path, capsys):
    run_dir = tmp_path / "run"
    # sample generation is on in both recipes: it takes its prompts from the validation stream
    assert main(pretrain_args(name, run_dir, *STREAMING)) == 0
    losses = train_losses(run_dir)
    assert len(losses) == 6 and all(map(math.isfinite, losses))
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [3, 6] and all(len(s["samples"]) == 2 for s in samples)
    assert all(s["prompt"] for s in samples[0]["samples"])  # prompts cut from real validation text
    assert math.isfinite(json.loads((run_dir / "metrics.json").read_text())["val/loss"])


def test_evaluate_and_resume_a_streaming_mlm_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(pretrain_args("tiny-mlm", run_dir, *STREAMING)) == 0
    capsys.readouterr()
    assert main(["evaluate", str(run_dir), "--json", "--max-batches", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    final = json.loads((run_dir / "metrics.json").read_text())  # same weights, same first 2 batches
    assert out["loss"] == pytest.approx(final["val/loss"], rel=1e-5)
    # a longer run resumes from the last checkpoint and the data position saved in it
    assert main(pretrain_args("tiny-mlm", run_dir, *STREAMING, "trainer.max_steps=9", "resume=auto")) == 0
    losses = train_losses(run_dir)
    assert len(losses) == 9 and all(map(math.isfinite, losses))
    assert (run_dir / "csv" / "version_1" / "metrics.csv").is_file()
