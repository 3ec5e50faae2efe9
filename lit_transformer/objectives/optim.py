"""Optimizer and learning-rate schedule settings shared by every objective.

Schedules are multipliers of the peak `lr` for a `LambdaLR` stepped once per optimizer step.
The multiplier for optimizer step i (0-based, the i-th update) is computed at s = i + 1, the
paper's "step_num": the first update already gets a non-zero learning rate, warmup reaches
the peak at the update numbered `warmup_steps`, and decay ends at the update numbered
`max_steps` (the last one a run takes).

With a time budget (trainer.max_time) the linear, cosine and wsd decays read a TrainingClock instead
of the step: the fraction of the budget spent, from the first training batch, sets the decay,
and warmup (still in steps) ramps up beneath it. The decay spans the whole budget because
nobody knows in advance how much of the budget warmup will take.

Optimizers: AdamW everywhere, or (optim.optimizer=muon) Muon for the weight matrices of the
Transformer blocks and AdamW for the rest, held by one MuonWithAdamW.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import nn

from lit_transformer.machine import cpu_has_bf16_matmul
from lit_transformer.model.transformer import Block
from lit_transformer.recipe.schema import OptimConfig


class TrainingClock:
    """Seconds of training, counted while it runs (`start` / `stop`; training.TimeBudget runs
    it from the first training batch and stops it for validation). `elapsed` is the reading a
    schedule sees: set by `mark` once per optimizer step, so that every rank of a data-parallel
    run agrees on it (they mark the same value) and a resumed run starts from the saved one."""

    def __init__(self, elapsed: float = 0.0):
        self.reset(elapsed)

    def reset(self, elapsed: float = 0.0) -> None:
        self.elapsed = float(elapsed)
        self._total = float(elapsed)  # seconds counted up to the last stop
        self._since: float | None = None  # perf_counter() at the last start, None while stopped

    def start(self) -> None:
        if self._since is None:
            self._since = time.perf_counter()

    def stop(self) -> None:
        if self._since is not None:
            self._total += time.perf_counter() - self._since
            self._since = None

    def read(self) -> float:
        """The seconds counted so far, now."""
        return self._total + (time.perf_counter() - self._since if self._since is not None else 0.0)

    def mark(self, seconds: float | None = None) -> float:
        """Set the reading schedules see: `seconds` (e.g. agreed over ranks), or `read()`."""
        self.elapsed = self.read() if seconds is None else float(seconds)
        return self.elapsed


def _decay(progress: float, optim: OptimConfig) -> float:
    floor = optim.min_lr_ratio
    if optim.schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    if optim.schedule == "wsd":
        # stable at the peak, then 1 - sqrt over the cooldown (Hagele et al. 2024, section 3)
        cooldown = (progress - (1.0 - optim.cooldown_fraction)) / optim.cooldown_fraction
        return 1.0 if cooldown <= 0 else floor + (1.0 - floor) * (1.0 - math.sqrt(min(cooldown, 1.0)))
    # Loshchilov & Hutter 2017 (SGDR) half-cosine, without restarts, down to the floor.
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_multiplier(
    step: int,
    optim: OptimConfig,
    max_steps: int | None = None,
    d_model: int | None = None,
    *,
    elapsed: float | None = None,
    max_time: float | None = None,
) -> float:
    """The factor on `optim.lr` for optimizer step `step` (0-based); with `max_time`, the linear,
    cosine and wsd decays follow `elapsed` seconds of training out of `max_time` instead of the step."""
    s = step + 1
    warmup = optim.warmup_steps
    if optim.schedule == "inverse_sqrt":
        # Vaswani et al. 2017, 5.3: d_model^-0.5 * min(s^-0.5, s * warmup^-1.5); the two terms
        # meet at s = warmup, the peak. `lr` multiplies it (1.0 reproduces the paper).
        if d_model is None:
            raise ValueError("the inverse_sqrt schedule needs d_model")
        ramp = s * warmup**-1.5 if warmup > 0 else math.inf
        return d_model**-0.5 * min(s**-0.5, ramp)
    if max_time is not None and optim.schedule != "constant":
        if elapsed is None:
            raise ValueError("a schedule with max_time needs the elapsed training time")
        # the decay over the whole budget, warmup's ramp beneath it: min() has no jump where
        # warmup ends, wherever in the budget that happens to be
        ramp = s / warmup if s < warmup else 1.0
        return min(ramp, _decay(min(max(elapsed, 0.0) / max_time, 1.0), optim))
    if s < warmup:
        return s / warmup
    if optim.schedule == "constant":
        return 1.0
    if max_steps is None or max_steps <= 0:
        raise ValueError(f"the {optim.schedule} schedule needs max_steps (got {max_steps})")
    span = max(max_steps - warmup, 1)
    progress = min(max(s - warmup, 0) / span, 1.0)
    return _decay(progress, optim)


def make_scheduler(
    optimizer: torch.optim.Optimizer,
    optim: OptimConfig,
    max_steps: int | None = None,
    d_model: int | None = None,
    *,
    max_time: float | None = None,
    clock: TrainingClock | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over every parameter group (groups keep their own base lr, e.g. a lower
    backbone lr, or Muon's), to be stepped every optimizer step. With `max_time` the lambda
    reads `clock.elapsed` (seconds of training) when it is stepped. The lambdas are closures,
    not objects: LambdaLR's state_dict then leaves them out (it would pickle an object's
    attributes, clock included, into the checkpoint)."""
    if max_time is not None:
        if not max_time > 0:
            raise ValueError(f"max_time={max_time} must be positive")
        if clock is None:
            raise ValueError("a schedule with max_time needs a clock")
    elif optim.schedule in ("linear", "cosine", "wsd") and (max_steps is None or max_steps <= 0):
        raise ValueError(f"the {optim.schedule} schedule needs a positive max_steps (got {max_steps})")
    if optim.schedule == "inverse_sqrt" and d_model is None:
        raise ValueError("the inverse_sqrt schedule needs d_model")
    if max_time is None:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, optim, max_steps, d_model))
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, optim, max_steps, d_model, elapsed=clock.elapsed, max_time=max_time)
    )


