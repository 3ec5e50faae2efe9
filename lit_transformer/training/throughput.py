"""Training throughput and model FLOPs utilisation, measured by a callback.

  train/tokens_per_s   non-pad tokens per second summed over ranks, averaged over the window
                       since the last logging step (wall clock, CUDA synchronised once per
                       window, not per step)
  train/mfu            model FLOPs per second / peak FLOP/s of all devices (Chowdhery et al.
                       2022, PaLM, 4.1 and appendix B), FLOPs from model.accounting; only when
                       the peak is known (`peak_flops`, or PEAK_FLOPS on a GPU)

Both are logged on logging steps only (trainer.log_every_n_steps), after the window's counts
are summed over the ranks in one reduce per logging step.

What the callback asks of the LightningModule it watches (ObjectiveBase provides it):
  flops_config()    the TransformerConfig whose training FLOPs a step spends
  step_work         a StepWork set by every training step that trains (left None by a step
                    the non-finite guard skips); the callback takes it at the batch's end
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lit_transformer.model.accounting import train_flops

# Dense (no structured sparsity) peak FLOP/s per GPU from NVIDIA's datasheets: the tensor-core
# BF16/FP16, TF32 and plain FP32 rows, the "with sparsity" figures halved. Keys are words that
# must all occur in torch.cuda.get_device_name(); more specific entries come first.
PEAK_FLOPS: list[tuple[tuple[str, ...], dict[str, float]]] = [
    (("h100", "pcie"), {"bf16": 756e12, "tf32": 378e12, "fp32": 51.2e12}),
    (("h100", "nvl"), {"bf16": 835e12, "tf32": 417.5e12, "fp32": 60e12}),
    (("h100",), {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM5 ("H100 80GB HBM3")
    (("h200", "nvl"), {"bf16": 835e12, "tf32": 417.5e12, "fp32": 60e12}),
    (("h200",), {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM: the H100 SXM's compute
    (("a100",), {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
]


def matmul_format(precision: str) -> str | None:
    """Which datasheet row a Lightning precision string's matrix products run at."""
    if precision.startswith(("bf16", "16")):
        return "bf16"  # FP16 tensor-core peak equals BF16 on these parts
    if precision.startswith("32"):
        return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return None


def peak_flops_for(device_name: str, precision: str) -> float | None:
    """Peak FLOP/s of one device for a precision, or None when the device is not in the table."""
    fmt = matmul_format(precision)
    name = device_name.lower()
    for words, peaks in PEAK_FLOPS:
        if fmt is not None and all(w in name for w in words):
            return peaks[fmt]
    return None


def non_pad_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if attention_mask is None:
        return torch.tensor(float(input_ids.numel()), device=input_ids.device)
    return attention_mask.sum().float()


@dataclasses.dataclass
class StepWork:
    """What one training batch ran. flop_tokens: non-pad input tokens that the body of the model
    ran on; head_positions: positions the LM head ran on (MFU counts only the FLOPs spent)."""

    batch: dict[str, torch.Tensor]
    flop_tokens: torch.Tensor | float
    head_positions: torch.Tensor | float


class Throughput(Callback):
    """Logs train/tokens_per_s and train/mfu (see the module docstring). peak_flops: one device's
    peak FLOP/s; None looks it up in PEAK_FLOPS on a GPU, and MFU is not logged where unknown."""

    def __init__(self, peak_flops: float | None = None):
        self.peak_flops = peak_flops
        self._flops_cache: dict[tuple[int, int | None], tuple[float, float]] = {}
        self._window_start: float | None = None
        self._window: torch.Tensor | None = None  # (tokens, model FLOPs) since the window start
        self._window_step = 0
        # tokens of every rank since the run started (resumes with the checkpoint): train/tokens_seen,
        # the x axis that compares runs of different batch sizes (`plot --x tokens`)
        self.tokens_seen = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int):
        if self._window_start is None:
            self._window_start, self._window_step = time.perf_counter(), trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        work, pl_module.step_work = getattr(pl_module, "step_work", None), None
        if work is not None:
            self._count(pl_module, work)
        every = max(trainer.log_every_n_steps, 1)
        if trainer.global_step == self._window_step or trainer.global_step % every or self._window is None:
            return  # accumulating, or not a logging step
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # host time must cover the GPU work it timed
        now = time.perf_counter()
        seconds = max(now - self._window_start, 1e-9)
        totals = trainer.strategy.reduce(self._window, reduce_op="sum")  # (2,) over all ranks
        pl_module.log("train/tokens_per_s", totals[0] / seconds)
        self.tokens_seen += float(totals[0])
        pl_module.log("train/tokens_seen", self.tokens_seen)
        peak = self._peak(trainer, pl_module)
        if peak is not None:
            pl_module.log("train/mfu", totals[1] / seconds / (peak * trainer.world_size))
        self._window_start, self._window_step, self._window = now, trainer.global_step, None

    def state_dict(self) -> dict[str, Any]:
        return {"tokens_seen": self.tokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tokens_seen = float(state_dict.get("tokens_seen", 0.0))

    def _count(self, pl_module: L.LightningModule, work: StepWork) -> None:
        batch = work.batch
        body, head = self._flops_per_token(pl_module, batch)
        tokens = non_pad_tokens(batch["input_ids"], batch.get("attention_mask"))
        if "decoder_input_ids" in batch:
            tokens = tokens + non_pad_tokens(batch["decoder_input_ids"], batch.get("decoder_attention_mask"))

        def on_device(x):
            return torch.as_tensor(x, dtype=torch.float32, device=tokens.device)

        done = torch.stack(
            [on_device(tokens), on_device(work.flop_tokens) * body + on_device(work.head_positions) * head]
        )
        self._window = done if self._window is None else self._window + done

    def _flops_per_token(self, pl_module: L.LightningModule, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
        """(body FLOPs per input token, LM-head FLOPs per head position) for this batch's lengths."""
        T = batch["input_ids"].shape[1]
        T_dec = batch["decoder_input_ids"].shape[1] if "decoder_input_ids" in batch else None
        key = (T, T_dec)
        if key not in self._flops_cache:
            cfg = pl_module.flops_config()
            flops = train_flops(cfg, T, T_dec if cfg.arch == "encoder_decoder" else None)
            outputs = T_dec if T_dec is not None and cfg.arch == "encoder_decoder" else T
            self._flops_cache[key] = ((flops.total - flops.lm_head) / T, flops.lm_head / outputs)
        return self._flops_cache[key]

    def _peak(self, trainer: L.Trainer, pl_module: L.LightningModule) -> float | None:
        if self.peak_flops is not None:
            return self.peak_flops
        if pl_module.device.type != "cuda":
            return None
        return peak_flops_for(torch.cuda.get_device_name(pl_module.device), str(trainer.precision))
