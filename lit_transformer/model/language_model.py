"""LanguageModel: the shared core plus the LM head its config names. forward returns logits;
`logits_at` returns them at selected positions only (BERT's masked positions).

Shape legend: B batch, T length, C model width, V vocabulary, N selected positions.
"""

from __future__ import annotations

import torch
from torch import nn

from lit_transformer.model.config import TransformerConfig
from lit_transformer.model.heads import LMHead
from lit_transformer.model.init import init_weights
from lit_transformer.model.transformer import Transformer


class LanguageModel(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.config = cfg
        self.transformer = Transformer(cfg)
        mlm = cfg.lm_head == "bert_mlm"
        self.lm_head = LMHead(
            cfg.d_model,
            cfg.vocab_size,
            tied_to=self.transformer.tokens if cfg.tie_embeddings else None,
            bias=mlm,  # BERT's decoder has an output bias; GPT-2, T5 and LLaMA heads do not
            transform=mlm,
            activation="gelu" if mlm else cfg.activation,
            norm=cfg.norm,
            norm_eps=cfg.norm_eps,
            input_scale=cfg.d_model**-0.5 if cfg.scale_decoder_output else 1.0,
        )

    @classmethod
    def from_config(cls, cfg: TransformerConfig, device: torch.device | str | None = None) -> LanguageModel:
        """Build and initialise; on device "meta" only shapes are allocated. The modules are
        built on the meta device either way, so the layers' default initialisations draw
        nothing and `init_weights` takes the same random numbers whether it runs here or
        after FSDP2 sharded a meta-built model (lit_transformer.training.distributed.materialize)."""
        with torch.device("meta"):
            model = cls(cfg)
        if str(device) != "meta":
            model.to_empty(device=device or "cpu")  # re-ties the embedding
            init_weights(model, cfg)
        return model

    def tie_weights(self) -> None:
        """Share the token embedding with the LM head (again): materialising a meta model with
        `to_empty` allocates every parameter separately, which would silently untie them."""
        if self.config.tie_embeddings:
            self.lm_head.decoder.weight = self.transformer.tokens.weight

    def to_empty(self, *, device, recurse: bool = True) -> LanguageModel:
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return self

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
        """prefix_lengths (B,): per-row attention modes of a decoder-only model (UniLM): 0 causal,
        >= T bidirectional, p bidirectional over the first p tokens (Stack.forward)."""
        hidden = self.transformer(
            input_ids,
            attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            document_ids=document_ids,
            prefix_lengths=prefix_lengths,
        )
        return self.lm_head(hidden)  # (B, T, V)

    def head_features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs
    ) -> torch.Tensor:
        """What the LM head's final projection `lm_head.decoder` reads, (B, T, C): forward
        without that last matrix product, for a loss that fuses it with the cross-entropy
        (forward's keyword arguments pass through)."""
        return self.lm_head.features(self.transformer(input_ids, attention_mask, **kwargs))

    def logits_at(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        selected: torch.Tensor,
        *,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        prefix_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (N, V) at the N positions where `selected` (B, T) is true, in row-major order.
        The head runs on those positions only: with BERT's 15% masking that skips ~85% of the
        vocabulary projection. One method (not the caller composing transformer and head) so a
        wrapper that hooks calls into this module (FSDP2's forward methods) sees one call."""
        hidden = self.transformer(
            input_ids,
            attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            document_ids=document_ids,
            prefix_lengths=prefix_lengths,
        )  # (B, T, C)
        # boolean indexing has a data-dependent size (one host sync); the head then sees (N, C)
        return self.lm_head(hidden[selected])  # (N, V)
