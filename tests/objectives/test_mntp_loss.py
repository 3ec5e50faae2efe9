"""Masked next-token prediction's loss (GPT-BERT): every masked token is scored from the output
at the position before it, with the row read bidirectionally; checked against a loss computed
by hand from the logits, which the in-place (BERT) reading and a causal reading both miss."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import V, seeded_model, tiny_config

from lit_transformer.data.batches.collate import IGNORE_INDEX, example_generators
from lit_transformer.data.batches.mntp import MNTPCollator
from lit_transformer.data.batches.prefix import TaskCollator
from lit_transformer.data.tokens.tokenizer import SpecialTokens
from lit_transformer.objectives.multitask import MultiTaskLM

SPECIAL = SpecialTokens(pad_id=0, unk_id=1, bos_id=2, eos_id=3, cls_id=4, sep_id=5, mask_id=6)


def hand_loss(logits: torch.Tensor, original: torch.Tensor, masked: torch.Tensor, shift: int) -> torch.Tensor:
    """Summed -log p(original[b, i]) read at position i - shift, over the masked (b, i)."""
    total = torch.zeros(())
    for b, i in masked.nonzero().tolist():
        total = total - logits[b, i - shift].log_softmax(-1)[original[b, i]]
    return total


@pytest.mark.parametrize("mode_token", [None, 7])
def test_a_masked_token_is_scored_at_the_position_before_it(mode_token):
    B, T = 3, 13  # odd sizes
    rng = np.random.default_rng(0)
    blocks = list(rng.integers(8, V, size=(B, T + 1)))
    collator = TaskCollator(
        MNTPCollator(special=SPECIAL, vocab_size=V, mask_rate_start=0.4, mask_rate_end=0.4),
        task=0,
        objective="mntp",
        arch="decoder",
        mode_token_id=mode_token,
    )
    batch = collator(blocks, example_generators(0, 0, range(B)), 0)
    lead = 1 if mode_token is not None else 0
    assert batch["prefix_lengths"].tolist() == [T + lead] * B  # every row fully visible
    model = seeded_model(tiny_config("decoder", dropout=0.0))
    module = MultiTaskLM(model, [{"name": "hybrid", "objective": "mntp"}])
    _, nll_sum, count, correct = module._terms(module.tasks[0], batch, 0.0)

    # by hand: the block's positions i whose token was chosen, in the input's coordinates
    original = torch.as_tensor(np.stack(blocks))  # (B, T + 1)
    original = torch.cat([torch.full((B, lead), mode_token or 0), original], 1)  # the mode token leads
    masked = torch.zeros_like(original, dtype=torch.bool)
    masked[:, 1:] = batch["labels"] != IGNORE_INDEX
    assert int(count) == int(masked.sum()) > 0
    with torch.no_grad():
        both_ways = model(batch["input_ids"], batch["attention_mask"], prefix_lengths=batch["prefix_lengths"])
        causal = model(batch["input_ids"], batch["attention_mask"])
    # the tokens the loss targets are the block's tokens at the masked positions
    assert torch.equal(batch["labels"][batch["labels"] != IGNORE_INDEX], original[masked])
    shifted = hand_loss(both_ways, original, masked, shift=1)
    assert float(nll_sum) == pytest.approx(float(shifted), rel=1e-5)
    inside = masked.clone()
    inside[:, -1] = False  # the masked tokens still in the input (the block's last is a target only)
    in_place = hand_loss(both_ways, original, inside, shift=0) + hand_loss(both_ways, original, masked & ~inside, 1)
    assert abs(float(in_place) - float(shifted)) > 1e-2  # reading a masked token in place is another loss
    assert abs(float(hand_loss(causal, original, masked, shift=1)) - float(shifted)) > 1e-2
    assert int(correct) == int(
        sum(int(both_ways[b, i - 1].argmax() == original[b, i]) for b, i in masked.nonzero().tolist())
    )
