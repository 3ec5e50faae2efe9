"""Sequence-length warmup for packed LM blocks (data.block_warmup_steps).

Li, Zhang and He 2022 ("The Stability-Efficiency Dilemma: Investigating Sequence Length Warmup
for Training GPT Models") train the first steps on short sequences, which they get by truncating
and so dropping tokens. Here a packed block is cut into shorter rows instead: a (B, T) batch
becomes (B * T / t, t), every token is still trained on, a step holds the same tokens, and only
the context a token sees and the attention's cost shrink. The length is a function of the
optimizer step alone, so a resumed run repeats it exactly, on any number of ranks.

Shape legend: B batch, T block length, t warmup row length, k = T / t.
"""

from __future__ import annotations

import torch


def doubling_warmup(step: int, *, full: int, start: int, steps: int) -> int:
    """The size at `step` of a warmup that doubles: start, 2 start, ..., full / 2 in equal stages
    over the first `steps` steps, then full. full / start is a power of two (settings.halved_down_to).
    This module's row length and batch_warmup.py's batch size both follow it."""
    if step >= steps:
        return full
    stages = (full // start).bit_length() - 1  # the smaller sizes: start ... full / 2
    return start << (step * stages // steps)


def warmup_row_length(step: int, *, block_size: int, start: int, steps: int) -> int:
    """Row length at optimizer step `step` (doubling_warmup up to block_size)."""
    return doubling_warmup(step, full=block_size, start=start, steps=steps)


def cut_rows(batch: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
    """Each (B, T) row of the batch cut into T / length rows of `length` tokens, in order, and
    rows without a real token (the padded tail of the last block) dropped: they would train
    nothing, and a row whose attention sees no key gives NaN. Every (B, T) tensor is cut (ids,
    mask, labels, document ids, positions: whatever the collator sent per token)."""
    B, T = batch["input_ids"].shape
    if length >= T:
        return batch
    if T % length:
        raise ValueError(f"a block of {T} tokens cannot be cut into rows of {length}")
    cut = {key: value.reshape(B * (T // length), length) for key, value in batch.items() if value.shape == (B, T)}
    if "attention_mask" in cut:  # (B k, t)
        keep = cut["attention_mask"].any(dim=1)
        if not bool(keep.all()):
            cut = {key: value[keep] for key, value in cut.items()}
    return {**batch, **cut}