def parameter_groups(
    module: nn.Module, weight_decay: float, *, lr_scales: dict[str, float] | None = None, muon: bool = False
) -> list[dict[str, Any]]:
    """AdamW groups: decay only the >=2-D weights of Linear layers (Loshchilov & Hutter 2019
    decouple decay; GPT-2/BERT practice exempts biases, norm gains and embeddings, whose
    scale is meaningful). A weight tied between an Embedding and a Linear (the LM head) is an
    embedding and appears once, under its first name.

    `lr_scales` maps a module-name prefix (e.g. "backbone.") to a factor on the group's lr;
    each group then carries an `lr_scale` key that `build_optimizer` applies.
    Every group carries `names` (parameter names) for inspection and tests.

    `muon`: the weights of the Linear layers inside Transformer blocks (attention and
    feed-forward projections) go to groups marked `"muon": True`, after the AdamW groups (so
    the first group, whose lr train/lr logs, is AdamW's). They get no weight decay: the 2024
    speedrun records' Muon had none, and Muon's decoupled decay is scaled by Muon's lr (0.02,
    tens of times AdamW's), so optim.weight_decay would not mean the same there.
    """
    linear_weights, embeddings, block_matrices = set(), set(), set()
    for sub in module.modules():
        if isinstance(sub, nn.Linear) and sub.weight.dim() >= 2:
            linear_weights.add(id(sub.weight))
        elif isinstance(sub, nn.Embedding):
            embeddings.add(id(sub.weight))
        if muon and isinstance(sub, Block):
            block_matrices.update(
                id(m.weight) for m in sub.modules() if isinstance(m, nn.Linear) and m.weight.dim() == 2
            )
    lr_scales = lr_scales or {}
    groups: dict[tuple[bool, bool, float], dict[str, Any]] = {}
    for name, param in module.named_parameters():  # deduplicates tied parameters
        if not param.requires_grad:
            continue
        in_muon = id(param) in block_matrices and id(param) not in embeddings
        decay = id(param) in linear_weights and id(param) not in embeddings and not in_muon
        scale = next((f for prefix, f in lr_scales.items() if name.startswith(prefix)), 1.0)
        group = groups.setdefault(
            (in_muon, decay, scale),
            {
                "params": [],
                "names": [],
                "weight_decay": weight_decay if decay else 0.0,
                "lr_scale": scale,
                **({"muon": True} if in_muon else {}),
            },
        )
        group["params"].append(param)
        group["names"].append(name)
    return [groups[key] for key in sorted(groups, key=lambda k: (k[0], not k[1], -k[2]))]


