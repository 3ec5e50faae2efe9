"""Scaled dot-product attention (Vaswani et al. 2017, 3.2), multi-head with grouped or
multi-query key/value heads, self- and cross-attention, and the KV cache for decoding.

Shape legend: B batch, T query length, S key length, H query heads, K key/value heads,
D head dim, C model width, L layers, M cache capacity.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .positions import apply_rope


def masked_value(dtype: torch.dtype) -> float:
    # The most negative finite number rather than -inf: a query whose keys are all masked
    # (a left-padding position) then gets a uniform softmax instead of NaNs.
    return torch.finfo(dtype).min


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    is_causal: bool,
    scale: float,
    dropout: float,
    impl: str,
) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v.  q (B, H, T, D), k and v (B, K, S, D) -> (B, H, T, D).

    `bias` is additive, broadcastable to (B, H, T, S). `is_causal` (only without bias) asks
    for the lower-triangular mask aligned at the top-left, as in training without a cache.
    """
    n_heads, n_kv = q.shape[1], k.shape[1]
    if impl == "sdpa":
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, dropout_p=dropout, is_causal=is_causal, scale=scale,
            enable_gqa=n_kv != n_heads,
        )
    # Math path: the explicit reference, kept readable rather than fast.
    if n_kv != n_heads:
        k = k.repeat_interleave(n_heads // n_kv, dim=1)  # (B, H, S, D)
        v = v.repeat_interleave(n_heads // n_kv, dim=1)
    scores = (q @ k.transpose(-2, -1)).float() * scale  # (B, H, T, S)
    if is_causal:
        T, S = scores.shape[-2:]
        future = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, masked_value(scores.dtype))
    if bias is not None:
        scores = scores + bias.float()
    weights = scores.softmax(dim=-1).to(q.dtype)
    weights = F.dropout(weights, p=dropout, training=dropout > 0)
    return weights @ v  # (B, H, T, D)


class KVCache:
    """Keys and values of every decoder layer, pre-allocated to a capacity M so a decoding
    step writes in place instead of concatenating; plus the key padding mask and positions
    of everything cached (for masks and relative biases), and the cross-attention keys and
    values, computed once from the encoder output."""

    def __init__(self, n_layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (n_layers, batch, kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, K, M, D)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.key_mask = torch.zeros(batch, capacity, dtype=torch.bool, device=device)  # (B, M)
        self.positions = torch.zeros(batch, capacity, dtype=torch.long, device=device)  # (B, M)
        self.cross: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layers
        self.length = 0  # tokens cached so far
        self.capacity = capacity

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows `index` (beam search: the surviving beams' parents)."""
        self.keys = self.keys.index_select(1, index)
        self.values = self.values.index_select(1, index)
        self.key_mask = self.key_mask.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self.cross = [None if kv is None else (kv[0].index_select(0, index), kv[1].index_select(0, index))
                      for kv in self.cross]


class Attention(nn.Module):
    """Multi-head attention with K <= H key/value heads (K = H: MHA, K = 1: MQA, else GQA)."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, *, bias: bool,
                 dropout: float, scale: bool, impl: str):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = 1.0 / math.sqrt(head_dim) if scale else 1.0
        self.dropout, self.impl = dropout, impl
        self.q = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        self.k = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.v = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.o = nn.Linear(n_heads * head_dim, d_model, bias=bias)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, n, self.head_dim).transpose(1, 2)  # (B, n, T, D)

    def forward(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        is_causal: bool = False,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        memory: torch.Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        """Self-attention over x (B, T, C), or cross-attention to `memory` (B, S, C) when given."""
        B, T, _ = x.shape
        q = self._heads(self.q(x), self.n_heads)  # (B, H, T, D)
        if memory is not None:
            k, v = self._cross_keys_values(memory, cache, layer)
        else:
            k = self._heads(self.k(x), self.n_kv_heads)  # (B, K, T, D)
            v = self._heads(self.v(x), self.n_kv_heads)
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            if cache is not None:
                start, end = cache.length, cache.length + T
                cache.keys[layer, :, :, start:end] = k
                cache.values[layer, :, :, start:end] = v
                k, v = cache.keys[layer, :, :, :end], cache.values[layer, :, :, :end]  # (B, K, S, D)
        dropout = self.dropout if self.training else 0.0
        out = attend(q, k, v, bias, is_causal=is_causal, scale=self.scale, dropout=dropout, impl=self.impl)
        return self.o(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))  # (B, T, C)

    def _cross_keys_values(self, memory: torch.Tensor, cache: KVCache | None, layer: int):
        if cache is not None and cache.cross[layer] is not None:
            return cache.cross[layer]  # the encoder output does not change while decoding
        k = self._heads(self.k(memory), self.n_kv_heads)  # (B, K, S, D)
        v = self._heads(self.v(memory), self.n_kv_heads)
        if cache is not None:
            cache.cross[layer] = (k, v)
        return k, v
