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


# The longest files, longest first (`bash scripts/test.sh --durations=0` from a fresh clone,
# summed per file, 2026-11-27). scripts/test.sh hands whole files to its two workers in
# collection order (--dist loadfile --no-loadscope-reorder): started first, the long files
# overlap each other and the short ones fill in at the end, instead of one worker finishing a
# long file alone. The rest follow by marker: two-process files, then slow ones, then the others.
LONGEST_FIRST = (
    "test_option_pairs.py",
    "test_recipe_strategies.py",
    "test_option_pairs_distributed.py",
    "training/test_distributed.py",
    "training/test_fast_paths.py",
    "benchmarks/test_gpu_check.py",
    "training/test_multinode.py",
    "evaluation/test_eval_distributed.py",
    "training/test_resume_world_size.py",
    "data/test_data_shared_store.py",
)


def pytest_collection_modifyitems(config, items):
    weight: dict[str, int] = {}
    for item in items:
        if item.get_closest_marker("distributed") is not None:
            item.add_marker(pytest.mark.slow)
        file = item.nodeid.split("::")[0].removeprefix("tests/")
        marker = 2 if item.get_closest_marker("distributed") else 1 if item.get_closest_marker("slow") else 0
        weight[file] = max(weight.get(file, 0), marker)

    def order(item) -> int:
        file = item.nodeid.split("::")[0].removeprefix("tests/")
        rank = LONGEST_FIRST.index(file) if file in LONGEST_FIRST else len(LONGEST_FIRST) + 2 - weight[file]
        return rank

    items.sort(key=order)  # stable: each file's tests keep their order


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


@pytest.fixture(scope="session")
def launcher():
    """The distributed jobs' launcher (tests/launcher.py): one process for the session that imports
    torch, Lightning and lit_transformer once and forks the ranks of each job. Started on first
    use, it imports while that test goes on; a fixture that asks for it before its own
    one-process runs has it ready by its job."""
    from launcher import RankLauncher

    ranks = RankLauncher()
    yield ranks
    ranks.close()
