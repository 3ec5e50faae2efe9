"""Masked scoring: pseudo-log-likelihood (Salazar et al. 2020, "Masked Language Model Scoring"),
and which scoring an entry gets (`scoring: causal | masked` on choice, pairs and heldout).

A text's pseudo-log-likelihood (PLL) is the sum, over its tokens, of the log-probability of each
token with that token masked and every other token visible. The rows are batched: a text of T
scored tokens costs T rows of one forward pass (chunked into `batch_size` rows), not T calls, and
the head runs on one position per row (LanguageModel.logits_at).

Where a masked token's prediction is read follows the objective that taught it: in place for BERT's
masked LM (an encoder, or a decoder's bidirectional mlm task), at the position before it for
masked next-token prediction (GPT-BERT, Charpentier and Samuel 2024: the causal head's layout, so
one head serves both modes). A decoder reads its masked rows bidirectionally, as it trained them
(prefix_lengths = T: every row fully visible, Stack.forward).

Shape legend: B rows in a chunk, T the chunk's longest row, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from lit_transformer.data.batches.collate import pad
from lit_transformer.errors import RunError
from lit_transformer.evaluation.eval_target import EvalTarget, eval_mode
from lit_transformer.recipe.eval_schema import EvalConfig
from lit_transformer.recipe.schema import RunConfig, TaskConfig
from lit_transformer.recipe.tasks import TASK_OBJECTIVES


@dataclass(frozen=True)
class Scoring:
    """How an entry scores text on one model: causally (next-token log-probabilities), or masked
    (pseudo-log-likelihood) reading each prediction `read` positions before its token."""

    kind: Literal["causal", "masked"]
    read: int = 0


def masked_tasks(cfg: RunConfig) -> list[TaskConfig]:
    """A mixture's tasks that trained masked prediction (TASK_OBJECTIVES' `bidirectional`: mlm,
    mntp), in the recipe's order."""
    return [t for t in cfg.tasks if TASK_OBJECTIVES[t.objective].bidirectional]


def resolve_scoring(entry: EvalConfig, arch: str, cfg: RunConfig) -> Scoring:
    """The scoring `entry` asks for on a model of `arch` trained by `cfg`, or a one-line RunError.
    Null takes the model's natural one: an encoder masked, a decoder and an encoder-decoder causal.
    A decoder scores masked only if it trained masked prediction (the run's resolved config says
    which tasks it trained); the first such task, or the entry's `task`, gives the read position."""
    where = f"eval.{entry.name}.scoring"
    kind = entry.scoring or ("masked" if arch == "encoder" else "causal")
    if kind == "causal":
        if arch == "encoder":
            raise RunError(
                f"{where}=causal: an encoder predicts masked tokens, not the next one; use scoring: masked "
                "(pseudo-log-likelihood)"
            )
        return Scoring("causal")
    if arch == "encoder":
        return Scoring("masked", 0)
    if arch != "decoder":
        raise RunError(
            f"{where}=masked: an {arch} scores text causally (its decoder writes it); masked scoring is for "
            "encoders and decoders that trained a bidirectional task"
        )
    tasks = masked_tasks(cfg)
    if entry.task is not None:
        tasks = [t for t in tasks if t.name == entry.task]
    if not tasks:
        trained = [f"{t.name} ({t.objective})" for t in cfg.tasks] or [cfg.objective.name]
        what = f"task {entry.task}" if entry.task is not None else "this decoder"
        raise RunError(
            f"{where}=masked: {what} trained no masked prediction (it trained {', '.join(trained)}), so it "
            "has no masked scores; use scoring: causal"
        )
    # mlm reads in place (the labels at the masked positions); mntp at the position before
    return Scoring("masked", 1 if TASK_OBJECTIVES[tasks[0].objective].shifted_targets else 0)


def pseudo_loglikelihoods(
    target: EvalTarget,
    items: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    read: int,
    batch_size: int,
) -> list[float]:
    """For each (token ids, scored positions): the summed log-probability of the tokens at those
    positions, each masked in its own row and predicted `read` positions before it. Every other
    position of the row keeps its token, so a text's context conditions each of its scores."""
    mask_id = target.special.mask_id
    if mask_id is None:
        raise RunError("masked scoring needs the tokenizer's mask token ([MASK] or <mask>); this one has none")
    for ids, positions in items:
        if any(not read <= p < len(ids) for p in positions):
            raise ValueError(f"scored positions {list(positions)} must lie in [{read}, {len(ids)}): read {read} before")
    model = target.model
    pad_id = target.special.pad_id if target.special.pad_id is not None else 0
    decoder = model.config.arch == "decoder"
    # longest texts first, a text's rows together: chunks of rows of about one length
    order = sorted(range(len(items)), key=lambda k: -len(items[k][0]))
    rows = [(k, p) for k in order for p in items[k][1]]
    sums = [0.0] * len(items)
    with eval_mode(model), target.autocast():
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            masked = []
            for k, p in chunk:
                ids = list(items[k][0])
                ids[p] = mask_id
                masked.append(ids)
            ids = pad(masked, pad_id).to(target.device)  # (B, T)
            B, T = ids.shape
            lengths = torch.tensor([len(x) for x in masked], device=ids.device)
            attention = (torch.arange(T, device=ids.device)[None, :] < lengths[:, None]).long()  # (B, T)
            selected = torch.zeros(B, T, dtype=torch.bool, device=ids.device)  # (B, T): one read position a row
            reads = torch.tensor([p - read for _, p in chunk], device=ids.device)  # (B,)
            selected[torch.arange(B, device=ids.device), reads] = True
            rows_mode = {"prefix_lengths": torch.full((B,), T, device=ids.device)} if decoder else {}
            logits = model.logits_at(ids, attention, selected, **rows_mode)  # (B, V): one row each, in order
            targets = torch.tensor([items[k][0][p] for k, p in chunk], device=ids.device)  # (B,)
            logp = torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None])[:, 0]  # (B,)
            for (k, _), value in zip(chunk, logp.tolist()):
                sums[k] += value
    return sums
