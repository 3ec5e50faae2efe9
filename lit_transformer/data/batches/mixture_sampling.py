"""How often each task of a mixture is drawn, which task each optimizer step trains, and the
sampler that feeds every task from its own rank-sharded sampler (data/modules/mixture_module.py says how a
mixture uses them).

- Rates (`mixture_rates`): the tasks' weights, or T5's examples-proportional mixing with an
  artificial limit K, optionally temperature-scaled (Raffel et al. 2020, 3.5.2).
- Draws (`task_for_step`): a function of (seed, step) alone, the same on every rank and resume.
- Batches (`MixtureBatchSampler`): task t's c-th batch is batch c % per_epoch of epoch
  c // per_epoch of its own sampler; on another layout each task goes on from its cursor.
  Each key carries the schedule's share done at its step (progress.py), read here in the main
  process for the collators that schedule by it.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections.abc import Iterator, Sequence

from torch.utils.data import DistributedSampler

from lit_transformer.data.batches.progress import ScheduleProgress
from lit_transformer.data.batches.sampler import ResumableBatchSampler, cursor

RATE_METHODS = ("weights", "proportional", "temperature")


def mixture_rates(
    sizes: Sequence[int],
    method: str,
    *,
    weights: Sequence[float] | None = None,
    cap: int | None = None,
    temperature: float = 1.0,
) -> list[float]:
    """Each task's share of the optimizer steps, summing to 1.

    weights:      w_i / sum_j w_j (weights=None: equal shares)
    proportional: min(n_i, K) / sum_j min(n_j, K), n_i the task's training examples, K = cap
                  (None: no limit), so a huge task does not crowd out the others (T5, 3.5.2)
    temperature:  proportional to min(n_i, K) ** (1 / temperature); temperature 1 is
                  proportional, a large one approaches equal shares
    """
    n = len(sizes)
    if n == 0:
        raise ValueError("mixture_rates: no tasks")
    if method not in RATE_METHODS:
        raise ValueError(f"mixture_rates: method={method!r} is not one of {list(RATE_METHODS)}")
    if any(isinstance(s, bool) or int(s) != s or s < 0 for s in sizes):
        raise ValueError(f"mixture_rates: sizes={list(sizes)} must be non-negative integers")
    if cap is not None and (isinstance(cap, bool) or int(cap) != cap or cap <= 0):
        raise ValueError(f"mixture_rates: cap={cap!r} must be a positive integer or None")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"mixture_rates: temperature={temperature!r} must be a positive number")
    if method == "weights":
        w = [1.0] * n if weights is None else [float(x) for x in weights]
        if len(w) != n:
            raise ValueError(f"mixture_rates: {len(w)} weights for {n} tasks")
        if any(not math.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
            raise ValueError(f"mixture_rates: weights={list(w)} must be non-negative with a positive sum")
    else:
        limited = [float(min(s, cap) if cap is not None else s) for s in sizes]
        top = max(limited)
        if top <= 0:
            raise ValueError(f"mixture_rates: sizes={list(sizes)} hold no training examples")
        power = 1.0 if method == "proportional" else 1.0 / temperature
        w = [(m / top) ** power for m in limited]  # scaled by the largest first: no overflow for small T
    total = sum(w)
    return [x / total for x in w]


def _uniform(seed: int, step: int) -> float:
    """A uniform number in [0, 1) from a stable hash of (seed, step): no global RNG, no state."""
    digest = hashlib.blake2b(repr(("mixture", int(seed), int(step))).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 11) / float(1 << 53)  # 53 bits: exact in a double


def task_for_step(seed: int, step: int, rates: Sequence[float]) -> int:
    """The task that optimizer step `step` trains: drawn with probabilities `rates`, keyed only by
    (seed, step). A task of rate 0 is never drawn."""
    bounds = list(itertools.accumulate(float(r) for r in rates))
    if not bounds or bounds[-1] <= 0:
        raise ValueError(f"task_for_step: rates={list(rates)} have no positive rate")
    return bisect.bisect_right(bounds, _uniform(seed, step) * bounds[-1])


class MixtureBatchSampler(DistributedSampler):
    """Infinite keys (task, (epoch, batch index, example indices), progress): micro-batch i
    trains the task of step i // accumulate, and takes that task's next batch (module docstring);
    progress, `progress.at` that step (None without a `progress`), reaches the collators that
    schedule by it (mntp.py's mask rate).

    It subclasses DistributedSampler (as ResumableBatchSampler does) so that Lightning leaves it
    in place under DDP; each task's sampler is already sharded by rank. It has no length, so a
    DataLoader over it is an infinite iterable to Lightning. `resume(micro_batches, task_batches,
    origins)` sets where every later iteration starts (default: the beginning; origins: cursor's).
    """

    def __init__(
        self,
        samplers: Sequence[ResumableBatchSampler],
        rates: Sequence[float],
        *,
        seed: int = 0,
        accumulate: int = 1,
        progress: ScheduleProgress | None = None,
    ):
        if not samplers or len(samplers) != len(rates):
            raise ValueError(f"MixtureBatchSampler: {len(samplers)} samplers for {len(rates)} rates")
        if isinstance(accumulate, bool) or int(accumulate) != accumulate or accumulate < 1:
            raise ValueError(f"MixtureBatchSampler: accumulate={accumulate!r} must be a positive integer")
        first = samplers[0]
        super().__init__(
            range(0),
            num_replicas=first.num_replicas,
            rank=first.rank,
            shuffle=any(s.shuffle for s in samplers),
            seed=seed,
            drop_last=True,
        )
        for t, (s, rate) in enumerate(zip(samplers, rates)):
            if (s.num_replicas, s.rank) != (first.num_replicas, first.rank) or not s.drop_last:
                raise ValueError(
                    f"MixtureBatchSampler: task {t}'s sampler must be drop_last and on rank "
                    f"{first.rank} of {first.num_replicas}, as task 0's"
                )
            if rate > 0 and len(s) == 0:
                raise ValueError(f"MixtureBatchSampler: task {t} is drawn (rate {rate:.3g}) but has no full batch")
        self.samplers, self.rates, self.accumulate = list(samplers), [float(r) for r in rates], int(accumulate)
        self.progress = progress
        self._start: tuple[int, list[int]] = (0, [0] * len(samplers))
        self.origins = [(0, 0, 0)] * len(samplers)  # sampler.cursor's, per task
        self._orders: dict[int, tuple] = {}  # task -> (epoch, that epoch's order)

    def resume(
        self, micro_batches: int, task_batches: Sequence[int], origins: Sequence[tuple[int, int, int]] | None = None
    ) -> None:
        if len(task_batches) != len(self.samplers):
            raise ValueError(f"MixtureBatchSampler: {len(task_batches)} task counts for {len(self.samplers)} tasks")
        self._start = (int(micro_batches), [int(c) for c in task_batches])
        self.origins = [tuple(int(x) for x in o) for o in origins] if origins else [(0, 0, 0)] * len(self.samplers)

    def __len__(self) -> int:
        # a TypeError is what Lightning's `has_len` takes for "no length": an infinite loader
        raise TypeError("MixtureBatchSampler is infinite and has no length")

    def __iter__(self) -> Iterator[tuple[int, tuple[int, int, tuple], float | None]]:
        micro, counts = self._start[0], list(self._start[1])
        while True:
            t = task_for_step(self.seed, micro // self.accumulate, self.rates)
            yield t, self.task_batch(t, counts[t]), self.done(micro // self.accumulate)
            counts[t] += 1
            micro += 1

    def done(self, step: int) -> float | None:
        """The schedule's share done at optimizer step `step`, read when its key is drawn."""
        return self.progress.at(step) if self.progress is not None else None

    def task_batch(self, t: int, count: int) -> tuple[int, int, tuple]:
        """Key of task t's batch number `count` (from its start): (epoch, batch index, indices).
        Rank r takes positions p + r, p + r + W, ... of the epoch's order (sampler.cursor's p)."""
        sampler = self.samplers[t]
        step = sampler.batch_size * sampler.num_replicas
        epoch, position = cursor(count, self.origins[t], sampler.num_examples, step)
        cached = self._orders.get(t)
        if cached is None or cached[0] != epoch:
            cached = self._orders[t] = (epoch, sampler.order(epoch))
        start = position + sampler.rank
        return epoch, position // step, tuple(int(i) for i in cached[1][start : position + step : sampler.num_replicas])
