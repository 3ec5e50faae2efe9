"""Trainer wiring: exact resume (losses, weights, W&B run id), W&B offline files read back,
checkpoint cadence, strategy errors, the metrics reader."""

from __future__ import annotations

import glob
import json
import struct
import zlib
from pathlib import Path

import pytest
import torch
from helpers import TINY_RUN, StopAt, losses, tiny_run_config
from lightning.pytorch.callbacks import Callback
from safetensors.torch import load_file

from lit_transformer.commands.train import train
from lit_transformer.training.rundir import read_metrics

# Dropout on, so that resuming has random draws to get right; W&B offline and sample generation
# on, since this file checks what they write.
TINY = [
    *TINY_RUN,
    "model.dropout=0.1",
    "logger.wandb.mode=offline",
    "generation.enabled=true",
    "generation.max_new_tokens=4",
    "generation.num_prompts=2",
]


pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")


def test_resume_continues_exactly(tmp_path):
    """Stopping at step 3 and resuming gives the uninterrupted run's losses, weights and W&B id."""
    common = ["trainer.max_steps=6", "trainer.val_check_interval=2", "trainer.checkpoint_every_n_steps=3"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(tiny_run_config(whole, *common, "logger.wandb.mode=disabled", base=TINY), progress_bar=False)
    train(tiny_run_config(parts, *common, base=TINY), callbacks=[StopAt(3)], progress_bar=False)
    assert (parts / "checkpoints" / "last.ckpt").is_file()
    assert not (parts / "model.safetensors").exists()  # an interrupted run has no final model
    assert max(losses(parts)) == 2
    train(tiny_run_config(parts, *common, "resume=auto", base=TINY), progress_bar=False)

    expected, got = losses(whole), losses(parts)
    assert sorted(got) == sorted(expected) == list(range(6))  # Lightning logs step - 1 for step's loss
    for step in range(6):
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step
    a, b = load_file(whole / "model.safetensors"), load_file(parts / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7)
    # the same W&B run continues, in one offline folder whose log holds every step once
    run_id = (parts / "wandb_id.txt").read_text().strip()
    (segment,) = glob.glob(str(parts / "wandb" / "offline-run-*"))
    assert segment.endswith(run_id) and (parts / "wandb" / "latest-run").resolve() == Path(segment).resolve()
    log = Path(segment) / f"run-{run_id}.wandb"
    assert valid_checksums(log)
    kinds = [r.WhichOneof("record_type") for r in wandb_records(log)]
    assert kinds.count("run") == 1 and kinds.count("exit") == 1 and kinds[-1] == "exit"
    history = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in wandb_records(log)
        if r.WhichOneof("record_type") == "history"
    ]
    logged = {int(h["trainer/global_step"]): h["train/loss"] for h in history if "train/loss" in h}
    assert logged == pytest.approx(expected, rel=1e-6)
    steps = [h["_step"] for h in history]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)  # renumbered to continue


class BarProbe(Callback):
    """(total, completed, tokens/s shown) of the progress bar's training task after each batch."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        bar = trainer.progress_bar_callback
        task = bar.train_progress_bar
        self.seen.append(
            (task.total, task.completed, trainer.global_step, "tokens/s" in bar.get_metrics(trainer, pl_module))
        )


def test_progress_bar_counts_optimizer_steps_toward_max_steps(tmp_path):
    common = [
        "trainer.max_steps=4",
        "trainer.accumulate_grad_batches=2",
        "trainer.val_check_interval=4",
        "trainer.checkpoint_every_n_steps=2",
        "logger.wandb.mode=disabled",
    ]
    first, second = BarProbe(), BarProbe()
    train(tiny_run_config(tmp_path / "run", *common, base=TINY), callbacks=[first, StopAt(2)])
    train(tiny_run_config(tmp_path / "run", *common, "resume=auto", base=TINY), callbacks=[second])
    assert {total for total, *_ in first.seen + second.seen} == {4}  # optimizer steps, not batches
    assert all(completed == step for _, completed, step, _ in first.seen + second.seen)
    assert [c for _, c, _, _ in first.seen] == [0, 1, 1, 2]  # two batches per optimizer step
    assert [c for _, c, _, _ in second.seen] == [2, 3, 3, 4]  # the resumed run starts at its step
    assert first.seen[-1][3] and second.seen[-1][3]  # tokens/s, once a logging window closed


def test_resume_path_and_missing_checkpoint(tmp_path):
    from lit_transformer.errors import RunError

    with pytest.raises(RunError, match="no such checkpoint"):
        train(tiny_run_config(tmp_path / "r", f"resume={tmp_path / 'none.ckpt'}", base=TINY), progress_bar=False)


# ----------------------------------------------------------------------------- W&B offline files


def chunks(path):
    """(checksum, type, data) of each chunk of a W&B transaction log (.wandb): LevelDB-style
    32 KiB blocks of chunks with a 7-byte header (CRC-32 of the type byte and the data, length,
    type: 1 full, 2 first, 3 middle, 4 last) after the file's 7-byte ':W&B' header. Written from
    the format, apart from lit_transformer.training.wandb_offline, which it checks."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos = 7
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += left
            continue
        yield checksum, kind, data[pos + 7 : pos + 7 + length]
        pos += 7 + length


