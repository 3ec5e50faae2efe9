"""Blocks, stacks and the Transformer (encoder | decoder | encoder_decoder). Returns hidden
states; heads and losses live elsewhere.

Shape legend: B batch, T query length, S key length, H heads, C model width, V vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .attention import Attention, KVCache, masked_value
from .config import TransformerConfig
from .layers import FeedForward, make_norm
from .positions import RelativePositionBias, alibi_bias, rope_cos_sin, sinusoidal


def _attention(cfg: TransformerConfig) -> Attention:
    return Attention(
        cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.dim_per_head, bias=cfg.bias,
        dropout=cfg.attention_dropout, scale=cfg.scale_attention, impl=cfg.attention_impl,
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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tokens(input_ids) * self.scale  # (B, T, C)
        if self.token_types is not None:
            x = x + self.token_types(token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids))
        if self.positions is not None:
            if positions.max() >= self.positions.num_embeddings:
                raise ValueError(
                    f"position {int(positions.max())} is past model.max_seq_len={self.positions.num_embeddings} "
                    "(learned positions)"
                )
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
        self.attn = _attention(cfg)
        self.norm1 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.cross_attn = _attention(cfg) if cross else None
        self.norm_cross = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if cross else None
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation, bias=cfg.bias, gated=cfg.gated)
        self.norm2 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, bias, *, is_causal=False, rope=None, memory=None, memory_bias=None,
                cache=None, layer=0):
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

    def __init__(self, cfg: TransformerConfig, n_layers: int, *, causal: bool, cross: bool,
                 tokens: nn.Embedding):
        super().__init__()
        self.cfg, self.causal = cfg, causal
        self.embed = Embeddings(cfg, tokens)
        self.relative_bias = (
            RelativePositionBias(cfg.n_heads, cfg.relative_buckets, cfg.relative_max_distance, bidirectional=not causal)
            if cfg.position == "t5_relative" else None
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
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """input_ids (B, T), attention_mask (B, T) with 1 for real tokens -> hidden (B, T, C)."""
        B, T = input_ids.shape
        past = cache.length if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=input_ids.device).expand(B, T)
        if cache is not None and past + T > cache.capacity:
            raise ValueError(f"KV cache holds {cache.capacity} tokens; {past + T} requested")
        x = self.embed(input_ids, position_ids, token_type_ids)
        bias, is_causal, k_positions = self._self_bias(attention_mask, position_ids, cache, x.dtype)
        rope = None
        if self.cfg.position == "rope":
            rope = tuple(t.to(x.dtype) for t in rope_cos_sin(position_ids, self.cfg.dim_per_head, self.cfg.rope_base))
        memory_bias = None
        if memory is not None and memory_mask is not None:
            memory_bias = _padding_bias(memory_mask.bool(), x.dtype)  # (B, 1, 1, S)
        for i, block in enumerate(self.blocks):
            x = block(x, bias, is_causal=is_causal, rope=rope, memory=memory, memory_bias=memory_bias,
                      cache=cache, layer=i)
        if cache is not None:
            cache.length = past + T
        if self.final_norm is not None:
            x = self.final_norm(x)
        return self.final_dropout(x)

    def _self_bias(self, attention_mask, q_positions, cache, dtype):
        """One additive bias (B|1, H|1, T, S) for all layers, or None with `is_causal` so that
        SDPA can take its fused causal kernel when there is nothing else to add."""
        B, T = q_positions.shape
        if cache is not None:
            past = cache.length
            mask = attention_mask.bool() if attention_mask is not None else torch.ones(B, T, dtype=torch.bool,
                                                                                        device=q_positions.device)
            cache.key_mask[:, past:past + T] = mask
            cache.positions[:, past:past + T] = q_positions
            key_mask, k_positions = cache.key_mask[:, :past + T], cache.positions[:, :past + T]  # (B, S)
        else:
            past = 0
            key_mask = attention_mask.bool() if attention_mask is not None else None
            k_positions = q_positions
        position_bias = None
        if self.relative_bias is not None:
            position_bias = self.relative_bias(q_positions, k_positions)  # (B, H, T, S)
        elif self.cfg.position == "alibi":
            position_bias = alibi_bias(q_positions, k_positions, self.cfg.n_heads)
        if key_mask is None and position_bias is None and past == 0:
            return None, self.causal, k_positions  # fused path: no bias tensor at all
        S = past + T
        keep = torch.ones(B, 1, T, S, dtype=torch.bool, device=q_positions.device)
        if key_mask is not None:
            keep = keep & key_mask[:, None, None, :]
        if self.causal:
            q_index = torch.arange(past, S, device=keep.device)[:, None]  # (T, 1) in cache coordinates
            keep = keep & (torch.arange(S, device=keep.device)[None, :] <= q_index)
        bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, masked_value(dtype))
        if position_bias is not None:
            bias = bias + position_bias.to(dtype)
        return bias, False, k_positions


def _padding_bias(key_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, S) bool -> additive (B, 1, 1, S)."""
    bias = torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device)
    return bias.masked_fill(~key_mask, masked_value(dtype))[:, None, None, :]


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

    def encode(self, input_ids, attention_mask=None, *, token_type_ids=None, position_ids=None):
        if self.encoder is None:
            raise ValueError(f"a {self.config.arch} model has no encoder")
        return self.encoder(input_ids, attention_mask, token_type_ids=token_type_ids, position_ids=position_ids)

    def decode(self, input_ids, attention_mask=None, *, memory=None, memory_mask=None, position_ids=None,
               token_type_ids=None, cache: KVCache | None = None):
        if self.decoder is None:
            raise ValueError(f"a {self.config.arch} model has no decoder")
        if self.config.arch == "encoder_decoder" and memory is None:
            raise ValueError("an encoder_decoder model's decoder needs the encoder output (memory)")
        return self.decoder(input_ids, attention_mask, position_ids=position_ids, token_type_ids=token_type_ids,
                            memory=memory, memory_mask=memory_mask, cache=cache)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states of the last stack: (B, T, C); for encoder_decoder, (B, T_dec, C)."""
        arch = self.config.arch
        if arch == "encoder":
            return self.encode(input_ids, attention_mask, token_type_ids=token_type_ids, position_ids=position_ids)
        if arch == "decoder":
            return self.decode(input_ids, attention_mask, position_ids=position_ids, token_type_ids=token_type_ids)
        if decoder_input_ids is None:
            raise ValueError("an encoder_decoder model needs decoder_input_ids")
        memory = self.encode(input_ids, attention_mask, token_type_ids=token_type_ids)
        return self.decode(decoder_input_ids, decoder_attention_mask, memory=memory, memory_mask=attention_mask)

    def new_cache(self, batch: int, capacity: int | None = None, dtype=None, device=None) -> KVCache:
        cfg = self.config
        weight = self.tokens.weight
        return KVCache(cfg.decoder_layers if cfg.arch != "encoder" else 0, batch, cfg.kv_heads, cfg.dim_per_head,
                       capacity or cfg.max_seq_len, dtype or weight.dtype, device or weight.device)
