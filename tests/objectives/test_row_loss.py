"""Per-row mixing's loss: a batch that stacks rows of a decoder's clm, mntp, mlm and prefix_lm
tasks trains exactly what those rows run alone through their single objectives train, each
target weighed once (the loss and every gradient), with the fused head and loss or without."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import V, seeded_model, tiny_config

from lit_transformer.data.batches.collate import CLMCollator, MLMCollator, example_generators
from lit_transformer.data.batches.mntp import MNTPCollator
from lit_transformer.data.batches.prefix import DecoderPrefixCollator, TaskCollator
from lit_transformer.data.batches.row_mixing import stack_rows
from lit_transformer.data.tokens.tokenizer import SpecialTokens
from lit_transformer.objectives.multitask import MultiTaskLM
from lit_transformer.objectives.row_loss import row_terms

SPECIAL = SpecialTokens(pad_id=0, unk_id=1, bos_id=2, eos_id=3, cls_id=4, sep_id=5, mask_id=6)
T = 11  # odd lengths and row counts
TASKS = [
    ("causal", "clm", CLMCollator(special=SPECIAL), 2, T + 1),
    ("hybrid", "mntp", MNTPCollator(special=SPECIAL, vocab_size=V, mask_rate_start=0.3, mask_rate_end=0.3), 5, T + 1),
    ("masked", "mlm", MLMCollator(special=SPECIAL, vocab_size=V, probability=0.3), 3, T),
    ("prefix", "prefix_lm", DecoderPrefixCollator(SPECIAL, 0.5), 1, T + 1),
]


def task_batches() -> list[dict]:
    rng = np.random.default_rng(1)
    out = []
    for t, (_, objective, base, rows, length) in enumerate(TASKS):
        collator = TaskCollator(base, task=t, objective=objective, arch="decoder")
        out.append(collator(list(rng.integers(8, V, size=(rows, length))), example_generators(0, 0, range(rows)), 0))
    return out


def gradients(module: MultiTaskLM, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    module.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("label_smoothing, z_loss", [(0.0, 0.0), (0.1, 1e-3)])
def test_a_stacked_batch_trains_what_its_rows_train_alone(fused, label_smoothing, z_loss):
    module = MultiTaskLM(
        seeded_model(tiny_config("decoder", dropout=0.0)),
        [{"name": name, "objective": objective} for name, objective, *_ in TASKS],
        optim={"label_smoothing": label_smoothing, "z_loss": z_loss},
    )
    module.fuse_head_and_loss = lambda: fused  # the fused head and loss, or plain logits (FSDP's path)
    alone = task_batches()
    mixed = stack_rows(alone, range(len(TASKS)))
    assert mixed["row_task"].tolist() == [0] * 2 + [1] * 5 + [2] * 3 + [3]
    assert mixed["prefix_lengths"][:2].tolist() == [0, 0] and mixed["prefix_lengths"][2:10].tolist() == [T] * 8

    loss = module.training_step(mixed, 0)
    got = gradients(module, loss)

    # each task's rows through its single objective's terms, combined token-weighted
    terms = [module._terms(module.tasks[t], batch, label_smoothing, z_loss) for t, batch in enumerate(alone)]
    counts = [int(term[2]) for term in terms]
    assert min(counts) > 0
    expected_loss = sum(term[0] for term in terms) / sum(counts)
    expected = gradients(module, expected_loss)
    assert float(loss.detach()) == pytest.approx(float(expected_loss.detach()), rel=1e-5)
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)

    # and task by task: the same sums, counts and accuracies as the single objectives'
    with torch.no_grad():
        per_task = row_terms(
            module.model, mixed, label_smoothing, fused=False, accuracy=[False, True, True, False], z_loss=z_loss
        )
        single = [module._terms(module.tasks[t], batch, label_smoothing, z_loss) for t, batch in enumerate(alone)]
    for (loss_sum, nll_sum, count, correct), reference in zip(per_task, single):
        assert int(count) == int(reference[2])
        assert float(loss_sum) == pytest.approx(float(reference[0]), rel=1e-5)
        assert float(nll_sum) == pytest.approx(float(reference[1]), rel=1e-5)
        if len(reference) == 4:
            assert int(correct) == int(reference[3])


def test_a_weighting_by_rows_instead_of_targets_would_be_caught():
    """The test above is sensitive to the weighting: the per-task means averaged differ."""
    module = MultiTaskLM(
        seeded_model(tiny_config("decoder", dropout=0.0)),
        [{"name": name, "objective": objective} for name, objective, *_ in TASKS],
    )
    alone = task_batches()
    with torch.no_grad():
        loss = module.training_step(stack_rows(alone, range(len(TASKS))), 0)
        terms = [module._terms(module.tasks[t], batch, 0.0) for t, batch in enumerate(alone)]
    means = sum(float(term[0] / term[2]) for term in terms) / len(terms)
    assert abs(float(loss) - means) > 1e-3
