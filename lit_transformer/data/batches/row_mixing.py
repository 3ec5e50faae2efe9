"""Per-row mixing (`mixture.mixing: row`): every micro-batch holds rows of several tasks of a
decoder, in proportion to the mixing rates, each row with its own attention mode
(prefix_lengths) and its own task's targets. GPT-BERT trains causal and masked rows in the
same optimizer step, about 1 causal to 15 masked (Charpentier and Samuel 2024: a fixed share
of the devices runs each); step mixing (mixture_sampling.py) gives each step to one task.

- Rows (`rows_through`, `rows_in_batch`): the run's rows form one sequence in which every
  row belongs to a task, apportioned by Webster's (Sainte-Lague) method: the first H rows
  are the H smallest of the numbers (k + 1/2) / r_t, k = 0, 1, ..., over the tasks t (ties to
  the earlier task). A divisor method is house-monotone (Balinski and Young 1982), so each task's
  count only grows with H; every task's count stays within one row of r_t H, and where
  r_t x data.batch_size is whole (1:15 of 16 rows) every micro-batch holds exactly that many.
  Micro-batch m takes rows [mB, (m + 1)B) of each rank's sequence (B = data.batch_size), a
  pure function of m: the same on every rank and after a resume.
- Keys (`RowMixtureBatchSampler`): task t's c-th row is the c-th position of its own rank-
  sharded order (a sampler of batch size 1 and MixtureBatchSampler's cursors), so resuming,
  also on another layout, works as with step mixing; a task's count is its rows so far.
- Batches (`RowMixtureBatches`, `stack_rows`): each task's rows collated by its own collator,
  each row with its own generator (seed + t, its epoch and index, as in step mixing), then
  stacked in task order; `row_task` (B,) says whose each row is, and a causal row's
  prefix_lengths is 0.

Only batches of one shape stack: a decoder's clm, mlm, mntp and prefix_lm rows (input_ids,
attention_mask, labels (B, T), prefix_lengths (B,)); recipe/tasks.py refuses the others.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from fractions import Fraction

import torch

from lit_transformer.data.batches.collate import example_generators
from lit_transformer.data.batches.mixture_sampling import MixtureBatchSampler
from lit_transformer.data.batches.progress import ScheduleProgress
from lit_transformer.data.batches.sampler import ResumableBatchSampler
from lit_transformer.errors import DataError

ROW_KEYS = ("input_ids", "attention_mask", "labels")  # (B, T) each
# what a task's batch may carry besides ROW_KEYS to be stacked with the others' rows
STACKABLE = {*ROW_KEYS, "prefix_lengths", "task"}


def rows_through(total: int, rates: Sequence[float]) -> list[int]:
    """Each task's rows among the first `total` rows of the run's row sequence (module
    docstring), in exact rational arithmetic so that ties fall the same way everywhere."""
    weights = [Fraction(r) for r in rates]
    if total < 0 or not weights or min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(f"rows_through: total={total} and rates={list(rates)} share no rows")
    share = [w / sum(weights) for w in weights]

    def below(x: Fraction) -> list[int]:  # per task, how many of its numbers (k + 1/2) / r are <= x
        return [max(0, math.floor(x * r + Fraction(1, 2))) if r > 0 else 0 for r in share]

    # With shares summing to 1, sum(below(x)) lies in (x - n/2, x + n/2] for n tasks: every
    # number up to total - n is among the first `total`, and total + n covers them all.
    low, high = Fraction(max(total - len(share), 0)), Fraction(total + len(share))
    rows = below(low)
    after = sorted(
        ((k + Fraction(1, 2)) / r, t)
        for t, (r, first, last) in enumerate(zip(share, rows, below(high)))
        for k in range(first, last)
    )
    for _, t in after[: total - sum(rows)]:
        rows[t] += 1
    return rows


def rows_in_batch(micro: int, batch_size: int, rates: Sequence[float]) -> list[int]:
    """Each task's rows in micro-batch `micro` of `batch_size` rows (module docstring)."""
    start, stop = rows_through(micro * batch_size, rates), rows_through((micro + 1) * batch_size, rates)
    return [b - a for a, b in zip(start, stop)]


