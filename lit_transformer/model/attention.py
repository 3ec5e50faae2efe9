"""Scaled dot-product attention (Vaswani et al. 2017, 3.2), multi-head with grouped or
multi-query key/value heads, self- and cross-attention, and the KV cache for decoding.

The kind of attention is a class, chosen when the model is built: `Attention` is softmax
attention, linear_attention.LinearAttention overrides `self_attention` with the kernelised
form. The cache kind dispatches through the cache (`KVCache.record` and `update`, overridden
by RollingKVCache), so a layer's forward asks no object its type except the softmax mask: a
dense bias or a masks.IntervalMask, which can differ from call to call (packed rows carry
document ids), or the groups of a mixture's attention modes.

Shape legend: B batch, T query length, S key length, H query heads, K key/value heads,
D head dim, C model width, L layers, M cache capacity.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

from lit_transformer.model.layers import RMSNorm
from lit_transformer.model.masks import IntervalMask, ModeGroups, masked_attention, masked_value
from lit_transformer.model.positions import apply_rope


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in: the autocast dtype when autocast is on for x's device (SDPA
    is on autocast's lower-precision list), else x's own. An additive bias built once in this
    dtype is not cast again by autocast in every layer (for T5, a (B, H, T, S) copy per layer)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


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
        if _matmuls_faster(q, k, is_causal):
            return _matmul_attention(q, k, v, bias, is_causal=is_causal, scale=scale, dropout=dropout)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=bias,
            dropout_p=dropout,
            is_causal=is_causal,
            scale=scale,
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


def _matmuls_faster(q: torch.Tensor, k: torch.Tensor, is_causal: bool) -> bool:
    """Whether `_matmul_attention` beats SDPA: on CPU in bf16/fp16, two batched matrix
    products (oneDNN's bf16 GEMM) and a softmax run faster than SDPA's CPU flash kernel, and
    far faster than SDPA's math fallback, which it takes whenever the bias needs a gradient
    (T5). At long causal lengths flash's skipping of the upper half wins instead, hence
    _MAX_CAUSAL_KEYS; `python benchmarks/kernels.py` measures each case (benchmarks/README.md).
    The price is the (B, H, T, S) probabilities kept for backward, hence the size limit."""
    if q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    B, H, T, _ = q.shape
    S = k.shape[-2]
    if is_causal and S > _MAX_CAUSAL_KEYS:
        return False
    return B * H * T * S <= _MAX_SCORES


_MAX_SCORES = 2**25  # (B, H, T, S) elements: 64 MiB of bf16 probabilities per layer
_MAX_CAUSAL_KEYS = 512


def _matmul_attention(q, k, v, bias, *, is_causal: bool, scale: float, dropout: float) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v with the scores in q's 16-bit dtype (as transformers'
    eager attention): torch's softmax accumulates in float32 internally and its output is
    rounded to 16 bits for the second product either way. Shapes as in `attend`."""
    n_heads, n_kv = q.shape[1], k.shape[1]
    if n_kv != n_heads:
        k = k.repeat_interleave(n_heads // n_kv, dim=1)  # (B, H, S, D)
        v = v.repeat_interleave(n_heads // n_kv, dim=1)
    scores = (q * scale) @ k.transpose(-2, -1)  # (B, H, T, S); q is the smaller tensor to scale
    if is_causal:
        T, S = scores.shape[-2:]
        future = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(1)  # (T, S)
        scores = scores.masked_fill(future, masked_value(scores.dtype))
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    weights = F.dropout(scores.softmax(dim=-1), p=dropout, training=dropout > 0)
    return weights @ v  # (B, H, T, D)


class KVCache:
    """Keys and values of every decoder layer, pre-allocated to a capacity M so a decoding
    step writes in place instead of concatenating; plus the key padding mask and positions
    of everything cached (for masks and relative biases), and the cross-attention keys and
    values, computed once from the encoder output."""

    def __init__(
        self,
        n_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (n_layers, batch, kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, K, M, D)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.key_mask = torch.zeros(batch, capacity, dtype=torch.bool, device=device)  # (B, M)
        self.positions = torch.zeros(batch, capacity, dtype=torch.long, device=device)  # (B, M)
        self.cross: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layers
        self.length = 0  # tokens cached so far
        self.capacity = capacity
        # Fixed-shape steps (graph_step.py): one new token written at this device index (1,),
        # and attention over all M slots, so that every step has the same shapes and a CUDA
        # graph can replay it. Slots not yet written are False in key_mask, so they stay unseen.
        self.write_at: torch.Tensor | None = None

    def record(self, new_mask: torch.Tensor, new_positions: torch.Tensor):
        """Record T new tokens' padding mask and positions (B, T) after the cached ones; return
        the key index (None: keys 0..S-1 in order), key mask (B, S) and key positions (B, S) that
        the layers' attention will see, S = length + T (S = M in a fixed-shape step)."""
        if self.write_at is not None:
            self.key_mask.index_copy_(1, self.write_at, new_mask)
            self.positions.index_copy_(1, self.write_at, new_positions)
            return None, self.key_mask, self.positions
        start, end = self.length, self.length + new_mask.shape[1]
        self.key_mask[:, start:end] = new_mask
        self.positions[:, start:end] = new_positions
        return None, self.key_mask[:, :end], self.positions[:, :end]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' k, v (B, K, T, D) after the cached ones; return every cached
        key and value of the layer, the new ones included: (B, K, S, D), S = length + T (S = M in a
        fixed-shape step)."""
        if self.write_at is not None:
            self.keys[layer].index_copy_(2, self.write_at, k.to(self.keys.dtype))
            self.values[layer].index_copy_(2, self.write_at, v.to(self.values.dtype))
            return self.keys[layer], self.values[layer]
        start, end = self.length, self.length + k.shape[2]
        self.keys[layer, :, :, start:end] = k
        self.values[layer, :, :, start:end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def reorder(self, index: torch.Tensor, *, within_groups: bool = False) -> None:
        """Keep batch rows `index` (R',): beam search's surviving beams' parents, and fewer rows
        once prompts finish. With R' <= R the cache stays where it is: row i takes row index[i]
        (only the cached positions, only the rows that change), and finished rows are cut off
        the end as a view, so no new cache is allocated in a step or when prompts finish.
        within_groups: the rows move only among rows that share an encoder output (the beams
        of one prompt), so the cross-attention keys and values stay as they are."""
        rows = index.numel()
        if rows <= self.keys.shape[1]:
            used = min(self.length, self.keys.shape[3])  # a ring (RollingKVCache) is full after M tokens
            # only the rows that take another row's place: a beam that extends itself stays put
            moved = torch.nonzero(index != torch.arange(rows, device=index.device))[:, 0]  # (R'',)
            if moved.numel():
                self._copy_rows(index[moved], moved, used)
            self.keys, self.values = self.keys[:, :rows], self.values[:, :rows]
        else:
            self.keys = self.keys.index_select(1, index)
            self.values = self.values.index_select(1, index)
        if rows == self.key_mask.shape[0]:  # in place: a captured decoding step reads these tensors
            self.key_mask.copy_(self.key_mask.index_select(0, index))
            self.positions.copy_(self.positions.index_select(0, index))
        else:
            self.key_mask = self.key_mask.index_select(0, index)
            self.positions = self.positions.index_select(0, index)
        if not within_groups:
            self.cross = [
                None if kv is None else (kv[0].index_select(0, index), kv[1].index_select(0, index))
                for kv in self.cross
            ]

    def _copy_rows(self, source: torch.Tensor, target: torch.Tensor, used: int) -> None:
        """Cached keys and values of rows `source` (R'',) written over rows `target`, the first
        `used` positions. One layer at a time, on the (B*K, M, D) view whose rows are each a
        head's contiguous block: whole blocks are gathered with plain copies, where advanced
        indexing over (L, B, K, M, D) with the `used` slice takes torch's slow strided path."""
        L, B, K, M, D = self.keys.shape
        heads = torch.arange(K, device=source.device)
        source = (source[:, None] * K + heads).reshape(-1)  # (R''*K,) rows of the (B*K) view
        target = (target[:, None] * K + heads).reshape(-1)
        for cache in (self.keys, self.values):
            flat = cache.view(L, B * K, M, D)
            for layer in range(L):
                part = flat[layer, :, :used]  # (B*K, used, D)
                part.index_copy_(0, target, part.index_select(0, source))


class RollingKVCache(KVCache):
    """The KV cache of a sliding-window decoder: M = window slots used as a ring, so memory stays
    at w entries however long the output (Jiang et al. 2023, Mistral 7B, 2.1 "rolling buffer
    cache"). Token i lives in slot i mod M; `slot_index` (M,) records which token each slot holds
    (-1: empty), and the mask (masks.IntervalMask with key_index) reads it. A single new token
    overwrites exactly the token that leaves its window, so a decoding step attends over the
    ring itself; a longer chunk (the prompt) attends over ring + chunk, then keeps its last M."""

    def __init__(
        self,
        n_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        window: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__(n_layers, batch, kv_heads, head_dim, window, dtype, device)
        self.slot_index = torch.full((window,), -1, dtype=torch.long, device=device)  # (M,)
        self.capacity = sys.maxsize  # tokens it can take; the memory is `window` slots
        self.window = window

    def record(self, new_mask: torch.Tensor, new_positions: torch.Tensor):
        """Record T new tokens' padding mask and positions (B, T); return the key index (S,),
        key mask (B, S) and key positions (B, S) the layers' attention will see, S = M or M + T."""
        T, start, M = new_mask.shape[1], self.length, self.window
        index = torch.arange(start, start + T, device=new_mask.device)  # (T,)
        if T > 1:  # attend over ring + chunk (the ring's old entries first)
            seen = (
                torch.cat((self.slot_index, index)),
                torch.cat((self.key_mask, new_mask), 1),
                torch.cat((self.positions, new_positions), 1),
            )
        keep = slice(max(0, T - M), T)  # the last M new tokens stay
        slots = index[keep] % M
        self.slot_index[slots] = index[keep]
        self.key_mask[:, slots] = new_mask[:, keep]
        self.positions[:, slots] = new_positions[:, keep]
        if T > 1:
            return seen
        return self.slot_index.clone(), self.key_mask.clone(), self.positions.clone()

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, K, T, D) into the ring; return the keys and values to attend over,
        in the order `record` returned their indices."""
        T, start, M = k.shape[2], self.length, self.window
        # in the cache's dtype, as KVCache's slice assignment stores them (under bf16 autocast,
        # e.g. BLEU decoding at validation, k and v are bf16 and the cache float32)
        k, v = k.to(self.keys.dtype), v.to(self.values.dtype)
        slots = torch.arange(max(start, start + T - M), start + T, device=k.device) % M
        if T > 1:
            keys = torch.cat((self.keys[layer], k), dim=2)  # (B, K, M + T, D)
            values = torch.cat((self.values[layer], v), dim=2)
        self.keys[layer][:, :, slots] = k[:, :, T - len(slots) :]
        self.values[layer][:, :, slots] = v[:, :, T - len(slots) :]
        if T > 1:
            return keys, values
        return self.keys[layer], self.values[layer]  # (B, K, M, D)


class Attention(nn.Module):
    """Multi-head softmax attention with K <= H key/value heads (K = H: MHA, K = 1: MQA, else
    GQA). A subclass changes how self-attention attends by overriding `self_attention`."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        bias: bool,
        dropout: float,
        scale: bool,
        impl: str,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = 1.0 / math.sqrt(head_dim) if scale else 1.0
        self.dropout, self.impl = dropout, impl
        self.q = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        self.k = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.v = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.o = nn.Linear(n_heads * head_dim, d_model, bias=bias)
        # QK-norm (Dehghani et al. 2023; Wortsman et al. 2023): RMSNorm over each head's D
        # features with one learned (D,) scale shared by the heads, as Qwen3 and Gemma 3 (OLMo 2
        # normalises the whole H*D projection instead). Before RoPE, as those models; and before
        # keys enter the KV cache, so cached decoding sees exactly the keys recomputation would.
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None

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
        if memory is not None:
            q = self._heads(self.q(x), self.n_heads)  # (B, H, T, D)
            if self.q_norm is not None:
                q = _normed(self.q_norm, q)
            k, v = self._cross_keys_values(memory, cache, layer)
            out = self.softmax_attention(q, k, v, bias, is_causal=is_causal)  # (B, H, T, D)
        else:
            q, k, v = self._project_qkv(x)
            if self.q_norm is not None:
                q, k = _normed(self.q_norm, q), _normed(self.k_norm, k)
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            out = self.self_attention(q, k, v, bias, is_causal=is_causal, cache=cache, layer=layer)
        return self.o(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))  # (B, T, C)

    def self_attention(self, q, k, v, mask, *, is_causal: bool, cache, layer: int) -> torch.Tensor:
        """q (B, H, T, D), k and v (B, K, T, D) of the new tokens -> (B, H, T, D): their keys and
        values join the cache's (the cache's class decides where), then softmax attention."""
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, K, S, D), S = keys the mask indexes
        return self.softmax_attention(q, k, v, mask, is_causal=is_causal)

    def softmax_attention(self, q, k, v, mask, *, is_causal: bool) -> torch.Tensor:
        """q (B, H, T, D), k and v (B, K, S, D) -> (B, H, T, D); `mask` an additive bias, None,
        a masks.IntervalMask, or masks.ModeGroups (a mixture's rows, each mode on its own path)."""
        dropout = self.dropout if self.training else 0.0
        if isinstance(mask, ModeGroups):
            return mask.attend(
                lambda q, k, v, bias, causal: attend(
                    q, k, v, bias, is_causal=causal, scale=self.scale, dropout=dropout, impl=self.impl
                ),
                q,
                k,
                v,
            )
        if isinstance(mask, IntervalMask):  # sliding window, global tokens, documents
            if self.impl == "sdpa":
                return masked_attention(q, k, v, mask, scale=self.scale, dropout=dropout)
            mask, is_causal = mask.dense_bias(torch.float32), False  # the math path's reference
        return attend(q, k, v, mask, is_causal=is_causal, scale=self.scale, dropout=dropout, impl=self.impl)

    def _project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, T, D), k and v (B, K, T, D); see `_stacked_linear` for when one product."""
        if _stack(x, self.q, self.k, self.v):
            q, k, v = _stacked_linear(x, self.q, self.k, self.v)  # (B, T, H*D), (B, T, K*D) x 2
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        return self._heads(q, self.n_heads), self._heads(k, self.n_kv_heads), self._heads(v, self.n_kv_heads)

    def _cross_keys_values(self, memory: torch.Tensor, cache: KVCache | None, layer: int):
        if cache is not None and cache.cross[layer] is not None:
            return cache.cross[layer]  # the encoder output does not change while decoding
        if _stack(memory, self.k, self.v):
            k, v = _stacked_linear(memory, self.k, self.v)  # (B, S, K*D) x 2
        else:
            k, v = self.k(memory), self.v(memory)
        k, v = self._heads(k, self.n_kv_heads), self._heads(v, self.n_kv_heads)  # (B, K, S, D)
        if self.k_norm is not None:
            k = _normed(self.k_norm, k)
        if cache is not None:
            cache.cross[layer] = (k, v)
        return k, v


def _normed(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """QK-norm in x's dtype: under bf16 autocast the float32 scale would promote q and k to
    float32 beside a bf16 v (twice the bytes kept for backward) and miss `_matmuls_faster`."""
    return norm(x).to(x.dtype)


def _stack(x: torch.Tensor, *linears: nn.Module) -> bool:
    """Whether to run projections of the same input as one stacked product (`_stacked_linear`):
    only for untouched nn.Linear modules (no hooks, not replaced by an adapter), where that is
    exactly calling each, and only for at least d_model tokens. Stacking copies the weights
    (3 C^2 elements) to save re-reading the input (3 T C): a loss for KV-cache decoding (one
    token), a gain in training steps, most of all under contention for the CPU (fewer, larger
    kernels). `python benchmarks/kernels.py` measures both (benchmarks/README.md)."""
    if x.shape[:-1].numel() < x.shape[-1]:
        return False
    return all(type(m) is nn.Linear and not (m._forward_hooks or m._forward_pre_hooks) for m in linears)


def _stacked_linear(x: torch.Tensor, *linears: nn.Linear) -> list[torch.Tensor]:
    """[m(x) for m in linears] as ONE matrix product with the weights stacked (out1+out2+..., C),
    as GPT-2's c_attn: the input is read (and cast, under autocast) once, and backward computes
    one input gradient instead of summing three. The parameters stay separate (q, k, v names
    in checkpoints and interop)."""
    weight = torch.cat([m.weight for m in linears])
    bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
    return list(F.linear(x, weight, bias).split([m.out_features for m in linears], dim=-1))
