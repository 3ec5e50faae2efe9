"""Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs"): the softmax kernel
exp(q . k) replaced by phi(q) . phi(k) with phi(x) = elu(x) + 1 (their eq. 7), so that

    out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / phi(q_i)^T (sum_j phi(k_j))      (their eq. 5)

costs O(T D^2) instead of O(T^2 D). Bidirectional attention sums over every key once; causal
attention is the recurrence S_i = S_{i-1} + phi(k_i) v_i^T, z_i = z_{i-1} + phi(k_i) (their
eq. 18-20), so generation carries (S, z) -- D x D and D numbers per head, whatever the length --
instead of a KV cache. Training computes the causal form by chunks: quadratic (masked) inside a
chunk, the recurrent state across chunks, which keeps memory linear in T without a Python
loop over tokens.

Padded keys are removed by zeroing phi(k) (they then add nothing to any sum); the softmax
scale does not apply (phi is not a function of scaled scores).

Shape legend: B batch, H heads, T length, D head dim (keys), E head dim (values), C chunk.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lit_transformer.model.attention import Attention

# Numerator and denominator are both sums of positive terms; EPS only guards a query with no
# visible key (a padding row), whose output is then 0 rather than NaN.
EPS = 1e-6
CHUNK = 64  # tokens per chunk of the causal parallel form: (C x C) scores, (D x E) states


def feature_map(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = elu(x) + 1 > 0 (Katharopoulos et al. 2020, eq. 7), computed in float32."""
    return F.elu(x.float()) + 1.0


@dataclass
class LinearMask:
    """What Stack hands each layer instead of a softmax mask: causal or not, and the padding
    mask of the new tokens (B, T) (None: no padding)."""

    causal: bool
    key_mask: torch.Tensor | None = None


class LinearState:
    """The recurrent state of every decoder layer for generation: S (L, B, H, D, E) and
    z (L, B, H, D) in float32, plus the cross-attention keys and values (encoder-decoders)."""

    capacity = sys.maxsize  # no limit: the state does not grow

    def __init__(self, n_layers: int, batch: int, heads: int, head_dim: int, device: torch.device | str):
        # float32 named, not taken from the default dtype: Lightning's bf16-true sets that to
        # bfloat16 around each step, and the sums meet float32 features (feature_map)
        rows = (n_layers, batch, heads, head_dim)
        self.state = torch.zeros(*rows, head_dim, device=device, dtype=torch.float32)  # (L, B, H, D, E)
        self.normalizer = torch.zeros(*rows, device=device, dtype=torch.float32)  # (L, B, H, D)
        self.cross: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layers
        self.length = 0

    def reorder(self, index: torch.Tensor, *, within_groups: bool = False) -> None:
        """Keep batch rows `index`; as KVCache.reorder."""
        self.state = self.state.index_select(1, index)
        self.normalizer = self.normalizer.index_select(1, index)
        if not within_groups:
            self.cross = [
                None if kv is None else (kv[0].index_select(0, index), kv[1].index_select(0, index))
                for kv in self.cross
            ]


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: LinearMask,
    state: LinearState | None = None,
    layer: int = 0,
) -> torch.Tensor:
    """q (B, H, T, D), k and v (B, K, T, D|E) -> (B, H, T, E) in q's dtype. With `state`
    (causal only) the sums start from the state and the state is advanced past these tokens."""
    n_heads, n_kv = q.shape[1], k.shape[1]
    if n_kv != n_heads:
        k = k.repeat_interleave(n_heads // n_kv, dim=1)  # (B, H, T, D)
        v = v.repeat_interleave(n_heads // n_kv, dim=1)
    fq, fk, vf = feature_map(q), feature_map(k), v.float()
    if mask.key_mask is not None:
        fk = fk * mask.key_mask[:, None, :, None].to(fk.dtype)  # padded keys contribute nothing
    if not mask.causal:
        kv = fk.transpose(-2, -1) @ vf  # (B, H, D, E): sum_j phi(k_j) v_j^T
        out = (fq @ kv) / (fq @ fk.sum(2)[..., None] + EPS)  # (B, H, T, E) / (B, H, T, 1)
        return out.to(q.dtype)
    S0 = state.state[layer] if state is not None else None
    z0 = state.normalizer[layer] if state is not None else None
    out, S, z = causal_chunked(fq, fk, vf, S0, z0)
    if state is not None:
        state.state[layer], state.normalizer[layer] = S, z
    return out.to(q.dtype)


class LinearAttention(Attention):
    """Attention whose self-attention is linear (the module docstring); chosen at construction
    for model.attention_kind='linear'. Its mask is a LinearMask and its cache a LinearState (or
    None); cross-attention stays softmax attention over the encoder output."""

    def self_attention(self, q, k, v, mask: LinearMask, *, is_causal: bool, cache: LinearState | None, layer: int):
        return linear_attention(q, k, v, mask, cache, layer)  # (B, H, T, E)


def causal_chunked(fq, fk, v, S0=None, z0=None, chunk: int = CHUNK):
    """Causal linear attention in parallel form, chunk by chunk: featurised fq, fk (B, H, T, D),
    v (B, H, T, E); optional starting state S0 (B, H, D, E), z0 (B, H, D). Returns the output
    (B, H, T, E) and the final state S, z."""
    B, H, T, D = fq.shape
    E = v.shape[-1]
    S = fq.new_zeros(B, H, D, E) if S0 is None else S0
    z = fq.new_zeros(B, H, D) if z0 is None else z0
    outputs = []
    for t0 in range(0, T, chunk):
        q_c, k_c, v_c = fq[:, :, t0 : t0 + chunk], fk[:, :, t0 : t0 + chunk], v[:, :, t0 : t0 + chunk]  # (B, H, C, .)
        scores = (q_c @ k_c.transpose(-2, -1)).tril()  # (B, H, C, C): keys up to the query, in this chunk
        numerator = q_c @ S + scores @ v_c  # (B, H, C, E): earlier chunks + this one
        denominator = q_c @ z[..., None] + scores.sum(-1, keepdim=True)  # (B, H, C, 1)
        outputs.append(numerator / (denominator + EPS))
        S = S + k_c.transpose(-2, -1) @ v_c  # (B, H, D, E)
        z = z + k_c.sum(2)
    return torch.cat(outputs, dim=2), S, z


def causal_recurrent(fq, fk, v):
    """The RNN form, one token at a time (Katharopoulos et al. 2020, eq. 18-20): the reference the
    chunked form is tested against. Shapes as in `causal_chunked`."""
    B, H, T, D = fq.shape
    S = fq.new_zeros(B, H, D, v.shape[-1])
    z = fq.new_zeros(B, H, D)
    outputs = []
    for t in range(T):
        S = S + fk[:, :, t, :, None] * v[:, :, t, None, :]  # (B, H, D, E): outer product phi(k_t) v_t^T
        z = z + fk[:, :, t]
        num = (fq[:, :, t, None, :] @ S)[:, :, 0]  # (B, H, E)
        den = (fq[:, :, t] * z).sum(-1, keepdim=True)  # (B, H, 1)
        outputs.append(num / (den + EPS))
    return torch.stack(outputs, dim=2)  # (B, H, T, E)
