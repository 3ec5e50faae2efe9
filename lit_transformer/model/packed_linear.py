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

The packed weights are copies (one more copy of every linear weight, the LM head included,
while the context is open). Each call checks that the weight is still the one packed (same
storage, dtype and version counter) and falls back to `F.linear` for anything the packed
kernel does not cover: gradients, another dtype or device, a weight changed in place.

Shape legend: N rows (any leading dims), C input features, O output features.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

_PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packing_available(model: nn.Module) -> bool:
    """Whether `packed_linears` would pack anything: a CPU model in float32 or bfloat16, none of
    its modules compiled, and a torch built with oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return False
    # A compiled module (nn.Module.compile) would trace the swapped forward: inductor cannot
    # lower the packed tensor, and swapping the attribute in and out would recompile each time.
    if any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()):
        return False
    weight = next((m.weight for m in model.modules() if type(m) is nn.Linear), None)
    return weight is not None and weight.device.type == "cpu" and weight.dtype in _PACKED_DTYPES


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


@contextlib.contextmanager
def packed_linears(model: nn.Module, rows: int = 1) -> Iterator[int]:
    """Run the nn.Linear modules of `model` on pre-packed weights inside the block; yields how
    many were packed (0 where packing does not apply: not CPU, another dtype, no oneDNN).
    rows: the rows a decoding step will multiply (batch x beams); oneDNN picks the layout for
    it (a float32 layout for 1 row runs 8 rows markedly slower than one for 8, and vice versa).
    Only plain nn.Linear modules without hooks are packed (a subclass or adapter keeps its own
    forward). Nested use packs once: an inner block over an already packed model is a no-op."""
    patched: list[nn.Linear] = []
    if packing_available(model):
        for module in model.modules():
            if (
                type(module) is nn.Linear
                # a plain tensor: not a sharded (FSDP2 DTensor) or otherwise wrapped weight
                and type(module.weight.data) is torch.Tensor
                and "forward" not in module.__dict__
                and not (module._forward_hooks or module._forward_pre_hooks)
                and module.weight.dtype in _PACKED_DTYPES
                and module.weight.device.type == "cpu"
            ):
                module.forward = _PackedForward(
                    module, max(1, rows)
                )  # an instance attribute shadows the class's forward
                patched.append(module)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward


__all__ = ["packed_linears", "packing_available"]