class RowMixtureBatchSampler(MixtureBatchSampler):
    """Infinite keys (((task, ((epoch, example index), ...)) for each task with rows), progress):
    micro-batch i holds rows_in_batch(i) rows of each task, each task's next rows of its own
    sampler (of batch size 1; module docstring), and the schedule's share done at its optimizer
    step (MixtureBatchSampler's). `resume` takes each task's rows so far."""

    def __init__(
        self,
        samplers: Sequence[ResumableBatchSampler],
        rates: Sequence[float],
        *,
        batch_size: int,
        seed: int = 0,
        accumulate: int = 1,
        progress: ScheduleProgress | None = None,
    ):
        if any(s.batch_size != 1 for s in samplers):
            raise ValueError("RowMixtureBatchSampler: every task's sampler must take one row at a time (batch size 1)")
        super().__init__(samplers, rates, seed=seed, accumulate=accumulate, progress=progress)
        self.batch_size = int(batch_size)

    def __iter__(self) -> Iterator[tuple[tuple, float | None]]:
        micro, counts = self._start[0], list(self._start[1])
        while True:
            parts = []
            for t, rows in enumerate(rows_in_batch(micro, self.batch_size, self.rates)):
                if rows:
                    keys = [self.task_batch(t, c) for c in range(counts[t], counts[t] + rows)]
                    parts.append((t, tuple((epoch, indices[0]) for epoch, _, indices in keys)))
                    counts[t] += rows
            yield tuple(parts), self.done(micro // self.accumulate)
            micro += 1


def stack_rows(batches: Sequence[dict], tasks: Sequence[int]) -> dict[str, torch.Tensor]:
    """The tasks' batches as one: ROW_KEYS and prefix_lengths stacked (0, causal, where a task
    sent none) and row_task (B,). A one-line DataError where they cannot stack."""
    lengths = [int(b["input_ids"].shape[1]) for b in batches]
    if len(set(lengths)) > 1:
        raise DataError(
            f"mixture.mixing=row: tasks {list(tasks)} give rows of {lengths} tokens; rows of one batch "
            "need one length (data.block_size and mode tokens must agree)"
        )
    for batch, t in zip(batches, tasks):
        extra = sorted(set(batch) - STACKABLE)
        if extra:
            raise DataError(f"mixture.mixing=row: task {t}'s batches carry {extra}, which cannot stack with other rows")
    out = {key: torch.cat([b[key] for b in batches]) for key in ROW_KEYS}  # (B, T) each
    out["prefix_lengths"] = torch.cat(
        [b.get("prefix_lengths", torch.zeros(len(b["input_ids"]), dtype=torch.long)) for b in batches]
    )  # (B,)
    owners = [torch.full((len(b["input_ids"]),), t, dtype=torch.long) for b, t in zip(batches, tasks)]
    out["row_task"] = torch.cat(owners)  # (B,)
    return out


class RowMixtureBatches(torch.utils.data.Dataset):
    """Map-style dataset whose keys are RowMixtureBatchSampler's: every batch comes stacked,
    with row_task, even when one task holds all its rows."""

    def __init__(self, examples: list, collators: list, seed: int):
        self.examples, self.collators, self.seed = examples, collators, seed

    def __len__(self) -> int:
        return sum(len(e) for e in self.examples)

    def __getitem__(self, key) -> dict:
        parts, done = key
        batches = []
        for t, rows in parts:
            # each row's generator keyed by (seed + t, its epoch, its index), as example_generators keys it
            gens = [example_generators(self.seed + t, epoch, [i])[0] for epoch, i in rows]
            batches.append(self.collators[t]([self.examples[t][i] for _, i in rows], gens, done))
        return stack_rows(batches, [t for t, _ in parts])
