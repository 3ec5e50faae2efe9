"""Leaf layers: norms and feed-forward networks. They take plain numbers, not a config.

Shape legend: B batch, T length, C model width (d_model), F feed-forward width (d_ff).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Zhang & Sennrich 2019: x / rms(x) * g, no mean subtraction and no bias (T5, LLaMA)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            # torch's fused kernel: one pass, statistics accumulated in float32 even for bf16
            # input; equal to the formula below in float32 and several times faster forward +
            # backward on CPU (benchmarks/kernels.py measures both).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Mixed dtypes (bf16 activations, float32 weight) have no fused kernel.
        # Statistics in float32: in bf16 the mean of squares loses the small components.
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    raise ValueError(f"unknown norm {kind!r}; expected 'layernorm' or 'rmsnorm'")


def activation_fn(name: str):
    """The elementwise nonlinearity of a (possibly gated) feed-forward network."""
    if name == "relu":
        return F.relu
    if name == "relu2":
        # So et al. 2021 (Primer, abstract): one of the two changes its search found to carry
        # most of the gain; modded-nanoGPT's MLP uses it too.
        return _relu_squared
    if name in ("gelu", "geglu"):
        return F.gelu  # exact erf form (BERT; Shazeer 2020 GeGLU)
    if name in ("gelu_tanh", "geglu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")  # GPT-2, T5 v1.1 ("gelu_new")
    if name == "swiglu":
        return F.silu
    raise ValueError(f"unknown activation {name!r}")


def _relu_squared(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


class FeedForward(nn.Module):
    """Position-wise FFN. Plain: down(act(up(x))). Gated (Shazeer 2020): down(act(gate(x)) * up(x))."""

    def __init__(self, d_model: int, d_ff: int, activation: str, bias: bool = True, gated: bool = False):
        super().__init__()
        self.act = activation_fn(activation)
        self.gate = nn.Linear(d_model, d_ff, bias=bias) if gated else None
        self.up = nn.Linear(d_model, d_ff, bias=bias)
        self.down = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        if self.gate is None:
            return self.down(self.act(self.up(x)))  # (B, T, F) inside
        return self.down(self.act(self.gate(x)) * self.up(x))