def build_optimizer(
    groups: list[dict[str, Any]], optim: OptimConfig, *, allow_fused: bool = True
) -> torch.optim.Optimizer:
    """AdamW; the fused kernel when every parameter lives on a GPU (one launch for the whole
    update instead of one per tensor group), or on the CPU as plain tensors, where it gives the
    same update several times faster (benchmarks/run.py measures the step). FSDP2's sharded CPU
    parameters (DTensor) keep the default path. Groups marked "muon" (parameter_groups) go to
    Muon, inside a MuonWithAdamW, when optim.optimizer is muon."""
    from torch.distributed.tensor import DTensor

    muon_groups = [g for g in groups if g.get("muon")] if optim.optimizer == "muon" else []
    adamw_groups = [g for g in groups if not any(g is m for m in muon_groups)]
    params = [p for g in adamw_groups for p in g["params"]]
    fused = (
        allow_fused
        and bool(params)
        and (
            all(p.device.type == "cuda" for p in params)
            or all(p.device.type == "cpu" and not isinstance(p, DTensor) for p in params)
        )
    )
    for group in adamw_groups:
        group["lr"] = optim.lr * group.get("lr_scale", 1.0)
    adamw = torch.optim.AdamW(
        adamw_groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, fused=fused or None
    )
    if not muon_groups:
        return adamw
    if any(isinstance(p, DTensor) for g in muon_groups for p in g["params"]):
        # Newton-Schulz orthogonalises a whole matrix; a shard's would be another update
        raise ValueError("optim.optimizer=muon needs whole weight matrices, not FSDP2 shards")
    for group in muon_groups:
        group["lr"] = optim.muon_lr * group.get("lr_scale", 1.0)
    # nesterov and the Newton-Schulz coefficients and 5 steps: torch's defaults, the speedrun's
    on_cpu = all(p.device.type == "cpu" for g in muon_groups for p in g["params"])
    muon_class = Float32Muon if on_cpu and not cpu_has_bf16_matmul() else torch.optim.Muon
    muon = muon_class(muon_groups, lr=optim.muon_lr, weight_decay=0.0, momentum=optim.muon_momentum)
    return MuonWithAdamW(adamw, muon)


class Float32Muon(torch.optim.Muon):
    """torch.optim.Muon with the Newton-Schulz iteration in float32. torch runs it in bfloat16,
    which a CPU without bf16 matrix instructions (AVX2, AVX-512 without AVX512-BF16) emulates
    many times slower than float32: the optimizer step then outweighs the model's. Same state
    ("momentum_buffer"), groups and update otherwise, so checkpoints move between the two."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for group in self.param_groups:
            lr, momentum = float(group["lr"]), group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = newton_schulz(update.float(), group["ns_coefficients"], group["ns_steps"], group["eps"])
                scale = muon_lr_scale(group["adjust_lr_fn"], *p.shape[:2])
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-lr * scale)
        return loss


def muon_lr_scale(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's learning-rate adjustment for a rows x cols matrix (its adjust_lr_fn)."""
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols)) if adjust_lr_fn == "match_rms_adamw" else 1.0


def run_closure(closure) -> Any:
    """An optimizer step's closure, run with gradients on (torch's optimizers' prologue); None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def newton_schulz(grad: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalisation of Muon (Jordan et al. 2024), in grad's dtype:
    X / |X|, then X <- aX + (bA + cA^2)X with A = XX^T, on the wide orientation."""
    a, b, c = coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.T if tall else grad
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers in neural networks") for
    the block matrices and AdamW for everything else (embeddings, the LM head, norms, biases:
    Muon's orthogonalised update suits only hidden 2-D weights), as one optimizer, as the
    modded-nanoGPT speedrun pairs them: Lightning's automatic optimization steps one optimizer
    per step, and one LambdaLR over all the groups gives both the same multiplier.

    Its param_groups are AdamW's then Muon's (the same dicts: a scheduler or gradient clipping
    reaches both), its `state` is shared with both, and state_dict/load_state_dict are torch's
    for one optimizer over all the groups; `step` runs the closure once, then both updates."""

    def __init__(self, adamw: torch.optim.AdamW, muon: torch.optim.Muon):
        self.adamw, self.muon = adamw, muon
        super().__init__([*adamw.param_groups, *muon.param_groups], defaults={})
        self._share()

    def _share(self) -> None:
        """Point both optimizers at this one's groups and state (load_state_dict replaces them;
        the parameter sets are disjoint, so one state dict serves both)."""
        n = len(self.adamw.param_groups)
        self.adamw.param_groups, self.muon.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.adamw.state = self.muon.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        self.adamw.step()
        self.muon.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share()
