"""Blocks, stacks and the Transformer (encoder | decoder | encoder_decoder). Returns hidden
states; heads and losses live elsewhere.

Shape legend: B batch, T query length, S key length, H heads, C model width, V vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lit_transformer.model.attention import Attention, KVCache, RollingKVCache, compute_dtype
from lit_transformer.model.config import TransformerConfig
from lit_transformer.model.layers import FeedForward, make_norm
from lit_transformer.model.linear_attention import LinearAttention, LinearMask, LinearState
from lit_transformer.model.masks import (
    batch_shared,
    document_positions,
    flex_block_mask,
    has_flex,
    interval_mask,
    masked_value,
    masks_nothing,
    mode_groups,
    padding_bias,
    refuse_prefix,
)
from lit_transformer.model.positions import RelativePositionBias, alibi_bias, rope_cos_sin, sinusoidal


def _attention(cfg: TransformerConfig, kind: str) -> Attention:
    """kind: model.attention_kind for self-attention; cross-attention is always softmax."""
    return (LinearAttention if kind == "linear" else Attention)(
        cfg.d_model,
        cfg.n_heads,
        cfg.kv_heads,
        cfg.dim_per_head,
        bias=cfg.bias,
        dropout=cfg.attention_dropout,
        scale=cfg.scale_attention,
        impl=cfg.attention_impl,
        qk_norm=cfg.qk_norm,
        norm_eps=cfg.norm_eps,
    )


class Embeddings(nn.Module):
    """Token (+ token-type) (+ absolute position) embeddings, then optional norm and dropout."""

    def __init__(self, cfg: TransformerConfig, tokens: nn.Embedding):
        super().__init__()
        self.tokens = tokens  # shared between the stacks of an encoder-decoder
        self.token_types = nn.Embedding(cfg.type_vocab_size, cfg.d_model) if cfg.type_vocab_size else None
        self.positions = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.position == "learned" else None
        self.sinusoidal = cfg.position == "sinusoidal"
        self.scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
        self.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if cfg.embedding_norm else None
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        *,
        max_position: int | None = None,
    ) -> torch.Tensor:
        """`max_position`: the largest entry of `positions` when the caller knows it (it built
        them), which spares the check below a device-to-host sync."""
        x = self.tokens(input_ids)  # (B, T, C)
        if self.scale != 1.0:
            x = x * self.scale
        if self.token_types is not None:
            # Without token types every token has type 0: add that one row to all (no (B, T) lookup).
            x = x + (self.token_types(token_type_ids) if token_type_ids is not None else self.token_types.weight[0])
        if self.positions is not None:
            # While a CUDA graph is captured nothing may wait for the device; the decoder that
            # captures it (graph_step.py) checked the positions it will use when it started.
            capturing = max_position is None and positions.is_cuda and torch.cuda.is_current_stream_capturing()
            largest = -1 if capturing else int(positions.max()) if max_position is None else max_position
            if largest >= self.positions.num_embeddings:
                raise ValueError(
                    f"position {largest} is past model.max_seq_len={self.positions.num_embeddings} (learned positions)"
                )
            if positions.stride(0) == 0:  # one row expanded over the batch: look it up once
                x = x + self.positions(positions[:1])  # (1, T, C)
            else:
                x = x + self.positions(positions)
        elif self.sinusoidal:
            x = x + sinusoidal(positions, x.shape[-1]).to(x.dtype)
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)


class Block(nn.Module):
    """One layer: self-attention, (cross-attention), feed-forward, each a residual sublayer."""

    def __init__(self, cfg: TransformerConfig, cross: bool):
        super().__init__()
        self.pre_norm = cfg.norm_position == "pre"
        self.attn = _attention(cfg, cfg.attention_kind)
        self.norm1 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.cross_attn = _attention(cfg, "softmax") if cross else None
        self.norm_cross = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if cross else None
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation, bias=cfg.bias, gated=cfg.gated)
        self.norm2 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, bias, *, is_causal=False, rope=None, memory=None, memory_bias=None, cache=None, layer=0):
        drop = self.dropout

        def attn(h):
            return self.attn(h, bias, is_causal=is_causal, rope=rope, cache=cache, layer=layer)

        def cross(h):
            return self.cross_attn(h, memory_bias, memory=memory, cache=cache, layer=layer)

        if self.pre_norm:
            x = x + drop(attn(self.norm1(x)))
            if self.cross_attn is not None:
                x = x + drop(cross(self.norm_cross(x)))
            return x + drop(self.ffn(self.norm2(x)))
        x = self.norm1(x + drop(attn(x)))  # the 2017 paper: LayerNorm(x + Sublayer(x))
        if self.cross_attn is not None:
            x = self.norm_cross(x + drop(cross(x)))
        return self.norm2(x + drop(self.ffn(x)))


class Stack(nn.Module):
    """An encoder (bidirectional) or decoder (causal, optionally cross-attending) stack."""

    def __init__(self, cfg: TransformerConfig, n_layers: int, *, causal: bool, cross: bool, tokens: nn.Embedding):
        super().__init__()
        self.cfg, self.causal = cfg, causal
        self.embed = Embeddings(cfg, tokens)
        self.relative_bias = (
            RelativePositionBias(cfg.n_heads, cfg.relative_buckets, cfg.relative_max_distance, bidirectional=not causal)
            if cfg.position == "t5_relative"
            else None
        )
        self.blocks = nn.ModuleList(Block(cfg, cross) for _ in range(n_layers))
        self.final_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if cfg.norm_position == "pre" else None
        self.final_dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        cache: KVCache | LinearState | None = None,
        document_ids: torch.Tensor | None = None,
        prefix_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids (B, T), attention_mask (B, T) with 1 for real tokens -> hidden (B, T, C).
        document_ids (B, T): packed documents, each a contiguous run of one id; a token then
        attends within its document only, and positions (unless given) restart at each one.
        prefix_lengths (B,): a causal stack's attention mode per row (UniLM, Dong et al. 2019;
        prefix LM, Raffel et al. 2020): the query at key index q sees key j iff j <= q or
        j < prefix_lengths[b], in key (cache) coordinates. 0 is causal, >= T bidirectional."""
        B, T = input_ids.shape
        row_prefixes = prefix_lengths  # where the collator made them (the CPU): grouped without a device sync
        if prefix_lengths is not None:
            self._check_prefix(prefix_lengths, B, document_ids, cache)
            prefix_lengths = prefix_lengths.to(input_ids.device)
        past = cache.length if cache is not None else 0
        max_position = None
        if document_ids is not None:
            if cache is not None:
                raise ValueError("document_ids are for training on packed rows, not for decoding with a cache")
            if position_ids is None:
                position_ids = document_positions(document_ids)  # (B, T)
        if position_ids is None:
            # expanded, not copied: stride 0 over the batch tells the position tables that
            # every row is the same
            position_ids = torch.arange(past, past + T, device=input_ids.device).expand(B, T)
            max_position = past + T - 1
        if cache is not None and past + T > cache.capacity:
            raise ValueError(f"KV cache holds {cache.capacity} tokens; {past + T} requested")
        x = self.embed(input_ids, position_ids, token_type_ids, max_position=max_position)
        dtype = compute_dtype(x)
        if self._structured(document_ids, cache):
            bias, is_causal = self._structured_bias(attention_mask, position_ids, document_ids, cache, dtype), False
        elif self._groups_modes(row_prefixes, cache):
            key_mask = None if masks_nothing(attention_mask, cache) else attention_mask.bool()
            bias, is_causal = mode_groups(row_prefixes, key_mask, T, dtype, x.device), False
        else:
            bias, is_causal, _ = self._self_bias(attention_mask, position_ids, cache, dtype, prefix_lengths)
        rope = None
        if self.cfg.position == "rope":
            rope = tuple(t.to(x.dtype) for t in rope_cos_sin(position_ids, self.cfg.dim_per_head, self.cfg.rope_base))
        memory_bias = None
        if memory is not None and memory_mask is not None and not masks_nothing(memory_mask, cache):
            memory_bias = padding_bias(memory_mask.bool(), dtype)  # (B, 1, 1, S)
        for i, block in enumerate(self.blocks):
            x = block(
                x, bias, is_causal=is_causal, rope=rope, memory=memory, memory_bias=memory_bias, cache=cache, layer=i
            )
        if cache is not None:
            cache.length = past + T
        if self.final_norm is not None:
            x = self.final_norm(x)
        return self.final_dropout(x)

    def _check_prefix(self, prefix_lengths, B, document_ids, cache) -> None:
        """prefix_lengths need `_self_bias`'s dense bias: the structured masks (masks.py) hold
        intervals ending at the query, and linear attention's running sums see no later key."""
        if not self.causal:
            raise ValueError(
                "prefix_lengths (attention modes) are for causal stacks; an encoder is already bidirectional"
            )
        cfg = self.cfg
        why = (
            "model.sliding_window is set"
            if cfg.sliding_window is not None
            else "model.attention_kind='linear'"
            if cfg.attention_kind == "linear"
            else "document_ids are given (packed rows)"
            if document_ids is not None
            else "the cache is a RollingKVCache"
            if isinstance(cache, RollingKVCache)
            else None
        )
        if why is not None:
            raise ValueError(f"prefix_lengths (attention modes) need full softmax attention; {why}")
        if prefix_lengths.shape != (B,) or prefix_lengths.is_floating_point() or prefix_lengths.dtype == torch.bool:
            raise ValueError(
                f"prefix_lengths must be integers of shape ({B},), one per row; got "
                f"{prefix_lengths.dtype} of shape {tuple(prefix_lengths.shape)}"
            )

    def _groups_modes(self, prefix_lengths, cache) -> bool:
        """Whether a mixture's rows run grouped by attention mode (masks.mode_groups), each mode on
        its fused path: without a cache (decoding's one-token steps gain nothing), without a
        position bias (ALiBi's and T5's are dense per head anyway) and not while compiling (the
        grouping reads the modes on the host)."""
        return (
            prefix_lengths is not None
            and cache is None
            and self.relative_bias is None
            and self.cfg.position != "alibi"
            and not torch.compiler.is_compiling()
        )

    def _structured(self, document_ids, cache) -> bool:
        """Whether self-attention needs more than padding, causality and a position bias: the
        default path (`_self_bias`, SDPA's fused causal kernel) is untouched otherwise."""
        cfg = self.cfg
        return (
            document_ids is not None
            or cfg.sliding_window is not None
            or cfg.attention_kind == "linear"
            or isinstance(cache, RollingKVCache)
        )

    def _structured_bias(self, attention_mask, q_positions, document_ids, cache, dtype):
        """The self-attention mask for the efficient-attention options: a LinearMask, an
        IntervalMask (masks.py), or, with a position bias (ALiBi, T5), a dense additive tensor."""
        cfg, B, T = self.cfg, *q_positions.shape
        device = q_positions.device
        if cfg.attention_kind == "linear":
            if document_ids is not None:
                raise ValueError(
                    "document_ids need model.attention_kind='softmax' (linear attention's running "
                    "sums cross document boundaries)"
                )
            key_mask = None if masks_nothing(attention_mask, cache) else attention_mask.bool()
            return LinearMask(causal=self.causal, key_mask=key_mask)
        past = cache.length if cache is not None else 0
        q_index = torch.arange(past, past + T, device=device)  # (T,) the queries' key indices
        new_mask = attention_mask.bool() if attention_mask is not None else None
        key_index = None
        if cache is not None:  # a rolling cache's keys are its ring (key_index), a plain one's 0..S-1
            new_mask = new_mask if new_mask is not None else torch.ones(B, T, dtype=torch.bool, device=device)
            key_index, key_mask, k_positions = cache.record(new_mask, q_positions)  # (S,) or None, (B, S), (B, S)
        else:
            key_mask = None if masks_nothing(attention_mask, cache) else new_mask
            k_positions = q_positions
        n_keys = key_index.numel() if key_index is not None else past + T
        g = 0 if self.causal else cfg.global_tokens
        mask = interval_mask(
            q_index,
            n_keys,
            causal=self.causal,
            window=cfg.sliding_window,
            document_ids=document_ids,
            key_mask=key_mask,
            global_tokens=g,
            key_index=key_index,
        )
        if self.relative_bias is not None or cfg.position == "alibi":
            if self.relative_bias is not None:
                position_bias = self.relative_bias(q_positions, k_positions)  # (B, H, T, S)
            else:
                position_bias = alibi_bias(q_positions, k_positions, cfg.n_heads)
            return mask.dense_bias(dtype) + position_bias.to(dtype)
        if device.type == "cuda" and key_index is None and T >= 128 and has_flex():
            mask.block_mask = flex_block_mask(mask, B)  # used where the blocks run compiled (masks.py)
        return mask

    def _self_bias(self, attention_mask, q_positions, cache, dtype, prefix_lengths=None):
        """One additive bias (B|1, H|1, T, S) for all layers, or None with `is_causal` so that
        SDPA can take its fused causal kernel when there is nothing else to add. prefix_lengths
        (B,): keys before a row's prefix length are visible to all its queries (Stack.forward)."""
        B, T = q_positions.shape
        if cache is not None:
            past = cache.length
            mask = (
                attention_mask.bool()
                if attention_mask is not None
                else torch.ones(B, T, dtype=torch.bool, device=q_positions.device)
            )
            _, key_mask, k_positions = cache.record(mask, q_positions)  # (B, S) each
        else:
            past = 0
            key_mask = None if masks_nothing(attention_mask, cache) else attention_mask.bool()
            k_positions = q_positions
        position_bias = None
        if self.relative_bias is not None or self.cfg.position == "alibi":
            # Positions shared by the batch (stride 0, as Stack builds them): one (1, H, T, S)
            # bias instead of B copies, and B times less backward work for T5's table.
            shared = batch_shared(q_positions, k_positions)
            q_pos = q_positions[:1] if shared else q_positions  # (B|1, T)
            k_pos = k_positions[:1] if shared else k_positions  # (B|1, S)
            if self.relative_bias is not None:
                position_bias = self.relative_bias(q_pos, k_pos)  # (B|1, H, T, S)
            else:
                position_bias = alibi_bias(q_pos, k_pos, self.cfg.n_heads)
        if cache is not None and cache.write_at is not None:
            # A fixed-shape step (graph_step.py): one new token over all M slots. It may see every
            # slot written so far (a prefix included) and the unwritten ones are False in the key
            # mask, so the key mask alone is its mask.
            bias = padding_bias(key_mask, dtype)  # (B, 1, 1, M)
            return (bias if position_bias is None else bias + position_bias.to(dtype)), False, k_positions
        if key_mask is None and position_bias is None and past == 0 and prefix_lengths is None:
            return None, self.causal, k_positions  # fused path: no bias tensor at all
        S = past + T
        keep = None  # (B|1, 1, T|1, S), broadcast as far as the mask allows
        if key_mask is not None:
            keep = key_mask[:, None, None, :]  # (B, 1, 1, S)
        if self.causal:
            q_index = torch.arange(past, S, device=q_positions.device)[:, None]  # (T, 1) in cache coordinates
            k_index = torch.arange(S, device=q_positions.device)  # (S,)
            visible = (k_index[None, :] <= q_index)[None, None]  # (1, 1, T, S)
            if prefix_lengths is not None:
                # The prefix is read bidirectionally. A T5 bias of a causal stack puts every later
                # key in the bucket of offset 0 (positions.t5_bucket); ALiBi's |p_q - p_k| is symmetric.
                in_prefix = k_index[None, :] < prefix_lengths[:, None]  # (B, S)
                visible = visible | in_prefix[:, None, None, :]  # (B, 1, T, S)
            keep = visible if keep is None else keep & visible
        bias = None
        if keep is not None:
            bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, masked_value(dtype))
        if position_bias is not None:
            position_bias = position_bias.to(dtype)
            bias = position_bias if bias is None else bias + position_bias  # (B|1, H|1, T, S)
        return bias, False, k_positions


