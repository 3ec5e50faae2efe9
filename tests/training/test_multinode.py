"""Two nodes of one process each, on this machine: launched by torchrun (c10d rendezvous on
127.0.0.1) and as srun would launch them (Lightning's SLURMEnvironment, read from SLURM_*
variables), with the commands docs/scaling.md shows. Each node has its own token cache directory
(no shared filesystem is assumed: each node's process prepares its own), and the per-step losses
equal one process with the same global batch (2 nodes x batch 3 = batch 6), as
tests/training/test_distributed.py checks for one node. A node whose cache differs fails before the first
step with a one-line error.

The run directory is written by global rank 0 alone (logs, checkpoints, final model); both nodes
name the same path here because this is one machine, as on a cluster where run.dir is shared.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from helpers import RECIPES, TINY_RUN, losses

from lit_transformer.commands.train import train
from lit_transformer.recipe.load import load_recipe

STEPS = 3
# deterministic, as tests/training/test_distributed.py's COMMON: no dropout, a high learning rate without
# warmup so that a wrong update shows in the next step's loss
COMMON = [
    *TINY_RUN,
    "model.dropout=0.0",
    "optim.lr=1e-2",
    "optim.warmup_steps=0",
    f"trainer.max_steps={STEPS}",
    f"trainer.val_check_interval={STEPS}",
    "trainer.limit_val_batches=1",
]
TWO_NODES = ["trainer.num_nodes=2", "trainer.devices=1", "trainer.strategy=ddp", "trainer.accelerator=cpu"]
RECIPE = RECIPES / "tiny-clm.yaml"
# the console script itself: torchrun runs it with Python (`$(which lit-transformer)` in the docs;
# under pyenv `which` finds a shell shim instead)
CLI = str(Path(sysconfig.get_path("scripts")) / "lit-transformer")
TIMEOUT = 300  # a node left waiting in a collective or a rendezvous is a failure, not a hang
# what a launcher or a scheduler sets: the test's own process must not pass any of it on
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base_env(cache: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCH_VARIABLES and not k.startswith(("SLURM_", "TORCHELASTIC_"))
    }
    env.update(
        LIT_TRANSFORMER_CACHE=str(cache),  # node-local
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        HF_HUB_OFFLINE="1",
        WANDB_MODE="offline",
    )
    return env


def _pretrain(run_dir: Path, *extra: str) -> list[str]:
    return ["pretrain", str(RECIPE), *COMMON, *TWO_NODES, "data.batch_size=3", f"run.dir={run_dir}", *extra]


def _torchrun(run_dir: Path, port: int) -> list[str]:
    """docs/scaling.md's torchrun command, the same on every node: the c10d rendezvous gives
    each node its rank."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=multinode-test",
        CLI,
        *_pretrain(run_dir),
    ]


def _slurm_env(env: dict[str, str], node: int, port: int) -> dict[str, str]:
    """What `srun` sets for task `node` of a 2-node job with one task per node (the variables
    lightning.fabric's SLURMEnvironment reads; a job named 'bash' would count as interactive)."""
    return dict(
        env,
        SLURM_NTASKS="2",
        SLURM_NTASKS_PER_NODE="1",
        SLURM_NNODES="2",
        SLURM_PROCID=str(node),
        SLURM_LOCALID="0",
        SLURM_NODEID=str(node),
        SLURM_NODELIST="127.0.0.1",
        SLURM_JOB_NAME="multinode-test",
        SLURM_JOB_ID="4242",
        MASTER_ADDR="127.0.0.1",  # srun's first node; Lightning would take it from SLURM_NODELIST
        MASTER_PORT=str(port),
    )


def _launch(nodes: list[tuple[list[str], dict[str, str], Path]]) -> list[tuple[int, str]]:
    """Start every node's command at once (each in its own working directory, its output in
    files there: a full pipe would block a rank), wait for all; [(return code, stderr)]."""
    procs = []
    for command, env, cwd in nodes:
        cwd.mkdir(parents=True, exist_ok=True)
        out, err = open(cwd / "stdout.txt", "w"), open(cwd / "stderr.txt", "w")
        procs.append((subprocess.Popen(command, env=env, cwd=cwd, stdout=out, stderr=err, text=True), out, err))
    deadline = time.monotonic() + TIMEOUT
    try:
        for proc, _, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc, _, _ in procs:
            proc.kill()
        pytest.fail(f"a node did not finish within {TIMEOUT} s: " + _tails(nodes))
    finally:
        for proc, out, err in procs:
            proc.wait()
            out.close()
            err.close()
    return [(proc.returncode, (cwd / "stderr.txt").read_text()) for (proc, _, _), (_, _, cwd) in zip(procs, nodes)]


def _tails(nodes) -> str:
    return "\n".join(f"--- {cwd}\n{(cwd / 'stderr.txt').read_text()[-3000:]}" for _, _, cwd in nodes)


