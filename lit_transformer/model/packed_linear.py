"""Decoding's matrix products on CPU with weights pre-packed for oneDNN.

A decoding step multiplies one token per row by every weight matrix of the model, so it is
bound by reading the weights. `F.linear` hands oneDNN (or MKL) a plain row-major weight and
reaches about half the memory bandwidth a streaming read gets on the 2-core development
machines; the same product with the weight reordered once into oneDNN's blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, what torch.compile's CPU freezing pass does) runs
close to twice as fast at 1 to 32 rows, in float32 and bfloat16 (`python
benchmarks/generation.py`, benchmarks/README.md). Eager decoding gets it without compiling:
`packed_linears(model)` swaps each nn.Linear's forward for the packed product while the
context is open and restores it after.

The packed layout does not win on every CPU: on a 2-core Intel Xeon with AMX, always packing
decoded at 0.87x transformers' plain `F.linear` at batch 1 (issue #38; benchmarks/README.md,
"Decoding on CPU, per CPU kind"). So by default
(`when="faster"`) the choice is a measurement on the machine it runs on: the first time a model
of a given set of weight shapes decodes `rows` rows in a process, one step's worth of products
(every linear once, at `rows` rows) is timed packed and plain in alternation, MEASURE_ROUNDS
times each after WARMUP_PASSES untimed ones, and the side with the lower median wins (`packed_is_faster`).
The answer is cached per (rows, threads, weight shapes and dtypes), so it costs one step's
products 16 times, once. `when="always"` packs without measuring.

The packed weights are copies (one more copy of every linear weight, the LM head included,
while the context is open). Each call checks that the weight is still the one packed (same
storage, dtype and version counter) and falls back to `F.linear` for anything the packed
kernel does not cover: gradients, another dtype or device, a weight changed in place.

Shape legend: N rows (any leading dims), C input features, O output features.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

MEASURE_ROUNDS = 5  # alternating timed passes per side: a median of 5 outlasts one descheduled pass
# untimed passes per side first: a process's first packed passes run slower than its later ones,
# which after a single warm-up pass tipped close choices towards plain F.linear
# (benchmarks/README.md, "Decoding on CPU, per CPU kind")
WARMUP_PASSES = 3
# (rows, torch threads, ((O, C, dtype, bias), ...) of the packed linears) -> packed was faster
_CHOICES: dict[tuple, bool] = {}
_MEDIANS: dict[tuple, tuple[float, float]] = {}  # the same keys -> (packed, plain) median seconds


def _packed_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes oneDNN can pack here: bfloat16 needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT;
    on an AVX2-only CPU its reorder raises, so bf16 weights keep plain F.linear there."""
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def packing_available(model: nn.Module) -> bool:
    """Whether `packed_linears` would pack anything: a CPU model in float32 or bfloat16 (where
    oneDNN packs bfloat16: `_packed_dtypes`), none of its modules compiled, and a torch built with oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return False
    # A compiled module (nn.Module.compile) would trace the swapped forward: inductor cannot
    # lower the packed tensor, and swapping the attribute in and out would recompile each time.
    if any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()):
        return False
    weight = next((m.weight for m in model.modules() if type(m) is nn.Linear), None)
    return weight is not None and weight.device.type == "cpu" and weight.dtype in _packed_dtypes()


class _PackedForward:
    """Stands in for one nn.Linear's forward: the packed product when it applies, else F.linear."""

    def __init__(self, linear: nn.Linear, rows: int):
        self.linear = linear
        weight = linear.weight
        self.key = _identity(weight)
        # (O, C) in a blocked layout chosen for `rows` input rows; it works for any number
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (N..., C) -> (N..., O)
        linear = self.linear
        if (
            torch.compiler.is_compiling()  # under torch.compile of an outer function: traced as F.linear
            or x.dtype != self.packed.dtype
            or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or linear.weight.requires_grad))
            or _identity(linear.weight) != self.key
        ):
            return F.linear(x, linear.weight, linear.bias)
        bias = None if linear.bias is None else linear.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def _identity(weight: torch.Tensor) -> tuple:
    """What changes when a weight is replaced or written to: a stale pack is never used."""
    return weight.data_ptr(), weight.dtype, weight._version


def packed_is_faster(packed_seconds: list[float], plain_seconds: list[float]) -> bool:
    """The choice between the two paths: packed when the median of its timed passes is below
    plain F.linear's (a tie keeps the plain path, which needs no second copy of the weights)."""
    if not packed_seconds or not plain_seconds:
        raise ValueError(f"no timings to choose from: {len(packed_seconds)} packed, {len(plain_seconds)} plain")
    return statistics.median(packed_seconds) < statistics.median(plain_seconds)


