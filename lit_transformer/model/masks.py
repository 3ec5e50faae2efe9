"""Structured attention masks: sliding windows (Mistral; Longformer's local attention), global
tokens (Longformer), document masks for packed sequences, and the rolling-cache masks of
windowed generation; and attention that never builds the full T x S mask where a blocked
computation avoids it.

Every mask here has one shape: query t sees the keys whose index lies in an interval
[lo_t, hi_t) -- the causal limit, the window and the document boundaries are each intervals,
and so is their intersection -- then, optionally, minus padded keys and plus Longformer's
global rows and columns (the first `global_tokens` queries see everything, every query sees
the first `global_tokens` keys; Beltagy et al. 2020, 3.1). Indices are key-buffer indices (the
column of a token in its row, padding included), as Mistral counts its window.

Shape legend: B batch, T query length, S key length, H query heads, K key/value heads,
D head dim, Tc / Sc one chunk's queries / keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# Queries per chunk of the blocked path: each chunk's scores are (B, H, 256, band), so memory
# is linear in T for a fixed window; 256 keeps SDPA's per-call overhead small next to its work.
CHUNK = 256
# Below this many mask elements per row (T * S) one dense mask is cheaper than chunking.
DENSE_LIMIT = 1 << 20


def masked_value(dtype: torch.dtype) -> float:
    # The most negative finite number rather than -inf: a query whose keys are all masked
    # (a left-padding position) then gets a uniform softmax instead of NaNs.
    return torch.finfo(dtype).min


@dataclass
class IntervalMask:
    """Which keys each query may attend to; see the module docstring.

    lo, hi (B|1, T) long: the visible key interval of every query.
    q_index (T,) long: each query's own key index (for global rows).
    n_keys: S.  key_mask (B, S) bool or None: False for padded keys.
    global_tokens: the first k keys and queries are global.
    key_index (S,) long or None: the index of each key column when keys are not 0..S-1 in order
    (a rolling cache's ring; -1 marks an empty slot), else None.
    """

    lo: torch.Tensor
    hi: torch.Tensor
    q_index: torch.Tensor
    n_keys: int
    key_mask: torch.Tensor | None = None
    global_tokens: int = 0
    key_index: torch.Tensor | None = None
    block_mask: object | None = field(default=None, repr=False)  # flex_attention's, built on CUDA

    def keep(self, queries: slice | None = None, keys: torch.Tensor | None = None) -> torch.Tensor:
        """Boolean (B|1, 1, Tc, Sc): may query i (of `queries`) attend to key j (indices `keys`)?"""
        queries = queries or slice(None)
        columns = keys
        if keys is None:
            keys = torch.arange(self.n_keys, device=self.lo.device) if self.key_index is None else self.key_index
            columns = slice(None)
        lo, hi = self.lo[:, queries, None], self.hi[:, queries, None]  # (B|1, Tc, 1)
        keep = (keys >= lo) & (keys < hi)  # (B|1, Tc, Sc)
        g = self.global_tokens
        if g:
            keep = keep | (keys < g) | (self.q_index[queries, None] < g)
        if self.key_mask is not None:
            keep = keep & self.key_mask[:, None, columns]  # (B, 1, Sc) broadcast over queries
        return keep[:, None]  # (B|1, 1, Tc, Sc)

    def dense_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole mask as an additive bias (B|1, 1, T, S); masked scores get the most
        negative finite number, as in masked_value (padding rows stay finite)."""
        keep = self.keep()
        return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)

    def chunks(self, size: int = CHUNK) -> list[tuple[int, int, int, int]]:
        """(first query, end query, first key, end key) per chunk of queries: the smallest key
        range that covers every visible key of the chunk (global columns are added apart).
        One host sync for all chunks."""
        T = self.lo.shape[1]
        g = min(self.global_tokens, T)
        out = [(0, g, 0, self.n_keys)] if g else []  # global rows see every key
        starts = list(range(g, T, size))
        if not starts:
            return out
        pad = (-(T - g)) % size
        lo = F.pad(self.lo[:, g:], (0, pad), value=self.n_keys).amin(0)  # (Tpad,)
        hi = F.pad(self.hi[:, g:], (0, pad), value=0).amax(0)
        bounds = torch.stack((lo.view(-1, size).amin(1), hi.view(-1, size).amax(1)), dim=1).tolist()  # (chunks, 2)
        for start, (k0, k1) in zip(starts, bounds):
            out.append((start, min(start + size, T), min(k0, k1), k1))
        return out


