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
from collections.abc import Iterator

import numpy as np
from torch.utils.data import DistributedSampler


class ResumableBatchSampler(DistributedSampler):
    def __init__(
        self,
        num_examples: int,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        rank: int = 0,
        world_size: int = 1,
        pad_uneven: bool = True,
    ):
        super().__init__(
            range(num_examples), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        self.num_examples, self.batch_size, self.pad_uneven = num_examples, batch_size, pad_uneven
        self._skip: tuple[int, int] | None = None

    def resume(self, epoch: int, batches_done: int) -> None:
        self._skip = (epoch, batches_done)

    def shard(self, epoch: int) -> np.ndarray:
        """This rank's example indices for `epoch`, in order."""
        n, w = self.num_examples, self.num_replicas
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        mine = order[self.rank :: w]
        if self.drop_last:
            return mine[: n // w]
        per_rank = math.ceil(n / w)
        if self.pad_uneven and len(mine) < per_rank:
            mine = np.concatenate([mine, order[: per_rank - len(mine)]])
        return mine

    def __len__(self) -> int:
        n = (
            self.num_examples // self.num_replicas
            if self.drop_last
            else (
                math.ceil(self.num_examples / self.num_replicas)
                if self.pad_uneven
                else len(range(self.rank, self.num_examples, self.num_replicas))
            )
        )
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[tuple[int, int, tuple]]:
        epoch = self.epoch
        start = 0
        if self._skip is not None and self._skip[0] == epoch:
            start = self._skip[1]
        self._skip = None
        mine = self.shard(epoch)
        for b in range(start, len(self)):
            yield epoch, b, tuple(int(i) for i in mine[b * self.batch_size : (b + 1) * self.batch_size])


class TokenBatchSampler(ResumableBatchSampler):
    """Batches of examples of similar length, each holding at most `batch_tokens` tokens counted
    as (examples x the longest one): fairseq's --max-tokens, the 2017 paper's "approximately
    25000 source tokens and 25000 target tokens" per batch. Random batches of short sentences
    are mostly padding (a third real tokens on Tatoeba at 64 pairs); sorted ones are not.

    Each epoch sorts all examples by length (ties in the (seed, epoch) permutation's order),
    cuts them greedily into batches and shuffles the batch order; rank r takes batches r, r + W,
    ... The sorted lengths do not change between epochs, so neither does the number of batches:
    every rank gets the same count, and `resume` skips batches exactly as the parent does.
    An example longer than `batch_tokens` is a batch of its own."""

    def __init__(
        self,
        lengths,
        batch_tokens: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ):
        super().__init__(
            len(lengths), 1, seed=seed, shuffle=shuffle, drop_last=drop_last, rank=rank, world_size=world_size
        )
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_tokens = batch_tokens
        self._count = len(self._cut(np.argsort(self.lengths, kind="stable")))

    def _cut(self, order: np.ndarray) -> list[np.ndarray]:
        """`order` sorted by length -> consecutive batches within the token budget."""
        batches, start = [], 0
        lengths = self.lengths[order]  # non-decreasing: a batch's newest member is its longest
        for i in range(1, len(order) + 1):
            if i == len(order) or (i + 1 - start) * lengths[i] > self.batch_tokens:
                batches.append(order[start:i])
                start = i
        return batches

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches of `epoch` (example indices), in the order they are trained."""
        n, w = self.num_examples, self.num_replicas
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        batches = self._cut(order[np.argsort(self.lengths[order], kind="stable")])
        if self.shuffle:
            batches = [batches[i] for i in np.random.default_rng([self.seed, epoch, 1]).permutation(len(batches))]
        return batches[self.rank :: w][: len(self)]

    def __len__(self) -> int:
        w = self.num_replicas
        return self._count // w if self.drop_last else -(-self._count // w)

    def __iter__(self) -> Iterator[tuple[int, int, tuple]]:
        epoch = self.epoch
        start = self._skip[1] if self._skip is not None and self._skip[0] == epoch else 0
        self._skip = None
        for b, members in enumerate(self.epoch_batches(epoch)[start:], start):
            yield epoch, b, tuple(int(i) for i in members)
