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

Resuming on another world size (`carry`): with W ranks of b examples per batch, the union of
every rank's first K batches of an epoch is exactly the first K x b x W positions of that epoch's
permutation. A position saved on one layout is therefore that prefix on any other: W' ranks of b'
skip K x b x W / (b' x W') batches each, when that is a whole number. TokenBatchSampler is the
same with whole batches in place of examples (its permutation is of batches). A mixture's task,
whose epochs follow one another inside a step, goes on from any position instead (`cursor`).
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

    @property
    def unit(self) -> int:
        """Positions of the epoch's order in one batch (examples here; TokenBatchSampler: 1 batch)."""
        return self.batch_size

    def epoch_length(self, world_size: int, unit: int) -> int:
        """Batches per rank per epoch on `world_size` ranks of `unit` positions (drop_last)."""
        return self.num_examples // world_size // unit

    def carry(self, batches: int, world_size: int, unit: int) -> int | None:
        """This rank's batches of an epoch already trained, from a position saved as `batches` per
        rank on `world_size` ranks of `unit` positions each (module docstring); None when that
        prefix is not a whole number of this layout's global batches. A finished epoch stays
        finished: the drop_last remainder differs between layouts and is never trained."""
        if not self.drop_last:
            raise ValueError("ResumableBatchSampler.carry: only training samplers (drop_last) carry a position")
        if batches >= self.epoch_length(world_size, unit):
            return len(self)
        done, step = batches * unit * world_size, self.unit * self.num_replicas
        return min(done // step, len(self)) if done % step == 0 else None

    def order(self, epoch: int) -> np.ndarray:
        """The example order of `epoch`, the same on every rank."""
        n = self.num_examples
        return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

    def shard(self, epoch: int) -> np.ndarray:
        """This rank's example indices for `epoch`, in order."""
        n, w = self.num_examples, self.num_replicas
        order = self.order(epoch)
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


def cursor(count: int, origin: tuple[int, int, int], num_examples: int, step: int) -> tuple[int, int]:
    """(epoch, position in its order) of the batch a rank takes after `count` batches, when every
    global micro-batch takes the next `step` (= batch x ranks) positions of the order and an epoch
    ends where no whole one is left (drop_last). `origin` (count, epoch, position) is where the
    counting started: (0, 0, 0) from the beginning; after a resume on another layout, the saved
    count at the saved position, which need not be a multiple of `step`."""
    first, epoch, position = origin
    k = count - first
    left = (num_examples - position) // step  # global micro-batches left in the origin's epoch
    if k < left:
        return epoch, position + k * step
    k -= left
    per_epoch = num_examples // step
    return epoch + 1 + k // per_epoch, (k % per_epoch) * step


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

    @property
    def unit(self) -> int:
        return 1

    def epoch_length(self, world_size: int, unit: int) -> int:
        return self._count // world_size

    def __iter__(self) -> Iterator[tuple[int, int, tuple]]:
        epoch = self.epoch
        start = self._skip[1] if self._skip is not None and self._skip[0] == epoch else 0
        self._skip = None
        for b, members in enumerate(self.epoch_batches(epoch)[start:], start):
            yield epoch, b, tuple(int(i) for i in members)
