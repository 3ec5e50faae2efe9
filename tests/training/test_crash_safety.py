"""Crash safety: a kill -9 inside a checkpoint write, then resume=auto, matches an uninterrupted
run; a write never leaves a partial file under the final name; and faults (a full disk during a
checkpoint write, a dying data-loader worker) end in a clear error with the previous checkpoint
intact."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import losses, one_error_line
from helpers import tiny_dropout_pretrain as pretrain

from lit_transformer.commands.cli import main
from lit_transformer.training import checkpoints
from lit_transformer.training.checkpoints import checkpoint_step, read_checkpoint
from lit_transformer.training.rundir import latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")


def temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.glob(".*") if checkpoints.is_temp(p)]


# ----------------------------------------------------------------------------- crash safety

CRASH = ["trainer.max_steps=12", "trainer.val_check_interval=12", "trainer.checkpoint_every_n_steps=4"]
# The command line, with the checkpoint writer pausing for 120 s once last.ckpt of step 8 is
# written and fsync'ed in its temporary file and before the rename: the window a kill must hit.
PAUSED_CLI = """
import os, sys, time, torch
from lit_transformer.training import checkpoints
from lit_transformer.commands.cli import main

real_save = checkpoints.atomic_save

def paused_save(obj, path, *, write=None):
    if os.path.basename(path) != "last.ckpt" or obj.get("global_step") != 8:
        return real_save(obj, path, write=write)

    def write_then_pause(obj, file):
        torch.save(obj, file)
        file.flush()
        os.fsync(file.fileno())
        time.sleep(120)

    real_save(obj, path, write=write_then_pause)

checkpoints.atomic_save = paused_save
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_kill_9_inside_a_checkpoint_write_then_resume_matches_an_uninterrupted_run(tmp_path):
    """The run is killed while last.ckpt of step 8 sits written and fsync'ed in its temporary
    file, not yet renamed (PAUSED_CLI holds that window open): step-8.ckpt is complete,
    last.ckpt still says step 4. resume=auto must take step-8.ckpt, by step not by name, never
    the temporary file; the losses of the two segments equal an uninterrupted run's."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert main(pretrain(whole, *CRASH)) == 0

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", PAUSED_CLI, *pretrain(killed, *CRASH)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    folder = killed / "checkpoints"
    deadline = time.monotonic() + 180
    try:
        while not (
            (folder / "step-8.ckpt").exists() and any(p.name.startswith(".last.ckpt.") for p in temp_files(folder))
        ):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no checkpoint write seen"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # kill -9, the run and anything it started
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    (tmp,) = temp_files(folder)
    assert tmp.name.startswith(".last.ckpt.")
    assert checkpoint_step(folder / "last.ckpt") == 4 and checkpoint_step(folder / "step-8.ckpt") == 8
    assert latest_checkpoint(killed) == folder / "step-8.ckpt"

    assert main(pretrain(killed, *CRASH, "resume=auto")) == 0
    assert not temp_files(folder)  # the leftover of the killed write is gone
    expected, got = losses(whole), losses(killed)
    # Lightning logs a step's row after its on_train_batch_end, where checkpoints are written:
    # a kill inside that write loses the one row of step 7 (the loss, not the training).
    assert sorted(expected) == list(range(12)) and sorted(got) == [s for s in range(12) if s != 7]
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step


def test_a_write_never_leaves_a_partial_file_under_the_final_name(tmp_path, monkeypatch):
    """An exception in the middle of torch.save (what a kill would cut) leaves the previous
    file byte for byte and no temporary file."""
    target = tmp_path / "last.ckpt"
    checkpoints.atomic_save({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, target)
    before = target.read_bytes()

    def half_then_fail(obj, file):
        file.write(b"PK\x03\x04 partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        checkpoints.atomic_save({"state_dict": {}}, target, write=half_then_fail)
    assert target.read_bytes() == before and not temp_files(tmp_path)
    assert read_checkpoint(target)["global_step"] == 1


# ----------------------------------------------------------------------------- faults

WORKER_DIES = """
import os, sys, torch.utils.data as tud
from lit_transformer.commands.cli import main
from lit_transformer.data.modules import text_module as module
getitem = module._CollatedBatches.__getitem__
def dying(self, index):
    if tud.get_worker_info() is not None:
        os._exit(3)  # the worker vanishes, as when the OOM killer takes it
    return getitem(self, index)
module._CollatedBatches.__getitem__ = dying
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_dying_dataloader_worker_is_a_clear_error_not_a_hang(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = pretrain(tmp_path / "run", "data.num_workers=1", "trainer.max_steps=4", "trainer.val_check_interval=4")
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", WORKER_DIES, *args], env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 2, out.stderr[-3000:]
    err = out.stderr.strip().splitlines()[-1]
    assert err.startswith("error: a data-loader worker died (DataLoader worker (pid") and "Traceback" not in out.stderr
    assert time.monotonic() - t0 < 200


def test_a_full_disk_during_a_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch, capsys):
    """torch.save fails with ENOSPC half-way through step 4's first checkpoint file."""
    real_save = torch.save

    def full_disk(obj, file, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("global_step") == 4:
            file.write(b"PK\x03\x04" + b"\0" * 1000)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, file, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    run_dir = tmp_path / "run"
    assert (
        main(
            pretrain(
                run_dir, "trainer.max_steps=6", "trainer.val_check_interval=6", "trainer.checkpoint_every_n_steps=2"
            )
        )
        == 2
    )
    line = one_error_line(capsys)
    assert "No space left on device" in line and "the previous checkpoint is intact" in line
    folder = run_dir / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step-2.ckpt"]  # no temporary file
    assert read_checkpoint(folder / "last.ckpt")["global_step"] == 2
    monkeypatch.setattr(torch, "save", real_save)
    assert (
        main(
            pretrain(
                run_dir,
                "trainer.max_steps=6",
                "trainer.val_check_interval=6",
                "trainer.checkpoint_every_n_steps=2",
                "resume=auto",
            )
        )
        == 0
    )  # and it resumes
