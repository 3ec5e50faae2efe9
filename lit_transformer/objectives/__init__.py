"""Training objectives: one LightningModule per objective on a shared base; losses, metrics, optimizers.

Imports `model/`, `data/`, `recipe/`, `training/`, `errors`, `lazy`, `machine` and `constants`.

Importing this package registers every built-in objective with the registry
(`registry.implements`); `objective_class(name)` then returns its class.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lit_transformer.objectives.causal_lm import CausalLM
from lit_transformer.objectives.classifier import SequenceClassifier
from lit_transformer.objectives.masked_lm import MaskedLM
from lit_transformer.objectives.metrics import IGNORE_INDEX, bits_per_byte, token_cross_entropy
from lit_transformer.objectives.multitask import MultiTaskLM
from lit_transformer.objectives.objective_base import ObjectiveBase
from lit_transformer.objectives.optim import lr_multiplier, make_scheduler, parameter_groups
from lit_transformer.objectives.seq2seq import Seq2SeqLM
from lit_transformer.recipe.registry import objective_class
from lit_transformer.recipe.schema import OptimConfig


@torch.no_grad()
def evaluate_batches(
    module: ObjectiveBase, batches: Iterable[dict[str, Any]], max_batches: int | None = None
) -> dict[str, float]:
    """Run an objective's validation metrics over batches without a Trainer (single process).

    Returns the same names the objective logs under val/: loss, ppl and bpb (language models;
    bpb only where the loss predicts the text in order, `reports_bits_per_byte`, and with
    bytes_per_token), masked_accuracy (MaskedLM), token_accuracy and bleu
    (Seq2SeqLM), accuracy, macro_f1, micro_f1, mse, pearson (SequenceClassifier, by problem).
    """
    was_training = module.training
    module.eval()
    module.eval_reset()
    try:
        for index, batch in enumerate(batches):
            if max_batches is not None and index >= max_batches:
                break
            batch = {k: v.to(module.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            module.eval_update(batch, index)
        return module.eval_compute()
    finally:
        module.eval_reset()
        module.train(was_training)


__all__ = [
    "CausalLM",
    "IGNORE_INDEX",
    "MaskedLM",
    "MultiTaskLM",
    "ObjectiveBase",
    "OptimConfig",
    "Seq2SeqLM",
    "SequenceClassifier",
    "bits_per_byte",
    "evaluate_batches",
    "lr_multiplier",
    "make_scheduler",
    "objective_class",
    "parameter_groups",
    "token_cross_entropy",
]
