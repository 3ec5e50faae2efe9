"""Weight initialisation as an explicit function, so a model built on the meta device can be
materialised (`module.to_empty(device=...)`) and then initialised in place, shard by shard."""

from __future__ import annotations

import math

import torch
from torch import nn

from lit_transformer.model.attention import Attention
from lit_transformer.model.config import TransformerConfig
from lit_transformer.model.layers import FeedForward, RMSNorm


@torch.no_grad()
def init_weights(module: nn.Module, cfg: TransformerConfig) -> nn.Module:
    """Normal(0, init_std) for every matrix and embedding, zero biases, unit norms.

    Residual output projections get std / sqrt(2 * layers) (GPT-2, Radford et al. 2019, 2.3)
    so the residual stream's variance does not grow with depth. Without score scaling
    (T5), queries absorb the 1/sqrt(head_dim) instead (Raffel et al. 2020, footnote on init).
    """
    std = cfg.init_std
    n_layers = cfg.n_layers + (cfg.decoder_layers if cfg.arch == "encoder_decoder" else 0)
    residual_std = std / math.sqrt(2 * n_layers)
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            nn.init.normal_(sub.weight, 0.0, std)
            if sub.bias is not None:
                nn.init.zeros_(sub.bias)
        elif isinstance(sub, nn.Embedding):
            nn.init.normal_(sub.weight, 0.0, std)
        elif isinstance(sub, nn.LayerNorm):
            nn.init.ones_(sub.weight)
            if sub.bias is not None:
                nn.init.zeros_(sub.bias)
        elif isinstance(sub, RMSNorm):
            nn.init.ones_(sub.weight)
    for sub in module.modules():
        if isinstance(sub, Attention):
            nn.init.normal_(sub.o.weight, 0.0, residual_std)
            if not cfg.scale_attention:
                nn.init.normal_(sub.q.weight, 0.0, std / math.sqrt(sub.head_dim))
        elif isinstance(sub, FeedForward):
            nn.init.normal_(sub.down.weight, 0.0, residual_std)
    return module
