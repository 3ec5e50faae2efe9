"""Fixtures shared across the suite, and its markers.

Markers: `slow` (end-to-end runs, compile, subprocesses; `pytest -m "not slow"` is the quick
inner loop) and `distributed` (two processes on gloo; always slow as well). The README's test
command runs everything.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lit_transformer.model.config import TransformerConfig
from lit_transformer.training.rundir import read_metrics

V = 99  # odd tiny vocabulary: a transposed axis crashes instead of broadcasting


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("distributed") is not None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def one_thread():
    """One torch thread for the test: tiny matrices gain nothing from a second OpenMP thread,
    and on a shared 2-core machine it makes every op wait on a busy core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def private_cache(monkeypatch, tmp_path_factory):
    """The token cache in this session's temporary directory, and no hub access or progress bars."""
    cache = tmp_path_factory.getbasetemp() / "cache"
    monkeypatch.setenv("LIT_TRANSFORMER_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    return cache


def tiny_config(arch: str = "decoder", **overrides) -> TransformerConfig:
    """An odd-sized tiny model config (test files import it: `from conftest import tiny_config`)."""
    values = dict(
        arch=arch,
        vocab_size=V,
        d_model=24,
        n_heads=3,
        n_layers=2,
        d_ff=37,
        max_seq_len=32,
        relative_buckets=8,
        relative_max_distance=16,
    )
    return TransformerConfig(**{**values, **overrides})


class StopAt(Callback):
    """Interrupt training after `step` optimizer steps, as a killed job would be."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def losses(run_dir: Path) -> dict[int, float]:
    """{step: train/loss} over every CSV version of a run."""
    return {int(r["step"]): r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}
