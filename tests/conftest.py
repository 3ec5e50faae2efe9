"""Fixtures shared across the suite, and its markers.

Markers: `slow` (end-to-end runs, compile, subprocesses; `pytest -m "not slow"` is the quick
inner loop) and `distributed` (two processes on gloo; always slow as well). The README's test
command runs everything. Shared helpers (tiny configs, TINY_RUN, StopAt, ...) are in helpers.py.
"""

from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config):
    """Under scripts/test.sh's two workers (pytest-xdist) each worker and the processes it starts
    get one thread: a second OpenMP thread per worker only spins against the other worker's on a
    2-core machine (a tiny model's 30 training steps took 6 s instead of under 1 s)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    # Every offline W&B run lists the installed packages (its requirements file) by reading each
    # one's metadata: about half a second per run start here, and the suite starts runs by the
    # hundred. Nothing in the suite reads that list; a user's runs keep it (W&B's default).
    os.environ.setdefault("WANDB__SAVE_REQUIREMENTS", "false")


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