def interval_mask(
    q_index: torch.Tensor,
    n_keys: int,
    *,
    causal: bool,
    window: int | None,
    document_ids: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    global_tokens: int = 0,
    key_index: torch.Tensor | None = None,
) -> IntervalMask:
    """The IntervalMask of a stack. q_index (T,): the queries' key indices (past + arange(T)).

    causal: keys up to the query; a causal window w keeps the query and the w - 1 before it
    (Jiang et al. 2023, Mistral 7B, 2.1). Bidirectional window w: w keys on each side
    (Beltagy et al. 2020, 3.1: Longformer's window of size w covers w/2 on each side, so our
    w is their w/2). document_ids (B, T) with T = n_keys: queries see only their own document.
    """
    lo = torch.zeros_like(q_index)[None]  # (1, T)
    hi = torch.full_like(q_index, n_keys)[None] if not causal else (q_index + 1)[None]
    if window is not None:
        lo = (q_index - (window - 1 if causal else window)).clamp(min=0)[None]
        if not causal:
            hi = (q_index + window + 1).clamp(max=n_keys)[None]
    if document_ids is not None:
        start, end = document_bounds(document_ids)  # (B, T) each
        lo, hi = torch.maximum(lo, start), torch.minimum(hi, end)
    return IntervalMask(
        lo=lo,
        hi=hi,
        q_index=q_index,
        n_keys=n_keys,
        key_mask=key_mask,
        global_tokens=global_tokens,
        key_index=key_index,
    )


def document_bounds(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids, constant over each document's contiguous run -> the index where each token's
    document starts and the index one past where it ends, both (B, T)."""
    B, T = document_ids.shape
    index = torch.arange(T, device=document_ids.device).expand(B, T)
    change = document_ids[:, 1:] != document_ids[:, :-1]  # (B, T-1): a new document at t+1
    first = torch.cat((torch.ones_like(change[:, :1]), change), dim=1)  # (B, T)
    last = torch.cat((change, torch.ones_like(change[:, :1])), dim=1)
    start = torch.where(first, index, 0).cummax(1).values
    end = torch.where(last, index + 1, T).flip(1).cummin(1).values.flip(1)
    return start, end


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 at every document start: (B, T) -> (B, T)."""
    start, _ = document_bounds(document_ids)
    return torch.arange(document_ids.shape[1], device=document_ids.device) - start


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: IntervalMask, *, scale: float, dropout: float
) -> torch.Tensor:
    """softmax(q k^T * scale, masked by `mask`) v for q (B, H, T, D), k and v (B, K, S, D).

    Three routes to the same numbers: flex_attention with the block mask when one was built
    (CUDA) and the block is being compiled (flex's fused kernel exists only compiled); one
    dense mask when T x S is small; otherwise chunks of CHUNK queries against the key band
    they can see, so memory grows with T times the band rather than T x S."""
    T, S = q.shape[-2], k.shape[-2]
    gqa = k.shape[1] != q.shape[1]
    if mask.block_mask is not None and dropout == 0.0 and torch.compiler.is_compiling():
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=mask.block_mask, scale=scale, enable_gqa=gqa)
    if T * S <= DENSE_LIMIT or mask.key_index is not None:
        bias = mask.dense_bias(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout, scale=scale, enable_gqa=gqa)
    return chunked_attention(q, k, v, mask, scale=scale, dropout=dropout)


