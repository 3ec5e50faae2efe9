"""Refusals that need only the recipe and the machine come before anything is trained or written
(run/resolve.py, then training/preflight.py's `check`): the run directory is left as it was, so
the corrected command runs in it."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import RECIPES, TINY_RUN, one_error_line

from lit_transformer.commands.cli import main
from lit_transformer.recipe.load import load_recipe
from lit_transformer.run.resolve import resolve_run
from lit_transformer.training import preflight

# (case, the refused overrides, the error's words, the corrected overrides)
REFUSALS = [
    ("float8 on a CPU", ["trainer.float8=true"], "trainer.float8=true needs an NVIDIA GPU", ["trainer.float8=false"]),
    ("16-mixed on a CPU", ["trainer.precision=16-mixed"], "16-mixed needs CUDA GPUs", ["trainer.precision=32-true"]),
    (
        "muon under fsdp",
        ["trainer.strategy=fsdp", "optim.optimizer=muon"],
        "optim.optimizer=muon needs whole weight matrices",
        ["trainer.strategy=auto", "optim.optimizer=muon"],
    ),
    ("memory", ["data.batch_size=4000000"], "GB available", ["data.batch_size=3"]),
    ("no C++ compiler", ["trainer.compile=true"], "needs a C++ compiler", ["trainer.compile=false"]),
    (
        "devices",
        ["trainer.accelerator=cpu", "trainer.devices=64"],
        "trainer.devices=64 asks for 64 processes",
        ["trainer.accelerator=cpu", "trainer.devices=1"],
    ),
    (
        "eval files",
        ["eval=[{name: held, kind: heldout, files: [/nonexistent/held.txt]}]"],
        "eval held: files: no such file or directory",
        ["eval=[{name: held, kind: heldout, split: validation}]"],
    ),
    (
        "option conflict",
        ["data.document_mask=true", "model.attention_kind=linear"],
        "data.document_mask=true needs model.attention_kind='softmax'",
        ["data.document_mask=true", "model.attention_kind=softmax"],
    ),
]


def pretrain(run_dir: Path, *extra: str) -> list[str]:
    return ["pretrain", str(RECIPES / "tiny-clm.yaml"), *TINY_RUN, f"run.dir={run_dir}", *extra]


@pytest.fixture
def no_compiler(monkeypatch):
    """A machine without a C++ compiler: $CXX names one that is not there."""
    monkeypatch.setenv("CXX", "/nonexistent/c++")


@pytest.mark.parametrize("case, bad, words, fixed", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_refusal_writes_nothing_and_the_corrected_run_passes_startup(
    case, bad, words, fixed, tmp_path, capsys, no_compiler
):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("the user's own file")  # a directory that exists stays as it was
    assert main(pretrain(run_dir, *bad)) == 2
    assert words in one_error_line(capsys)
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]
    # the corrected command passes every start-up check in the same directory (one of them,
    # below, trains there)
    run = resolve_run(load_recipe(RECIPES / "tiny-clm.yaml", [*TINY_RUN, f"run.dir={run_dir}", *fixed]))
    preflight.check(run.config.trainer, run.config.data, run.model, run.longest_input[1])


@pytest.mark.slow
def test_the_corrected_command_runs_in_the_refused_run_directory(tmp_path, capsys):
    """The issue's case: float8 refused on a CPU left config.yaml behind, and the corrected
    command was then refused as "a different run"."""
    run_dir = tmp_path / "run"
    short = ["trainer.max_steps=2", "trainer.val_check_interval=2", "logger.wandb.mode=disabled"]
    assert main(pretrain(run_dir, *short, "trainer.float8=true")) == 2
    assert "float8" in one_error_line(capsys)
    assert not run_dir.exists()
    assert main(pretrain(run_dir, *short, "trainer.float8=false")) == 0
    assert (run_dir / "model.safetensors").is_file()
