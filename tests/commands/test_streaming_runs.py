"""Streaming runs end to end through the command line: clm and span
runs train with sample generation on, evaluate reads a streaming run's validation stream, a
stopped streaming run resumes, and resumes exactly (the uninterrupted run's losses: two dataloader
workers, and two DDP ranks). Each is checked against what it wrote, not only its exit code."""

from __future__ import annotations

import json
import math

import pytest
from helpers import RECIPES, SMALL, VOCAB, assert_resume_matches, pretrain_args

from lit_transformer.commands.cli import main
from lit_transformer.recipe.load import load_recipe
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
    assert out["eval/validation/loss"] == pytest.approx(final["val/loss"], rel=1e-5)
    # a longer run resumes from the last checkpoint and the data position saved in it
    assert main(pretrain_args("tiny-mlm", run_dir, *STREAMING, "trainer.max_steps=9", "resume=auto")) == 0
    losses = train_losses(run_dir)
    assert len(losses) == 9 and all(map(math.isfinite, losses))
    assert (run_dir / "csv" / "version_1" / "metrics.csv").is_file()


# Resumes that must find their place: windows of 6 blocks (batches straddle them and the run
# crosses several), and text batches of ~200 characters (`TEXT_BATCH`, instead of 1 MB) over a
# file of short lines, so that a position is a seek into the file and differs between workers.
TEXT_BATCH = 200


def resuming(tmp_path) -> list[str]:
    words = "alpha beta gamma delta stream token block batch memory corpus window resume".split()
    lines = (" ".join(words[(i * j) % len(words)] for j in range(3 + i % 9)) for i in range(3000))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(lines) + "\n")
    data = [f"data.train_files=[{corpus}]", "data.text_format=lines", "data.shuffle_buffer=6"]
    return [*SMALL, f"tokenizer.vocab_size={VOCAB['tiny-mlm']}", *STREAMING, *data]


def test_a_stopped_streaming_run_resumes_exactly(tmp_path, monkeypatch):
    """Stopped at step 3 (an odd batch: the next one is worker 1's) and resumed from the saved
    stream positions, a streaming run gives the uninterrupted run's losses."""
    monkeypatch.setattr("lit_transformer.data.modules.streaming.BATCH_BYTES", TEXT_BATCH)  # forked workers too
    overrides = resuming(tmp_path)

    def config(run_dir, *extra):
        return load_recipe(RECIPES / "tiny-mlm.yaml", [*overrides, f"run.dir={run_dir}", "data.num_workers=2", *extra])

    assert_resume_matches(config, tmp_path, stop=3, steps=6)


# Rank 0 of a 2-process DDP job (Lightning starts rank 1 by running the script again): an
# uninterrupted run, and one stopped at step 3 and resumed; each rank writes its own losses.
_DDP_SCRIPT = r"""
import json
import sys
from pathlib import Path

from lightning.pytorch.callbacks import Callback

import lit_transformer.data.modules.streaming
from lit_transformer.commands.train import train
from lit_transformer.recipe.load import load_recipe


class Losses(Callback):
    def __init__(self, out, stop):
        self.out, self.stop, self.seen = Path(out), stop, {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.seen[trainer.global_step] = float(outputs["loss"])
        if trainer.global_step >= self.stop:
            trainer.should_stop = True

    def on_train_end(self, trainer, module):
        path = self.out / f"rank{trainer.global_rank}.json"
        path.write_text(json.dumps({**(json.loads(path.read_text()) if path.exists() else {}), **self.seen}))


recipe, out, overrides = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
lit_transformer.data.modules.streaming.BATCH_BYTES = int(sys.argv[4])
for name, stop, extra in (("whole", 99, []), ("parts", 3, []), ("parts", 99, ["resume=auto"])):
    cfg = load_recipe(recipe, [*overrides, f"run.dir={out / name}", *extra])
    train(cfg, callbacks=[Losses(out / name, stop)], progress_bar=False)
"""


@pytest.mark.distributed
def test_a_stopped_ddp_streaming_run_resumes_exactly(tmp_path, launcher):
    """Each rank resumes its own stream: the checkpoint holds every rank's positions (gathered)."""
    script = tmp_path / "run.py"
    script.write_text(_DDP_SCRIPT)
    two = ["trainer.strategy=ddp", "trainer.devices=2", "model.dropout=0.0"]  # dropout draws are per rank
    launcher.run(
        script,
        [str(RECIPES / "tiny-mlm.yaml"), str(tmp_path), json.dumps([*resuming(tmp_path), *two]), str(TEXT_BATCH)],
        tmp_path / "cache",
        tmp_path,
        timeout=400,
    )
    for rank in (0, 1):
        whole = json.loads((tmp_path / "whole" / f"rank{rank}.json").read_text())
        parts = json.loads((tmp_path / "parts" / f"rank{rank}.json").read_text())
        assert sorted(whole, key=int) == sorted(parts, key=int) == [str(s) for s in range(1, 7)], rank
        for step in whole:
            assert parts[step] == pytest.approx(whole[step], rel=1e-6, abs=1e-7), (rank, step)
    ranks = [json.loads((tmp_path / "whole" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] != ranks[1]  # the ranks read different documents
