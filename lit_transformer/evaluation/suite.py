"""The recipe's `eval` section as a suite: each entry built once by its kind's `build`, then run
at every validation it is due at (and at the end of training, and by `evaluate`).

run_suite leaves training as it found it: the RNG streams (torch CPU and CUDA, numpy, Python's
random) and every submodule's train/eval mode are saved before each evaluation and restored
after it, whatever it raised, so a run with a suite draws the same dropout masks and batches
as one without. Each evaluation runs without gradients, under the run's autocast, and is timed.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from lit_transformer.evaluation import choice, classify, heldout, pairs, translate
from lit_transformer.evaluation.eval_target import EvalTarget, Evaluation
from lit_transformer.recipe.eval_schema import EvalConfig
from lit_transformer.recipe.schema import RunConfig

KINDS: dict[str, Callable[[EvalConfig, RunConfig], Evaluation]] = {
    "heldout": heldout.build,
    "classify": classify.build,
    "choice": choice.build,
    "pairs": pairs.build,
    "translate": translate.build,
}


def build_suite(entries: Sequence[EvalConfig], cfg: RunConfig) -> list[Evaluation]:
    """Each entry's evaluation, its data read and checked now (before training starts)."""
    return [KINDS[entry.kind](entry, cfg) for entry in entries]


def due(evaluation: Evaluation, step: int | None, final: bool) -> bool:
    """Whether an evaluation runs at `step`: every time without every_n_steps, else at its
    multiples and at the end (`final`). Without a step (`evaluate`), always."""
    every = evaluation.entry.every_n_steps
    return every is None or final or step is None or step % every == 0


def run_suite(
    evaluations: Sequence[Evaluation], target: EvalTarget, *, step: int | None = None, final: bool = False
) -> dict[str, float]:
    """{"eval/<name>/<metric>": value, "eval/<name>/seconds": wall time} of every due evaluation."""
    out: dict[str, float] = {}
    for evaluation in evaluations:
        if not due(evaluation, step, final):
            continue
        name = evaluation.entry.name
        began = time.perf_counter()
        with untouched(target), torch.no_grad(), target.autocast():
            metrics = evaluation(target)
        out.update({f"eval/{name}/{metric}": float(value) for metric, value in metrics.items()})
        out[f"eval/{name}/seconds"] = time.perf_counter() - began
    return out


@contextmanager
def untouched(target: EvalTarget) -> Iterator[None]:
    """Every module in eval mode for the duration; afterwards each (the objective's, the model's,
    their children's) back in its own mode, and the RNG streams as they were."""
    root: Any = target.module if target.module is not None else target.model
    modes = [(m, m.training) for m in {*root.modules(), *target.model.modules()}]
    streams = _rng_state()
    root.eval()
    target.model.eval()
    try:
        yield
    finally:
        _set_rng_state(streams)
        for module, training in modes:
            module.training = training  # per module: a frozen submodule stays in eval mode


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
