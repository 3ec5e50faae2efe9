"""Masked language modelling (Devlin et al. 2019): predict the tokens the collator masked.

The LM head runs only on the masked positions: with BERT's 15% masking that skips about 85%
of the vocabulary projection (and of the bert_mlm transform), the largest single matrix
product of a small-vocabulary-heavy model; the loss is identical (tests check it).

Shape legend: B batch, T length, C model width, N masked positions in the batch, V vocabulary.
"""

from __future__ import annotations

import torch

from lit_transformer.model.language_model import LanguageModel
from lit_transformer.objectives.metrics import IGNORE_INDEX, token_cross_entropy
from lit_transformer.objectives.objective_base import LanguageModelObjective
from lit_transformer.recipe.registry import implements


@implements("mlm")
class MaskedLM(LanguageModelObjective):
    compiles_whole_step = True  # its losses go through loss_terms
    token_averages = ("loss", "masked_accuracy")

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits at every position (B, T, V), e.g. for fill-mask."""
        return self.model(input_ids, attention_mask, token_type_ids=token_type_ids)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        loss_sum, nll_sum, count, correct = self._masked_terms(batch, self.optim.label_smoothing, self.optim.z_loss)
        n = self.token_normalizer(count)
        return self.finish_training_step(
            loss_sum / n,
            nll_sum / n,
            batch,
            flop_tokens=self._tokens(batch),
            head_positions=count,
            metrics={"masked_accuracy": correct / n},
        )

    def eval_update(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        _, nll_sum, count, correct = self._masked_terms(batch, 0.0)
        self.eval_metrics["loss"].update(nll_sum, count)
        self.eval_metrics["masked_accuracy"].update(correct, count)

    def eval_compute(self) -> dict[str, float]:
        out = self.lm_eval_metrics(self.eval_metrics["loss"].compute())
        out["masked_accuracy"] = float(self.eval_metrics["masked_accuracy"].compute())
        return out

    def masked_logits(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits (N, V), targets (N,)) at the positions whose label is not IGNORE_INDEX."""
        return masked_logits(self.model, batch)

    def _masked_terms(self, batch, label_smoothing: float, z_loss: float = 0.0):
        return self.loss_terms(masked_terms, batch, label_smoothing, z_loss=z_loss)

    @staticmethod
    def _tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        mask = batch.get("attention_mask")
        return mask.sum() if mask is not None else batch["input_ids"].numel()


def masked_logits(model: LanguageModel, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (N, V), targets (N,)) at the positions whose label is not IGNORE_INDEX. A
    decoder reads its rows bidirectionally through the batch's prefix_lengths (a mixture)."""
    labels = batch["labels"]
    predicted = labels != IGNORE_INDEX  # (B, T)
    rows = {"prefix_lengths": batch["prefix_lengths"]} if "prefix_lengths" in batch else {}
    logits = model.logits_at(
        batch["input_ids"],
        batch.get("attention_mask"),
        predicted,
        token_type_ids=batch.get("token_type_ids"),
        position_ids=batch.get("position_ids"),  # with data.document_mask
        document_ids=batch.get("document_ids"),
        **rows,
    )  # (N, V)
    return logits, labels[predicted]


def masked_terms(model: LanguageModel, batch: dict[str, torch.Tensor], label_smoothing: float, *, z_loss: float = 0.0):
    """(loss sum, NLL sum, masked count, correct predictions) over the masked positions; the
    loss sum holds the label smoothing and the z-loss (metrics.token_cross_entropy)."""
    logits, targets = masked_logits(model, batch)  # (N, V), (N,)
    loss_sum, nll_sum, count = token_cross_entropy(logits, targets, label_smoothing, z_loss)
    correct = (logits.detach().argmax(-1) == targets).sum()
    return loss_sum, nll_sum, count, correct
