"""Position information: absolute (sinusoidal, learned) added to embeddings, RoPE applied to
queries and keys, and additive attention biases (ALiBi, T5 relative buckets).

Everything here is computed from explicit position tensors, so left-padded batches and
KV-cache decoding (where positions start past zero) need no special cases. Nothing is a
buffer: tables are rebuilt per call (cheap next to the matrix products), so a model built
on the meta device needs no buffer re-initialisation.

Shape legend: B batch, T query length, S key length, H heads, D head dim, C model width.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def sinusoidal(positions: torch.Tensor, dim: int, base: float = 10000.0) -> torch.Tensor:
    """Vaswani et al. 2017, 3.5: PE(p, 2i) = sin(p / base^(2i/C)), PE(p, 2i+1) = cos(...).

    positions (B, T) -> (B, T, C), interleaved sin/cos as in the paper's formula.
    """
    half = torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32)  # (C/2,)
    inv_freq = base ** (-half / dim)
    angles = positions.float()[..., None] * inv_freq  # (B, T, C/2)
    table = torch.stack((angles.sin(), angles.cos()), dim=-1)  # (B, T, C/2, 2)
    return table.flatten(-2)[..., :dim]  # (B, T, C)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float = 10000.0):
    """Su et al. 2021 rotary embedding tables for rotate-half layout (GPT-NeoX / LLaMA in HF).

    positions (B, T) -> cos, sin each (B, 1, T, D) to broadcast over heads.
    """
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv_freq  # (B, T, D/2)
    angles = torch.cat((angles, angles), dim=-1)  # (B, T, D)
    return angles.cos()[:, None], angles.sin()[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+D/2}) by position-dependent angles. x (B, H, T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Press et al. 2022, 3: geometric slopes 2^(-8/n), 2^(-16/n), ...; for a head count that
    is not a power of two, the closest power's slopes plus every other slope of the next one."""

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_two_slopes(closest)
    if closest < n_heads:
        slopes += power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes)


def alibi_bias(q_positions: torch.Tensor, k_positions: torch.Tensor, n_heads: int) -> torch.Tensor:
    """-slope_h * |p_q - p_k|: (B, T), (B, S) -> (B, H, T, S). For causal models only keys at or
    before the query are visible, where this equals the paper's slope * (p_k - p_q)."""
    distance = (q_positions[:, :, None] - k_positions[:, None, :]).abs().float()  # (B, T, S)
    slopes = alibi_slopes(n_heads).to(q_positions.device)
    return -slopes[None, :, None, None] * distance[:, None]  # (B, H, T, S)


def t5_bucket(relative: torch.Tensor, bidirectional: bool, n_buckets: int, max_distance: int) -> torch.Tensor:
    """Raffel et al. 2020: relative offsets (key - query) into log-spaced buckets.

    Half the buckets are exact small distances, the rest grow logarithmically up to
    max_distance; bidirectional stacks spend half the buckets on each direction.
    """
    buckets = torch.zeros_like(relative)
    if bidirectional:
        n_buckets //= 2
        buckets = buckets + (relative > 0).long() * n_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)  # only the past is visible to a causal query
    exact = n_buckets // 2
    is_small = distance < exact
    log_ratio = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    large = exact + (log_ratio * (n_buckets - exact)).long()
    large = large.clamp(max=n_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class RelativePositionBias(nn.Module):
    """T5's learned scalar bias per (bucket, head), shared by every layer of one stack."""

    def __init__(self, n_heads: int, n_buckets: int, max_distance: int, bidirectional: bool):
        super().__init__()
        self.n_buckets, self.max_distance, self.bidirectional = n_buckets, max_distance, bidirectional
        self.embedding = nn.Embedding(n_buckets, n_heads)

    def forward(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        relative = k_positions[:, None, :] - q_positions[:, :, None]  # (B, T, S)
        buckets = t5_bucket(relative, self.bidirectional, self.n_buckets, self.max_distance)
        return self.embedding(buckets).permute(0, 3, 1, 2)  # (B, T, S, H) -> (B, H, T, S)