def wandb_records(path):
    """The records of a transaction log (wandb 0.31 ships no Python reader: its core is in Go)."""
    from wandb.proto import wandb_internal_pb2 as pb

    buffer = b""
    for _, kind, chunk in chunks(path):
        buffer = chunk if kind in (1, 2) else buffer + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buffer)
            yield record


def valid_checksums(path) -> bool:
    """Every chunk's CRC-32 matches, as wandb sync checks."""
    return all(zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == checksum for checksum, kind, chunk in chunks(path))


def test_wandb_offline_files_hold_metrics_config_and_samples(tmp_path):
    run_dir = tmp_path / "run"
    metrics = train(
        tiny_run_config(
            run_dir, "trainer.max_steps=4", "trainer.val_check_interval=2", "logger.wandb.tags=[tiny,test]", base=TINY
        ),
        progress_bar=False,
    )
    (log,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    history, config, run = [], {}, None
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
        elif kind == "run":
            run = record.run
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    assert run.run_id == (run_dir / "wandb_id.txt").read_text().strip()
    assert list(run.tags) == ["tiny", "test"] and run.project == "lit-transformer-tiny"
    assert config["trainer"]["max_steps"] == 4 and config["objective"]["name"] == "clm"
    csv_losses = losses(run_dir)
    logged = {int(h["trainer/global_step"]): h["train/loss"] for h in history if "train/loss" in h}
    assert logged and logged == pytest.approx(csv_losses, rel=1e-6)
    val = [h for h in history if "val/loss" in h]
    assert val[-1]["val/loss"] == pytest.approx(metrics["val/loss"], rel=1e-6)
    tables = [h for h in history if h.get("samples/_type") == "table-file"]
    assert len(tables) == 2  # one table of sample generations per validation (steps 2 and 4)
    table = json.loads(next(Path(log).parent.glob("files/media/table/samples_*.table.json")).read_text())
    assert table["columns"] == ["step", "prompt", "completion"] and len(table["data"]) == 2
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2, 4]


def test_disabled_wandb_writes_no_files(tmp_path):
    run_dir = tmp_path / "run"
    train(tiny_run_config(run_dir, "trainer.max_steps=1", "logger.wandb.mode=disabled", base=TINY), progress_bar=False)
    assert not (run_dir / "wandb").exists() and (run_dir / "csv" / "version_0" / "metrics.csv").is_file()
    # checkpoints: every N steps and always at the end
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["last.ckpt", "step-1.ckpt"]


def test_wandb_online_without_credentials_goes_offline(monkeypatch, tmp_path):
    from lit_transformer.training import trainer

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert trainer.wandb_mode("online") == "offline"
    assert trainer.wandb_mode("disabled") is None
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert trainer.wandb_mode("online") == "online"


def test_read_metrics_prefers_the_later_segment(tmp_path):
    for version, rows in ((0, "step,train/loss\n0,5.0\n1,4.0\n2,3.5\n"), (1, "step,train/loss\n2,3.0\n3,2.0\n")):
        folder = tmp_path / "csv" / f"version_{version}"
        folder.mkdir(parents=True)
        (folder / "metrics.csv").write_text(rows)
    assert [(r["step"], r["train/loss"]) for r in read_metrics(tmp_path)] == [(0, 5.0), (1, 4.0), (2, 3.0), (3, 2.0)]


def test_read_metrics_keeps_the_validation_at_the_step_a_run_resumed_from(tmp_path):
    """A run stopped after 2 steps validated and evaluated the weights of step 2 (logged at step
    2); resumed, it logs its first step's loss at step 2 too, and nothing else there."""
    versions = (
        "step,train/loss,val/loss,eval/probe/accuracy\n0,5.0,,\n1,4.0,,\n2,,3.9,0.5\n",
        "step,train/loss,val/loss,eval/probe/accuracy\n2,3.5,,\n3,3.0,,\n4,,2.9,0.7\n",
    )
    for version, rows in enumerate(versions):
        folder = tmp_path / "csv" / f"version_{version}"
        folder.mkdir(parents=True)
        (folder / "metrics.csv").write_text(rows)
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r] == [(0, 5.0), (1, 4.0), (2, 3.5), (3, 3.0)]
    assert [(r["step"], r["val/loss"], r["eval/probe/accuracy"]) for r in rows if "val/loss" in r] == [
        (2, 3.9, 0.5),
        (4, 2.9, 0.7),
    ]
