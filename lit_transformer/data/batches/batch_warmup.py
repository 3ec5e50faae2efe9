"""Batch-size warmup (data.batch_warmup_steps): the first optimizer steps take fewer examples.

GPT-3 (Brown et al. 2020, appendix B) ramped its batch size up over the first billions of tokens:
early in training the gradient is large and consistent, so a small batch moves the loss as far
as a large one at a fraction of the cost (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training": the critical batch grows as the loss falls).

Here the batches of the first epoch are cut from the same shuffled order as without the warmup,
only shorter: `batch_warmup_start` examples a batch, doubling in equal stages up to
`data.batch_size` over the first `batch_warmup_steps` optimizer steps. No example is skipped or
repeated, and the collator seeds each example as before, so a warmup run trains on exactly the
examples of a plain run, in the same order. Lightning trains one loader batch per micro-batch,
so the schedule counts micro-batches (steps x accumulation). The batch sizes are a function of
the position in the epoch alone: a resumed run repeats them exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import accumulate

from lit_transformer.data.batches.block_warmup import doubling_warmup
from lit_transformer.data.batches.sampler import ResumableBatchSampler
from lit_transformer.data.data_config import check_batch_warmup
from lit_transformer.errors import DataError


def warmup_batch_rows(item: int, *, batch_size: int, start: int, items: int) -> int:
    """Examples in micro-batch `item` of the first epoch (doubling_warmup up to batch_size over
    the first `items` micro-batches)."""
    return doubling_warmup(item, full=batch_size, start=start, steps=items)


class WarmupBatchSampler(ResumableBatchSampler):
    """A ResumableBatchSampler whose first epoch starts with smaller batches (module doc). Later
    epochs are the plain sampler's. A batch key is (epoch, batch index, example indices)."""

    def __init__(self, num_examples: int, batch_size: int, *, warmup_items: int, start: int, **kwargs):
        super().__init__(num_examples, batch_size, **kwargs)
        if not self.drop_last:
            raise ValueError("WarmupBatchSampler is for training batches (drop_last)")
        check_batch_warmup(batch_size, start)
        sizes = [
            warmup_batch_rows(i, batch_size=batch_size, start=start, items=warmup_items) for i in range(warmup_items)
        ]
        per_rank = num_examples // self.num_replicas
        needed = sum(sizes)
        if needed > per_rank:
            raise DataError(
                f"data.batch_warmup_steps: the warmup's {warmup_items} micro-batches take {needed} examples per rank, "
                f"more than an epoch's {per_rank}: lower data.batch_warmup_steps"
            )
        sizes += [batch_size] * ((per_rank - needed) // batch_size)
        self.first_epoch_sizes = sizes
        self._first_epoch_starts = [0, *accumulate(sizes)]  # where each batch starts in the rank's shard

    def __len__(self) -> int:
        return len(self.first_epoch_sizes) if self.epoch == 0 else super().__len__()

    def __iter__(self) -> Iterator[tuple[int, int, tuple]]:
        if self.epoch != 0:
            yield from super().__iter__()
            return
        start = self._skip[1] if self._skip is not None and self._skip[0] == 0 else 0
        self._skip = None
        mine, starts = self.shard(0), self._first_epoch_starts
        for b in range(start, len(self.first_epoch_sizes)):
            yield 0, b, tuple(int(i) for i in mine[starts[b] : starts[b + 1]])

    def carry(self, batches: int, world_size: int, unit: int) -> int | None:
        if self.epoch != 0:
            return super().carry(batches, world_size, unit)
        raise DataError(
            "data.batch_warmup_steps: a checkpoint saved in the first epoch resumes only on the layout it was saved "
            "with (its batch sizes follow the warmup): keep trainer.devices, trainer.num_nodes and data.batch_size"
        )