def chunked_attention(q, k, v, mask: IntervalMask, *, scale: float, dropout: float, size: int = CHUNK) -> torch.Tensor:
    """The blocked route of `masked_attention`; shapes as there."""
    gqa = k.shape[1] != q.shape[1]
    g = mask.global_tokens
    outputs = []
    for t0, t1, s0, s1 in mask.chunks(size):
        if g and s0 > g:  # the global columns, then the band
            keys = torch.cat((torch.arange(g, device=q.device), torch.arange(s0, s1, device=q.device)))  # (Sc,)
            k_c, v_c = k[:, :, keys], v[:, :, keys]  # (B, K, Sc, D)
        else:
            keys = torch.arange(s0, s1, device=q.device)
            k_c, v_c = k[:, :, s0:s1], v[:, :, s0:s1]
        keep = mask.keep(slice(t0, t1), keys)  # (B|1, 1, Tc, Sc)
        bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, torch.finfo(q.dtype).min)
        outputs.append(
            F.scaled_dot_product_attention(
                q[:, :, t0:t1], k_c, v_c, attn_mask=bias, dropout_p=dropout, scale=scale, enable_gqa=gqa
            )
        )  # (B, H, Tc, D)
    return torch.cat(outputs, dim=2)  # (B, H, T, D)


def flex_block_mask(mask: IntervalMask, batch: int):
    """flex_attention's BlockMask for `mask` (Dao et al.'s tiling: blocks wholly outside the
    mask are skipped, never computed). Built once per forward and shared by every layer."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T, S, g = batch, mask.lo.shape[1], mask.n_keys, mask.global_tokens
    lo, hi = mask.lo.expand(B, T), mask.hi.expand(B, T)  # (B, T)
    q_index, key_mask = mask.q_index, mask.key_mask

    def mask_mod(b, h, q, kv):
        keep = (kv >= lo[b, q]) & (kv < hi[b, q])
        if g:
            keep = keep | (kv < g) | (q_index[q] < g)
        if key_mask is not None:
            keep = keep & key_mask[b, kv]
        return keep

    return create_block_mask(mask_mod, B, None, T, S, device=lo.device)


def has_flex() -> bool:
    """Whether this torch has flex_attention (the block masks above need it)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401  (torch >= 2.5)
    except ImportError:
        return False
    return True


def masks_nothing(mask: torch.Tensor | None, cache: object | None) -> bool:
    """Whether a padding mask masks nothing (packed batches: the collators always send one), so
    that attention can take SDPA's fused path without a bias tensor, causal blocks skipped,
    as transformers does for all-ones masks. One device-to-host sync per call, so not while
    decoding with a cache (where the mask lives on in the cache anyway) nor while compiling
    (a data-dependent branch would break the graph)."""
    if mask is None:
        return True
    if cache is not None or torch.compiler.is_compiling():
        return False
    return bool(mask.all())


def batch_shared(*positions: torch.Tensor) -> bool:
    """Whether every batch row holds the same positions by construction (expanded, stride 0)."""
    return all(p.shape[0] == 1 or p.stride(0) == 0 for p in positions)


def padding_bias(key_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, S) bool -> additive (B, 1, 1, S)."""
    bias = torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device)
    return bias.masked_fill(~key_mask, masked_value(dtype))[:, None, None, :]


# ----------------------------------------------------------------------------- attention modes
# A decoder trained on a mixture (UniLM, Dong et al. 2019; GPT-BERT, Charpentier and Samuel
# 2024) reads each row in its own mode: causal, bidirectional, or a bidirectional prefix followed
# by causal text (Stack.forward's prefix_lengths). One dense (B, 1, T, S) bias for the batch
# would take every row off SDPA's fused kernels (on CUDA the flash kernel takes no bias at all),
# so the rows are grouped by mode and each group runs on its mode's path: causal rows with
# `is_causal` and no bias, bidirectional rows with no mask at all, and only prefix rows (and
# rows with padded keys) with a bias of their own rows.
CAUSAL, FULL, PREFIX = "causal", "full", "prefix"


def row_mode(prefix: int, n_keys: int) -> str:
    """A row's attention mode from its prefix length: 0 or 1 sees what causal attention sees
    (key 0 is visible to every query anyway), n_keys or more sees every key."""
    if prefix <= 1:
        return CAUSAL
    return FULL if prefix >= n_keys else PREFIX


@dataclass(frozen=True)
class ModeGroup:
    """The rows of one mode (a slice when they are contiguous, else (Bg,) long) and how they
    attend: SDPA's causal kernel (`causal`), or `bias` (Bg, 1, T|1, S), or no mask at all."""

    rows: slice | torch.Tensor
    causal: bool
    bias: torch.Tensor | None


