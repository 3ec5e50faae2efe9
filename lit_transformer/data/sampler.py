"""Deterministic, rank-sharded, resumable batches.

`ResumableBatchSampler` yields one key per batch: (epoch, batch index, example indices). The
example order of an epoch is a permutation seeded by (seed, epoch), identical on every rank;
rank r takes positions r, r + W, r + 2W, ... of it (disjoint shards that together cover the
data). With `drop_last` every rank gets floor(N / W) examples and the same number of full
batches, so DDP ranks never wait on each other; without it, a short rank repeats the first
examples of the permutation (as torch's DistributedSampler does) unless `pad_uneven=False`.

It subclasses DistributedSampler so that Lightning leaves it in place under DDP instead of
wrapping it in a second sampler. `resume(epoch, batches)` skips exactly the batches already
consumed in that epoch; the skipped batches are never loaded.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np
from torch.utils.data import DistributedSampler


class ResumableBatchSampler(DistributedSampler):
    def __init__(self, num_examples: int, batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True, rank: int = 0, world_size: int = 1, pad_uneven: bool = True):
        super().__init__(range(num_examples), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.num_examples, self.batch_size, self.pad_uneven = num_examples, batch_size, pad_uneven
        self._skip: tuple[int, int] | None = None

    def resume(self, epoch: int, batches_done: int) -> None:
        self._skip = (epoch, batches_done)

    def shard(self, epoch: int) -> np.ndarray:
        """This rank's example indices for `epoch`, in order."""
        n, w = self.num_examples, self.num_replicas
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        mine = order[self.rank::w]
        if self.drop_last:
            return mine[: n // w]
        per_rank = math.ceil(n / w)
        if self.pad_uneven and len(mine) < per_rank:
            mine = np.concatenate([mine, order[: per_rank - len(mine)]])
        return mine

    def __len__(self) -> int:
        n = self.num_examples // self.num_replicas if self.drop_last else (
            math.ceil(self.num_examples / self.num_replicas) if self.pad_uneven
            else len(range(self.rank, self.num_examples, self.num_replicas)))
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[tuple[int, int, tuple]]:
        epoch = self.epoch
        start = 0
        if self._skip is not None and self._skip[0] == epoch:
            start = self._skip[1]
        self._skip = None
        mine = self.shard(epoch)
        for b in range(start, len(self)):
            yield epoch, b, tuple(int(i) for i in mine[b * self.batch_size:(b + 1) * self.batch_size])
