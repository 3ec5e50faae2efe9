"""Causal (next-token) language modelling (Radford et al. 2018, 2019). The collator has
already shifted the labels: labels[t] is the token after input_ids[t], IGNORE_INDEX on padding.

Shape legend: B batch, T length, V vocabulary.
"""

from __future__ import annotations

import torch

from lit_transformer.model.language_model import LanguageModel
from lit_transformer.objectives.fused_loss import linear_cross_entropy
from lit_transformer.objectives.metrics import token_cross_entropy
from lit_transformer.objectives.objective_base import LanguageModelObjective
from lit_transformer.recipe.registry import implements


@implements("clm")
class CausalLM(LanguageModelObjective):
    compiles_whole_step = True  # its losses go through loss_terms
    reports_bits_per_byte = True  # every token of the text, predicted in order

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits (B, T, V)."""
        return self.model(input_ids, attention_mask)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        loss_sum, nll_sum, count = self._terms(batch, self.optim.label_smoothing, self.optim.z_loss)
        n = self.token_normalizer(count)
        mask = batch.get("attention_mask")
        tokens = mask.sum() if mask is not None else batch["input_ids"].numel()
        return self.finish_training_step(loss_sum / n, nll_sum / n, batch, flop_tokens=tokens, head_positions=count)

    def eval_update(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        _, nll_sum, count = self._terms(batch, 0.0)
        self.eval_metrics["loss"].update(nll_sum, count)

    def eval_compute(self) -> dict[str, float]:
        return self.lm_eval_metrics(self.eval_metrics["loss"].compute())

    def sample(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 32, **kwargs
    ) -> torch.Tensor:
        """Continue prompts with `lit_transformer.model.generate.generate` (greedy by default;
        do_sample, temperature, top_k, top_p, num_beams, eos_token_id, ... pass through).
        Returns (B, T + G): the left-padded prompts, then the new tokens."""
        from lit_transformer.model.generate import generate

        return generate(self.model, input_ids, attention_mask, max_new_tokens=max_new_tokens, **kwargs)

    def _terms(self, batch, label_smoothing: float, z_loss: float = 0.0):
        return self.loss_terms(causal_terms, batch, label_smoothing, fused=self.fuse_head_and_loss(), z_loss=z_loss)


def causal_terms(
    model: LanguageModel, batch: dict[str, torch.Tensor], label_smoothing: float, *, fused: bool, z_loss: float = 0.0
):
    """(loss sum, NLL sum, target count) of next-token prediction over the labels the collator
    shifted; the head and the loss run fused when `fused` (training with a plain head weight).
    The loss sum holds the label smoothing and the z-loss (metrics.token_cross_entropy).
    Also serves the prefix LM of a mixture, whose batch carries prefix_lengths."""
    labels = batch["labels"]
    if labels.shape != batch["input_ids"].shape:
        raise ValueError(
            f"clm labels {tuple(labels.shape)} must match input_ids {tuple(batch['input_ids'].shape)} "
            "(the collator shifts them)"
        )
    extra = _row_inputs(batch)
    if fused:
        features = model.head_features(batch["input_ids"], batch.get("attention_mask"), **extra)  # (B, T, C)
        decoder = model.lm_head.decoder
        loss_sum, nll_sum, count, _ = linear_cross_entropy(
            features.flatten(0, 1),
            decoder.weight,
            decoder.bias,
            labels.reshape(-1),
            label_smoothing,
            z_loss=z_loss,
            count_correct=False,
        )
        return loss_sum, nll_sum, count
    logits = model(batch["input_ids"], batch.get("attention_mask"), **extra)  # (B, T, V)
    V = logits.shape[-1]
    return token_cross_entropy(logits.reshape(-1, V), labels.reshape(-1), label_smoothing, z_loss)  # (B*T, V)


def _row_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """document_ids and position_ids of packed rows (data.document_mask), and prefix_lengths
    (a mixture's attention modes), when the collator sent them."""
    return {key: batch[key] for key in ("document_ids", "position_ids", "prefix_lengths") if key in batch}