def choices() -> dict[tuple, bool]:
    """The choices measured so far in this process: (rows, threads, weight shapes) -> packed."""
    return dict(_CHOICES)


def measured_choice(model: nn.Module, rows: int) -> dict | None:
    """What `packed_linears(model, rows)` measured for this model's weight shapes at `rows` rows
    and the current threads: {"packed": chosen, "packed_s", "plain_s": median seconds of one
    step's products}; None before any measurement (or where nothing is packable)."""
    key = _key(_targets(model), max(1, rows))
    if key not in _MEDIANS:
        return None
    packed_s, plain_s = _MEDIANS[key]
    return {"packed": _CHOICES[key], "packed_s": packed_s, "plain_s": plain_s}


def _targets(model: nn.Module) -> list[nn.Linear]:
    """The linears `packed_linears` packs: plain nn.Linear modules without hooks or a forward of
    their own, whose weight is a plain CPU tensor (not a sharded DTensor) of a packed dtype."""
    if not packing_available(model):
        return []
    dtypes = _packed_dtypes()
    return [
        module
        for module in model.modules()
        if type(module) is nn.Linear
        and type(module.weight.data) is torch.Tensor
        and "forward" not in module.__dict__
        and not (module._forward_hooks or module._forward_pre_hooks)
        and module.weight.dtype in dtypes
        and module.weight.device.type == "cpu"
    ]


def _key(targets: list[nn.Linear], rows: int) -> tuple:
    shapes = tuple((*m.weight.shape, m.weight.dtype, m.bias is not None) for m in targets)
    return rows, torch.get_num_threads(), shapes


def _measure(forwards: list[_PackedForward], rows: int) -> tuple[list[float], list[float]]:
    """Seconds of one decoding step's products (every linear once at `rows` rows), packed and
    plain F.linear in alternation, so that both sides share the machine's background load."""
    g = torch.Generator().manual_seed(0)
    inputs = {}  # (C, dtype) -> (rows, C)
    for f in forwards:
        key = (f.linear.in_features, f.packed.dtype)
        if key not in inputs:
            inputs[key] = torch.randn(rows, key[0], generator=g).to(key[1])
    pairs = [(f, inputs[f.linear.in_features, f.packed.dtype]) for f in forwards]

    def packed() -> None:
        for f, x in pairs:
            f(x)

    def plain() -> None:
        for f, x in pairs:
            F.linear(x, f.linear.weight, f.linear.bias)

    times: tuple[list[float], list[float]] = ([], [])
    with torch.no_grad():
        for _ in range(WARMUP_PASSES):  # untimed: oneDNN primitives, first touch of the packed copies
            packed(), plain()
        for _ in range(MEASURE_ROUNDS):
            for side, run in zip(times, (packed, plain)):
                start = time.perf_counter()
                run()
                side.append(time.perf_counter() - start)
    return times


@contextlib.contextmanager
def packed_linears(model: nn.Module, rows: int = 1, *, when: Literal["faster", "always"] = "faster") -> Iterator[int]:
    """Run the nn.Linear modules of `model` on pre-packed weights inside the block; yields how
    many were packed (0 where packing does not apply: not CPU, another dtype, no oneDNN; or,
    with when="faster", where plain F.linear measured faster on this machine: module docstring).
    rows: the rows a decoding step will multiply (batch x beams); oneDNN picks the layout for
    it (a float32 layout for 1 row runs 8 rows markedly slower than one for 8, and vice versa).
    Only plain nn.Linear modules without hooks are packed (a subclass or adapter keeps its own
    forward). Nested use packs once: an inner block over an already packed model is a no-op."""
    if when not in ("faster", "always"):
        raise ValueError(f"packed_linears: when={when!r}; choose 'faster' or 'always'")
    rows = max(1, rows)
    targets = _targets(model)
    key = _key(targets, rows)
    if when == "faster" and targets and _CHOICES.get(key) is False:
        targets = []  # measured before: plain F.linear wins, and packing would cost a copy
    forwards = [_PackedForward(module, rows) for module in targets]
    if when == "faster" and forwards and key not in _CHOICES:
        packed_s, plain_s = _measure(forwards, rows)
        _CHOICES[key] = packed_is_faster(packed_s, plain_s)
        _MEDIANS[key] = statistics.median(packed_s), statistics.median(plain_s)
        if not _CHOICES[key]:
            forwards = []
    for forward in forwards:
        forward.linear.forward = forward  # an instance attribute shadows the class's forward
    try:
        yield len(forwards)
    finally:
        for forward in forwards:
            del forward.linear.forward


__all__ = ["choices", "measured_choice", "packed_is_faster", "packed_linears", "packing_available"]