def _cache_entries(cache: Path) -> list[Path]:
    return sorted(p.parent for p in cache.glob("*/meta.json"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """One process, batch 6: the loss of each step."""
    out = tmp_path_factory.mktemp("single")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LIT_TRANSFORMER_CACHE", str(out / "cache"))
        train(load_recipe(RECIPE, [*COMMON, "data.batch_size=6", f"run.dir={out / 'run'}"]), progress_bar=False)
    got = losses(out / "run")
    assert sorted(got) == list(range(STEPS))
    return got


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> Path:
    """Two simulated srun tasks on two "nodes", each with its own cache; returns the folder
    holding node0/ and node1/ (working directory, cache/) and run/."""
    out = tmp_path_factory.mktemp("slurm")
    port = _free_port()
    nodes = [
        ([CLI, *_pretrain(out / "run")], _slurm_env(_base_env(out / f"node{n}" / "cache"), n, port), out / f"node{n}")
        for n in range(2)
    ]
    results = _launch(nodes)
    assert all(code == 0 for code, _ in results), _tails(nodes)
    return out


def _assert_matches(run: Path, reference: dict[int, float]) -> None:
    got = losses(run)
    assert sorted(got) == sorted(reference)
    assert [got[s] for s in sorted(got)] == pytest.approx([reference[s] for s in sorted(reference)], abs=1e-5, rel=0)
    assert (run / "model.safetensors").is_file()  # global rank 0 finished the run


@pytest.mark.slow
@pytest.mark.distributed  # the lock and main-process tests at the end take milliseconds
def test_two_torchrun_nodes_match_one_process_with_the_same_global_batch(tmp_path, reference):
    port = _free_port()
    nodes = [
        (_torchrun(tmp_path / "run", port), _base_env(tmp_path / f"node{n}" / "cache"), tmp_path / f"node{n}")
        for n in range(2)
    ]
    results = _launch(nodes)
    assert all(code == 0 for code, _ in results), _tails(nodes)
    _assert_matches(tmp_path / "run", reference)
    for n in range(2):  # each node tokenized into its own cache: nothing was shared
        assert len(_cache_entries(tmp_path / f"node{n}" / "cache")) == 2, n  # train and validation


@pytest.mark.slow
@pytest.mark.distributed
def test_two_slurm_nodes_match_one_process_with_the_same_global_batch(slurm, reference):
    _assert_matches(slurm / "run", reference)
    entries = [_cache_entries(slurm / f"node{n}" / "cache") for n in range(2)]
    assert len(entries[0]) == 2 and [p.name for p in entries[0]] == [p.name for p in entries[1]]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_node_whose_cache_differs_fails_before_the_first_step(slurm, tmp_path):
    """Node 1's cache is a copy of the one it built, cut short by one block of 24 tokens (a
    truncated copy keeps its key): both nodes stop with one line naming both fingerprints and
    both caches, before any step or checkpoint."""
    caches = [tmp_path / f"node{n}" / "cache" for n in range(2)]
    for n in range(2):
        shutil.copytree(slurm / f"node{n}" / "cache", caches[n])
    for entry in _cache_entries(caches[1]):
        meta = json.loads((entry / "meta.json").read_text())
        meta["arrays"]["tokens"]["shape"][0] -= 24
        (entry / "meta.json").write_text(json.dumps(meta))
    port = _free_port()
    nodes = [
        ([CLI, *_pretrain(tmp_path / "run")], _slurm_env(_base_env(caches[n]), n, port), tmp_path / f"node{n}")
        for n in range(2)
    ]
    results = _launch(nodes)
    for code, stderr in results:
        assert code == 2, _tails(nodes)
        (line,) = [x for x in stderr.splitlines() if x.startswith("error:")]
        assert "token caches differ between nodes" in line and "rank 1 (node 1)" in line, line
        assert str(caches[1]) in line and str(caches[0]) in line, line
    assert not list((tmp_path / "run").glob("checkpoints/*"))
    assert not (tmp_path / "run" / "model.safetensors").exists()
    assert not losses(tmp_path / "run")


def test_the_cache_lock_makes_a_second_process_wait(tmp_path):
    """The processes of one node that prepare the same cache root: the second waits until the
    first (which tokenizes) lets go. flock locks open files, so two threads exclude each other too."""
    import threading

    from lit_transformer.data.tokens.cache import cache_lock

    order: list[str] = []

    def second():
        with cache_lock(tmp_path):
            order.append("second")

    with cache_lock(tmp_path):
        thread = threading.Thread(target=second)
        thread.start()
        thread.join(timeout=0.5)
        assert thread.is_alive()  # still waiting for the lock
        order.append("first")
    thread.join(timeout=10)
    assert order == ["first", "second"]


@pytest.mark.parametrize(
    ("variables", "main"),
    [
        ({}, True),
        ({"LOCAL_RANK": "1"}, False),  # an extra process Lightning started on this node
        ({"RANK": "1", "LOCAL_RANK": "0"}, False),  # torchrun on node 1: no NODE_RANK
        ({"SLURM_PROCID": "1", "SLURM_LOCALID": "0"}, False),  # srun's task on node 1
        ({"SLURM_LOCALID": "1"}, False),  # srun's second task of node 0 (no LOCAL_RANK)
        ({"RANK": "0", "LOCAL_RANK": "0", "SLURM_PROCID": "0"}, True),
    ],
)
def test_only_the_first_process_of_a_multinode_job_is_main(monkeypatch, variables, main):
    """Node 1's first process must not write or clear the run directory that rank 0 writes."""
    from lit_transformer.training.distributed import is_main_process

    for name in ("LOCAL_RANK", "NODE_RANK", "RANK", "SLURM_PROCID", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert is_main_process() is main
