"""Output heads on top of hidden states. No losses here: they return logits.

Shape legend: B batch, T length, C model width, V vocabulary, N labels.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from lit_transformer.model.layers import activation_fn, make_norm

Pooling = Literal["first", "mean", "last"]


class LMHead(nn.Module):
    """Hidden states to vocabulary logits; `tied_to` shares the token embedding matrix
    (Press & Wolf 2017). bert_mlm adds BERT's transform: dense, activation, norm."""

    def __init__(
        self,
        d_model: int,
        vocab_size: int,
        *,
        tied_to: nn.Embedding | None,
        bias: bool,
        transform: bool = False,
        activation: str = "gelu",
        norm: str = "layernorm",
        norm_eps: float = 1e-12,
        input_scale: float = 1.0,
    ):
        super().__init__()
        self.dense = nn.Linear(d_model, d_model) if transform else None
        self.act = activation_fn(activation) if transform else None
        self.norm = make_norm(norm, d_model, norm_eps) if transform else None
        self.input_scale = input_scale
        self.decoder = nn.Linear(d_model, vocab_size, bias=bias)
        if tied_to is not None:
            self.decoder.weight = tied_to.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, V)
        return self.decoder(self.features(hidden))

    def features(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        """What the final vocabulary projection `decoder` reads (after BERT's transform, T5's scale)."""
        if self.dense is not None:
            hidden = self.norm(self.act(self.dense(hidden)))
        if self.input_scale != 1.0:
            hidden = hidden * self.input_scale
        return hidden


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None, how: str) -> torch.Tensor:
    """(B, T, C) -> (B, C): the first token ([CLS]), the mean of real tokens, or the last real
    token (what a causal decoder has read the whole input at). Right padding is assumed for last."""
    if how == "first":
        return hidden[:, 0]
    if attention_mask is None:
        attention_mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
    if how == "mean":
        weights = attention_mask.to(hidden.dtype)[..., None]  # (B, T, 1)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
    if how == "last":
        last = attention_mask.long().sum(1).clamp(min=1) - 1  # (B,)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise ValueError(f"unknown pooling {how!r}; expected one of first, mean, last")


class ClassificationHead(nn.Module):
    """Pool, then an optional dense+tanh layer (BERT's pooler), dropout, and a linear layer to N outputs."""

    def __init__(
        self, d_model: int, n_outputs: int, *, pooling: str = "first", hidden_layer: bool = True, dropout: float = 0.1
    ):
        super().__init__()
        self.pooling = pooling
        self.dense = nn.Linear(d_model, d_model) if hidden_layer else None
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(d_model, n_outputs)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = pool(hidden, attention_mask, self.pooling)  # (B, C)
        if self.dense is not None:
            x = torch.tanh(self.dense(x))
        return self.out(self.dropout(x))  # (B, N)