@dataclass(frozen=True)
class ModeGroups:
    """A batch's rows grouped by attention mode (see above). `order` (B,): batch row i is row
    order[i] of the groups' outputs concatenated; None when that is already batch order (a row-
    mixed batch stacks each task's rows together, so it usually is)."""

    groups: tuple[ModeGroup, ...]
    order: torch.Tensor | None

    def attend(self, attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`attention(q, k, v, bias, is_causal)` per group; q (B, H, T, D), k and v (B, K, S, D)
        -> (B, H, T, D)."""
        if self.order is None:  # the groups are consecutive slices of the batch, in order
            # split, not slicing: split's backward is one concatenation of the groups' gradients,
            # where each slice's backward fills a zero gradient of the whole batch and adds them
            sizes = [g.rows.stop - g.rows.start for g in self.groups]
            parts = zip(q.split(sizes), k.split(sizes), v.split(sizes))
        else:
            parts = ((q[g.rows], k[g.rows], v[g.rows]) for g in self.groups)
        outputs = [attention(qg, kg, vg, g.bias, g.causal) for g, (qg, kg, vg) in zip(self.groups, parts)]
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # (B, H, T, D) in group order
        return out if self.order is None else out.index_select(0, self.order)


def mode_groups(
    prefix_lengths: torch.Tensor, key_mask: torch.Tensor | None, n_queries: int, dtype: torch.dtype, device
) -> ModeGroups:
    """Group the rows of a batch without a cache (queries 0..T-1 over keys 0..T-1) by mode.
    prefix_lengths (B,), best on the CPU (read once on the host); key_mask (B, T) bool or None.
    Each group's bias, where it needs one, keeps exactly what Stack's dense bias keeps for its rows."""
    modes = [row_mode(p, n_queries) for p in prefix_lengths.tolist()]
    rows_of: dict[str, list[int]] = {}
    for row, mode in enumerate(modes):
        rows_of.setdefault(mode, []).append(row)  # groups in order of their first row
    groups, concatenated = [], []
    for mode, rows in rows_of.items():
        contiguous = rows[-1] - rows[0] + 1 == len(rows)
        index = slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows, device=device)
        keys = None if key_mask is None else key_mask[index]  # (Bg, S)
        if mode == FULL:
            bias = None if keys is None else padding_bias(keys, dtype)  # (Bg, 1, 1, S)
            groups.append(ModeGroup(index, causal=False, bias=bias))
        elif mode == CAUSAL and keys is None:
            groups.append(ModeGroup(index, causal=True, bias=None))
        else:
            k_index = torch.arange(n_queries, device=device)  # (S,)
            keep = (k_index[None, :] <= k_index[:, None])[None, None]  # (1, 1, T, S)
            if mode == PREFIX:
                prefix = prefix_lengths[rows].to(device)  # (Bg,)
                keep = keep | (k_index[None, :] < prefix[:, None])[:, None, None, :]  # (Bg, 1, T, S)
            if keys is not None:
                keep = keep & keys[:, None, None, :]
            bias = torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill(~keep, masked_value(dtype))
            groups.append(ModeGroup(index, causal=False, bias=bias))
        concatenated += rows
    order = None
    if concatenated != sorted(concatenated):
        order = torch.tensor(concatenated, device=device).argsort()  # (B,)
    return ModeGroups(tuple(groups), order)


def refuse_prefix(arch: str) -> None:
    """Attention modes exist for one stack that is causal by default: a decoder-only model."""
    if arch == "encoder":
        raise ValueError(
            "prefix_lengths (attention modes) are for decoder-only models: an encoder is already bidirectional"
        )
    if arch == "encoder_decoder":
        raise ValueError(
            "prefix_lengths (attention modes) are for decoder-only models: an encoder-decoder's "
            "encoder is already bidirectional and its decoder stays causal"
        )
