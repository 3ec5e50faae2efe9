"""What data a run reads, as plain settings: the data kind a single objective's pipeline caches
and collates (the registry's `data` field), or a mixture's tasks and mixing rates. The recipe layer
writes a DataPlan (recipe/tasks.py `data_plan`); data/modules/builder.py builds its data module.
No torch here: reading a recipe imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from lit_transformer.data.data_config import DataConfig, TokenizerConfig
from lit_transformer.errors import DataError

TASK_OBJECTIVES = ("mlm", "clm", "prefix_lm", "mntp", "span", "seq2seq")
PIPELINES = ("mlm", "clm", "span", "seq2seq")


@dataclass
class MixtureTask:
    """One task of a mixture, as plain values (the recipe layer builds these)."""

    name: str
    objective: str  # what it trains: mlm | clm | prefix_lm | mntp | span | seq2seq
    pipeline: str  # the TextDataModule objective that caches and collates its data: mlm | clm | span | seq2seq
    data: DataConfig
    prefix_fraction: float = 0.5  # prefix_lm: the mean share of a row that is prefix
    mode_token: str | None = None  # put before every input (UL2's [NLU], [NLG], [S2S])
    # mntp: the mask rate at the run's start and end (MixtureSettings' max_time, else max_steps),
    # and the longest span (data/batches/mntp.py; GPT-BERT: 0.30 -> 0.15, spans of 1 to 3 tokens)
    mask_rate_start: float = 0.15
    mask_rate_end: float = 0.15
    max_span_length: int = 3

    def __post_init__(self):
        if self.objective not in TASK_OBJECTIVES:
            raise DataError(f"tasks.{self.name}.objective={self.objective!r} is not one of {list(TASK_OBJECTIVES)}")
        if self.pipeline not in PIPELINES:
            raise DataError(f"tasks.{self.name}: pipeline {self.pipeline!r} is not one of {list(PIPELINES)}")
        if not 0.0 < self.prefix_fraction < 1.0:
            raise DataError(f"tasks.{self.name}.prefix_fraction={self.prefix_fraction} is outside (0, 1)")
        for key in ("mask_rate_start", "mask_rate_end"):
            if not 0.0 < getattr(self, key) < 1.0:
                raise DataError(f"tasks.{self.name}.{key}={getattr(self, key)} is outside (0, 1)")
        if self.max_span_length < 1:
            raise DataError(f"tasks.{self.name}.max_span_length={self.max_span_length} must be positive")


@dataclass(frozen=True)
class MixtureSettings:
    """How a mixture's tasks share the steps (data/batches/mixture_sampling.py `mixture_rates`)."""

    arch: str  # the model's architecture: a prefix-LM task's pipeline and collator depend on it
    rates: str = "weights"
    weights: tuple[float, ...] | None = None
    cap: int | None = None
    temperature: float = 1.0
    accumulate: int = 1  # micro-batches per optimizer step: they all draw the step's task
    mixing: str = "step"  # one task per optimizer step, or rows of every task in each batch ("row")
    # the run's end, which an mntp task's mask rate falls over (data/batches/progress.py): seconds
    # of training (trainer.max_time) where set, as the learning rate, else optimizer steps
    max_steps: int | None = None
    max_time: float | None = None


@dataclass(frozen=True)
class DataPlan:
    """A run's data: `kind` is the registry's data kind of the objective ("mixture" with tasks).
    `data` is the recipe's data section (a mixture's tokenizer is trained on it)."""

    kind: str
    data: DataConfig
    tokenizer: TokenizerConfig
    seed: int
    tasks: tuple[MixtureTask, ...] = ()
    mixture: MixtureSettings | None = None
