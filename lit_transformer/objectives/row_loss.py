"""The loss of a batch whose rows belong to several tasks (`mixture.mixing: row`,
data/batches/row_mixing.py): one pass of the decoder over all rows, each row in its own
attention mode (prefix_lengths), then each task's terms over the positions its labels name.

Every task objective of a stacked batch (clm, prefix_lm, mlm, mntp on a decoder) is a
cross-entropy of the logits at position t against labels[t] (the collators put the target
where its prediction is read: the next token for clm, prefix_lm and mntp, the masked token itself
for mlm), so one gather of the labelled positions serves them all, and the batch's summed
terms are exactly the sums of its tasks' rows run alone through their single objectives
(causal_terms, masked_terms), which the multitask objective divides by the batch's token count.

Shape legend: B batch, T length, C head features, N labelled positions, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lit_transformer.model.language_model import LanguageModel
from lit_transformer.objectives.fused_loss import linear_cross_entropy
from lit_transformer.objectives.metrics import IGNORE_INDEX, token_cross_entropy


def row_terms(
    model: LanguageModel,
    batch: dict[str, torch.Tensor],
    label_smoothing: float,
    *,
    fused: bool,
    accuracy: Sequence[bool],
    z_loss: float = 0.0,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per task t (len(accuracy) of them): (loss sum, NLL sum, target count, correct predictions)
    over the rows whose batch["row_task"] is t; correct is 0 where accuracy[t] is False. The head
    and the loss run fused when `fused` (training with a plain head weight), else the head runs
    on the labelled positions only (LanguageModel.logits_at)."""
    labels = batch["labels"]  # (B, T)
    selected = labels != IGNORE_INDEX  # (B, T)
    owner = batch["row_task"].to(labels.device)[:, None].expand_as(labels)[selected]  # (N,)
    targets = labels[selected]  # (N,)
    rows = {"prefix_lengths": batch["prefix_lengths"]}
    if fused:
        features = model.head_features(batch["input_ids"], batch.get("attention_mask"), **rows)[selected]  # (N, C)
        decoder = model.lm_head.decoder
    else:
        logits = model.logits_at(batch["input_ids"], batch.get("attention_mask"), selected, **rows)  # (N, V)
    out = []
    for t, counts_correct in enumerate(accuracy):
        mine = owner == t  # (N,)
        if fused:
            out.append(
                linear_cross_entropy(
                    features[mine],
                    decoder.weight,
                    decoder.bias,
                    targets[mine],
                    label_smoothing,
                    z_loss=z_loss,
                    count_correct=counts_correct,
                )
            )
            continue
        task_logits = logits[mine]  # (n, V)
        loss_sum, nll_sum, count = token_cross_entropy(task_logits, targets[mine], label_smoothing, z_loss)
        correct = (
            (task_logits.detach().argmax(-1) == targets[mine]).sum() if counts_correct else torch.zeros_like(count)
        )
        out.append((loss_sum, nll_sum, count, correct))
    return out
