"""Optimizer and learning-rate schedule settings shared by every objective.

Schedules are multipliers of the peak `lr` for a `LambdaLR` stepped once per optimizer step.
The multiplier for optimizer step i (0-based, the i-th update) is computed at s = i + 1, the
paper's "step_num": the first update already gets a non-zero learning rate, warmup reaches
the peak at the update numbered `warmup_steps`, and decay ends at the update numbered
`max_steps` (the last one a run takes).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..schema import OptimConfig


def lr_multiplier(step: int, optim: OptimConfig, max_steps: int | None = None, d_model: int | None = None) -> float:
    """The factor on `optim.lr` for optimizer step `step` (0-based)."""
    s = step + 1
    warmup = optim.warmup_steps
    if optim.schedule == "inverse_sqrt":
        # Vaswani et al. 2017, 5.3: d_model^-0.5 * min(s^-0.5, s * warmup^-1.5); the two terms
        # meet at s = warmup, the peak. `lr` multiplies it (1.0 reproduces the paper).
        if d_model is None:
            raise ValueError("the inverse_sqrt schedule needs d_model")
        ramp = s * warmup ** -1.5 if warmup > 0 else math.inf
        return d_model ** -0.5 * min(s ** -0.5, ramp)
    if s < warmup:
        return s / warmup
    if optim.schedule == "constant":
        return 1.0
    if max_steps is None or max_steps <= 0:
        raise ValueError(f"the {optim.schedule} schedule needs max_steps (got {max_steps})")
    span = max(max_steps - warmup, 1)
    progress = min(max(s - warmup, 0) / span, 1.0)
    floor = optim.min_lr_ratio
    if optim.schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    # Loshchilov & Hutter 2017 (SGDR) half-cosine, without restarts, down to the floor.
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig, max_steps: int | None = None,
                   d_model: int | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over every parameter group (groups keep their own base lr, e.g. a lower
    backbone lr), to be stepped every optimizer step."""
    if optim.schedule in ("linear", "cosine") and (max_steps is None or max_steps <= 0):
        raise ValueError(f"the {optim.schedule} schedule needs a positive max_steps (got {max_steps})")
    if optim.schedule == "inverse_sqrt" and d_model is None:
        raise ValueError("the inverse_sqrt schedule needs d_model")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, optim, max_steps, d_model)
    )


def parameter_groups(module: nn.Module, weight_decay: float, *, lr_scales: dict[str, float] | None = None
                     ) -> list[dict[str, Any]]:
    """AdamW groups: decay only the >=2-D weights of Linear layers (Loshchilov & Hutter 2019
    decouple decay; GPT-2/BERT practice exempts biases, norm gains and embeddings, whose
    scale is meaningful). A weight tied between an Embedding and a Linear (the LM head) is an
    embedding and appears once, under its first name.

    `lr_scales` maps a module-name prefix (e.g. "backbone.") to a factor on the group's lr;
    each group then carries an `lr_scale` key that `build_optimizer` applies.
    Every group carries `names` (parameter names) for inspection and tests.
    """
    linear_weights, embeddings = set(), set()
    for sub in module.modules():
        if isinstance(sub, nn.Linear) and sub.weight.dim() >= 2:
            linear_weights.add(id(sub.weight))
        elif isinstance(sub, nn.Embedding):
            embeddings.add(id(sub.weight))
    lr_scales = lr_scales or {}
    groups: dict[tuple[bool, float], dict[str, Any]] = {}
    for name, param in module.named_parameters():  # deduplicates tied parameters
        if not param.requires_grad:
            continue
        decay = id(param) in linear_weights and id(param) not in embeddings
        scale = next((f for prefix, f in lr_scales.items() if name.startswith(prefix)), 1.0)
        group = groups.setdefault((decay, scale), {
            "params": [], "names": [], "weight_decay": weight_decay if decay else 0.0, "lr_scale": scale,
        })
        group["params"].append(param)
        group["names"].append(name)
    return [groups[key] for key in sorted(groups, key=lambda k: (not k[0], -k[1]))]


def build_optimizer(groups: list[dict[str, Any]], optim: OptimConfig, *, allow_fused: bool = True) -> torch.optim.AdamW:
    """AdamW; the fused kernel when every parameter lives on a GPU (one launch for the whole
    update instead of one per tensor group), or on the CPU as plain tensors, where it gives the
    same update several times faster (benchmarks/run.py measures the step). FSDP2's sharded CPU
    parameters (DTensor) keep the default path."""
    from torch.distributed.tensor import DTensor

    params = [p for g in groups for p in g["params"]]
    fused = allow_fused and bool(params) and (
        all(p.device.type == "cuda" for p in params)
        or all(p.device.type == "cpu" and not isinstance(p, DTensor) for p in params)
    )
    for group in groups:
        group["lr"] = optim.lr * group.get("lr_scale", 1.0)
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                             fused=fused or None)
