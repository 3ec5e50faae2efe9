"""Optimizer and learning-rate schedule settings shared by every objective."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Schedule = Literal["constant", "linear", "cosine", "inverse_sqrt"]


@dataclass
class OptimConfig:
    lr: float = 3e-4  # peak learning rate; for inverse_sqrt, a multiplier on the 2017 paper's formula
    weight_decay: float = 0.1  # AdamW decay on matrices only (not biases, norms, embeddings' ... see param_groups)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    schedule: Schedule = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # cosine/linear decay floor as a fraction of lr
    label_smoothing: float = 0.0  # the 2017 paper used 0.1