class Transformer(nn.Module):
    """The shared core. Encoder and decoder-only models use one stack; encoder-decoder models
    use two that share the token embedding (Vaswani et al. 2017, 3.4; T5)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.config = cfg
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = None
        self.decoder = None
        if cfg.arch in ("encoder", "encoder_decoder"):
            self.encoder = Stack(cfg, cfg.n_layers, causal=False, cross=False, tokens=self.tokens)
        if cfg.arch == "decoder":
            self.decoder = Stack(cfg, cfg.n_layers, causal=True, cross=False, tokens=self.tokens)
        if cfg.arch == "encoder_decoder":
            self.decoder = Stack(cfg, cfg.decoder_layers, causal=True, cross=True, tokens=self.tokens)

    def encode(self, input_ids, attention_mask=None, *, token_type_ids=None, position_ids=None, document_ids=None):
        if self.encoder is None:
            raise ValueError(f"a {self.config.arch} model has no encoder")
        return self.encoder(
            input_ids,
            attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            document_ids=document_ids,
        )

    def decode(
        self,
        input_ids,
        attention_mask=None,
        *,
        memory=None,
        memory_mask=None,
        position_ids=None,
        token_type_ids=None,
        cache: KVCache | LinearState | None = None,
        document_ids=None,
        prefix_lengths=None,
    ):
        if self.decoder is None:
            raise ValueError(f"a {self.config.arch} model has no decoder")
        if self.config.arch == "encoder_decoder" and memory is None:
            raise ValueError("an encoder_decoder model's decoder needs the encoder output (memory)")
        if prefix_lengths is not None:
            refuse_prefix(self.config.arch)
        return self.decoder(
            input_ids,
            attention_mask,
            position_ids=position_ids,
            token_type_ids=token_type_ids,
            memory=memory,
            memory_mask=memory_mask,
            cache=cache,
            document_ids=document_ids,
            prefix_lengths=prefix_lengths,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        prefix_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states of the last stack: (B, T, C); for encoder_decoder, (B, T_dec, C).
        document_ids (B, T): packed documents of an encoder or decoder (Stack.forward).
        prefix_lengths (B,): per-row attention modes of a decoder-only model (Stack.forward)."""
        arch = self.config.arch
        if prefix_lengths is not None:
            refuse_prefix(arch)
        if arch == "encoder":
            return self.encode(
                input_ids,
                attention_mask,
                token_type_ids=token_type_ids,
                position_ids=position_ids,
                document_ids=document_ids,
            )
        if arch == "decoder":
            return self.decode(
                input_ids,
                attention_mask,
                position_ids=position_ids,
                token_type_ids=token_type_ids,
                document_ids=document_ids,
                prefix_lengths=prefix_lengths,
            )
        if document_ids is not None:
            raise ValueError("document_ids are for encoder or decoder models (packed LM rows)")
        if decoder_input_ids is None:
            raise ValueError("an encoder_decoder model needs decoder_input_ids")
        memory = self.encode(input_ids, attention_mask, token_type_ids=token_type_ids)
        return self.decode(decoder_input_ids, decoder_attention_mask, memory=memory, memory_mask=attention_mask)

    def new_cache(self, batch: int, capacity: int | None = None, dtype=None, device=None) -> KVCache | LinearState:
        """The decoding state: a KV cache of `capacity` tokens; with a sliding window a rolling
        cache of min(window, capacity) slots; with linear attention the recurrent state."""
        cfg = self.config
        weight = self.tokens.weight
        layers = cfg.decoder_layers if cfg.arch != "encoder" else 0
        if cfg.attention_kind == "linear":
            return LinearState(layers, batch, cfg.n_heads, cfg.dim_per_head, device or weight.device)
        if cfg.sliding_window is not None:
            return RollingKVCache(
                layers,
                batch,
                cfg.kv_heads,
                cfg.dim_per_head,
                min(cfg.sliding_window, capacity or cfg.sliding_window),
                dtype or weight.dtype,
                device or weight.device,
            )
        return KVCache(
            cfg.decoder_layers if cfg.arch != "encoder" else 0,
            batch,
            cfg.kv_heads,
            cfg.dim_per_head,
            capacity or cfg.max_seq_len,
            dtype or weight.dtype,
            device or weight.device,
        )
