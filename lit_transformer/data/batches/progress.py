"""How far a run is through its schedule, for the data schedules that follow it (mntp.py's mask
rate): the share done at an optimizer step, 0 at the start and 1 at the end of the run.

The run ends at trainer.max_time where that is set, else at trainer.max_steps, as for the
learning rate (objectives/optim.py, `lr_multiplier`): without a time budget the share at step s
is s / max_steps; with one, the seconds of training spent by step s over max_time, capped at 1.
A time budget stops a run at whatever step its time runs out, so a schedule over max_steps (an
upper bound there) would barely start. The seconds are the training clock's marks, which
training.TimeBudget passes on (`mark`: after each mark, agreed over ranks, and at a resume the
checkpoint's), so the data schedules and the learning rate read one clock, and a resumed run
goes on from the seconds it had spent instead of starting its schedule again.

A batch is drawn before its step's mark exists (Lightning fetches a batch ahead, loader workers
more): the seconds at step s are the last mark carried on at the run's mean pace so far, m s / k
for m seconds over the first k steps. At a steady pace that is exactly the mark the learning rate
reads for step s (the clock after s steps); where the pace changes, it is off by the fetching
lead's few steps at most.

The training sampler runs in the main process (with loader workers too), so it can read this: it
puts each key's share in the key, and the collator in a worker reads it there. Validation and
evaluation batches carry none, and their schedules read the end value. No torch here.
"""

from __future__ import annotations

from lit_transformer.errors import DataError


class ScheduleProgress:
    """The share of the schedule done at each optimizer step (module docstring), over
    `max_time` seconds of training when given, else over `max_steps` optimizer steps; with
    neither, no share (None), and a schedule reads its end value."""

    def __init__(self, *, max_steps: int | None = None, max_time: float | None = None):
        if max_time is not None and not max_time > 0:
            raise DataError(f"trainer.max_time={max_time} must be positive or null")
        self.max_steps = max_steps if max_steps is not None and max_steps > 0 else None
        self.max_time = None if max_time is None else float(max_time)
        self.steps, self.seconds = 0, 0.0  # the last mark: seconds of training over the first `steps` steps

    def mark(self, steps: int, seconds: float) -> None:
        """`seconds` of training were spent over the run's first `steps` optimizer steps."""
        self.steps, self.seconds = int(steps), float(seconds)

    def at(self, step: int) -> float | None:
        """The share done at optimizer step `step` (0-based: the step's update is not yet done),
        in [0, 1]; None without an end."""
        if self.max_time is not None:
            seconds = self.seconds * step / self.steps if self.steps > 0 else self.seconds  # at the pace so far
            return min(max(seconds, 0.0) / self.max_time, 1.0)
        if self.max_steps is None:
            return None
        return min(max(step, 0) / self.max_steps, 1.0)
