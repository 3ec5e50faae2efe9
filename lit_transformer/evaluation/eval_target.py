"""What every named evaluation shares: the model it reads (`EvalTarget`) and the shape of an
evaluation (`Evaluation`). Each kind (heldout.py, classify.py, choice.py, pairs.py, translate.py)
has a `build(entry, cfg)` that reads and checks its data once, before training starts, and returns
an Evaluation; calling it on a target returns its metrics by bare name (`accuracy`, `bleu`).
suite.py prefixes them `eval/<name>/` and times them.

An evaluation must leave training as it found it: no change to weights, optimizer state,
RNG streams or the model's train/eval mode (suite.py saves and restores the RNG streams and
the mode around every evaluation; a kind that trains, the finetune probe, trains a copy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from tokenizers import Tokenizer

from lit_transformer.data.tokens.tokenizer import SpecialTokens
from lit_transformer.model.language_model import LanguageModel
from lit_transformer.recipe.eval_schema import EvalConfig
from lit_transformer.recipe.schema import RunConfig


@dataclass(frozen=True)
class EvalTarget:
    """The weights under evaluation and how to read them.

    module: the run's objective (an ObjectiveBase) when there is one (in training, or loaded from
    a run or checkpoint): heldout computes the objective's own loss with it. None for a bare
    model directory, where heldout computes the language-model loss of the architecture.
    """

    model: LanguageModel
    tokenizer: Tokenizer
    special: SpecialTokens
    cfg: RunConfig  # the run's config: data keys (formats, max lengths), objective, tasks
    module: Any | None = None
    # a decoder that trained a bidirectional task (a mixture with mlm) reads classification
    # inputs bidirectionally, as finetune does (recipe.tasks.trains_bidirectional_mode)
    bidirectional: bool = False
    # a decoder mixture that trained prefix_lm: a choice's context is read as a bidirectional prefix
    prefix_lm: bool = False
    # the run's autocast (bf16-mixed): evaluations compute as the run trains
    autocast_dtype: torch.dtype | None = None

    @property
    def arch(self) -> str:
        return self.model.config.arch

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def autocast(self):
        """The run's autocast (bf16-mixed) on the model's device, or none: evaluations compute as
        the run trains."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Dropout off and no gradients while scoring; the caller's mode back afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


class Evaluation(Protocol):
    entry: EvalConfig

    def __call__(self, target: EvalTarget) -> dict[str, float]: ...
