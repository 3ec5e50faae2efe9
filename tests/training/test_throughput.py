"""The Throughput callback on its own: a fake clock, a fake module and trainer, so that the
logged train/tokens_per_s and train/mfu can be checked against arithmetic."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_config

from lit_transformer.model.accounting import train_flops
from lit_transformer.model.config import TransformerConfig
from lit_transformer.training import throughput
from lit_transformer.training.throughput import StepWork, Throughput

B, T = 3, 7
CFG = tiny_config("decoder")


class FakeModule:
    """What Throughput asks of a LightningModule: flops_config, step_work, device and log."""

    def __init__(self):
        self.step_work = None
        self.device = torch.device("cpu")
        self.logged: list[tuple[int, str, float]] = []
        self.step = 0

    def flops_config(self) -> TransformerConfig:
        return CFG

    def log(self, name: str, value) -> None:
        self.logged.append((self.step, name, float(value)))


def batch(pad: int = 0) -> dict[str, torch.Tensor]:
    mask = torch.ones(B, T, dtype=torch.long)
    if pad:
        mask[0, T - pad :] = 0
    return {"input_ids": torch.zeros(B, T, dtype=torch.long), "attention_mask": mask}


def run(monkeypatch, steps: list[dict | None], every: int, peak: float | None, world: int = 1, step_seconds=2.0):
    """Drive the callback through one batch per entry of `steps` (None: a skipped step, which
    leaves no StepWork); each batch takes `step_seconds` on the fake clock."""
    clock = [100.0]
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: clock[0])
    module = FakeModule()
    trainer = SimpleNamespace(
        global_step=0,
        log_every_n_steps=every,
        world_size=world,
        precision="32-true",
        strategy=SimpleNamespace(reduce=lambda t, reduce_op: t * world),  # every rank did the same work
    )
    callback = Throughput(peak_flops=peak)
    for i, work in enumerate(steps):
        b = batch(**(work or {}))
        callback.on_train_batch_start(trainer, module, b, i)
        clock[0] += step_seconds
        if work is not None:
            module.step_work = StepWork(b, flop_tokens=b["attention_mask"].sum(), head_positions=5)
        trainer.global_step += 1
        module.step = trainer.global_step
        callback.on_train_batch_end(trainer, module, None, b, i)
        assert module.step_work is None  # taken, so that a later skipped step counts nothing
    return module.logged


def test_tokens_per_s_and_mfu_over_a_logging_window(monkeypatch):
    peak = 1e9
    logged = run(monkeypatch, [{}, {"pad": 2}, None, {}], every=2, peak=peak, world=2)
    assert [(step, name) for step, name, _ in logged] == [
        (2, "train/tokens_per_s"),
        (2, "train/tokens_seen"),
        (2, "train/mfu"),
        (4, "train/tokens_per_s"),
        (4, "train/tokens_seen"),
        (4, "train/mfu"),
    ]
    flops = train_flops(CFG, T)
    body, head = (flops.total - flops.lm_head) / T, flops.lm_head / T
    # the window holds steps 1-2 (4 s); the second step had 2 padded positions
    tokens = B * T + (B * T - 2)
    work = tokens * body + 2 * 5 * head
    values = {(step, name): value for step, name, value in logged}
    assert values[2, "train/tokens_per_s"] == pytest.approx(2 * tokens / 4.0)
    assert values[2, "train/mfu"] == pytest.approx(2 * work / 4.0 / (peak * 2), rel=1e-6)
    # steps 3 (skipped: no work) and 4 share the next window
    assert values[4, "train/tokens_per_s"] == pytest.approx(2 * B * T / 4.0)
    assert values[4, "train/mfu"] == pytest.approx(2 * (B * T * body + 5 * head) / 4.0 / (peak * 2), rel=1e-6)
    # the running count of every rank's tokens: the x axis of `plot --x tokens`
    assert values[2, "train/tokens_seen"] == 2 * tokens
    assert values[4, "train/tokens_seen"] == 2 * tokens + 2 * B * T


def test_no_mfu_without_a_known_peak(monkeypatch):
    logged = run(monkeypatch, [{}, {}, {}], every=1, peak=None)
    assert [name for _, name, _ in logged] == ["train/tokens_per_s", "train/tokens_seen"] * 3  # CPU: no peak


def test_a_window_of_skipped_steps_logs_nothing(monkeypatch):
    assert run(monkeypatch, [None, None, {}], every=1, peak=1e9)[0][0] == 3


def test_tokens_seen_resumes_from_the_checkpoint():
    callback = Throughput()
    callback.tokens_seen = 1234.0
    resumed = Throughput()
    resumed.load_state_dict(callback.state_dict())
    assert resumed.tokens_seen == 1234.0
