"""What reaches stderr (file descriptor 2, so third-party output is caught wherever it writes):
a failing command prints its one-line error and nothing else, with datasets' progress bars
enabled as they are for a user; a run that succeeds prints no banners (Lightning, W&B)."""

from __future__ import annotations

import json

import pytest
from helpers import pretrain_args

from lit_transformer.commands.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")


@pytest.fixture
def progress_bars_on(monkeypatch):
    """The suite turns datasets' progress bars off (conftest); a user has them on."""
    import importlib

    datasets_tqdm = importlib.import_module("datasets.utils.tqdm")  # the module, not its tqdm class

    # datasets reads the variable once, at import: the module's copy is what it obeys
    monkeypatch.setattr(datasets_tqdm, "HF_DATASETS_DISABLE_PROGRESS_BARS", None)
    datasets_tqdm.enable_progress_bars()
    assert not datasets_tqdm.are_progress_bars_disabled()
    yield
    datasets_tqdm.disable_progress_bars()


def test_a_missing_column_is_the_only_line_on_stderr(progress_bars_on, tmp_path, capfd):
    corpus = tmp_path / "train.jsonl"
    corpus.write_text("".join(json.dumps({"body": f"line {i} of a small corpus"}) + "\n" for i in range(50)))
    args = pretrain_args(
        "tiny-clm", tmp_path / "run", f"data.train_files=[{corpus}]", f"data.cache_dir={tmp_path / 'cache'}"
    )
    assert main(args) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "no column 'text' (data.text_column)" in err, err


@pytest.mark.slow
def test_a_successful_run_prints_no_banners(progress_bars_on, tmp_path, capfd):
    # W&B offline (not disabled): its banner and sync hints are what a user without an account sees
    args = pretrain_args(
        "tiny-mlm", tmp_path / "run", "trainer.max_steps=2", "trainer.val_check_interval=2", "logger.wandb.mode=offline"
    )
    assert main(args) == 0
    err = capfd.readouterr().err
    for banner in ("GPU available", "TPU available", "wandb:", "Generating train split", "LeafSpec", "💡"):
        assert banner not in err, err
    assert (tmp_path / "run" / "model.safetensors").is_file()


@pytest.mark.slow
def test_stdout_holds_only_the_metrics_when_wandb_falls_back_to_offline(tmp_path, capfd, monkeypatch):
    """pretrain's stdout is its final metrics JSON (scripts read it): the note that W&B found no
    credentials and logs offline goes to stderr."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("NETRC", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    args = pretrain_args(
        "tiny-clm", tmp_path / "run", "trainer.max_steps=2", "trainer.val_check_interval=2", "logger.wandb.mode=online"
    )
    assert main(args) == 0
    out, err = capfd.readouterr()
    assert len(out.splitlines()) == 1, out
    assert json.loads(out)["val/loss"] > 0
    assert "W&B: no API key" in err
