"""Our models inside EleutherAI's lm-evaluation-harness (lm-eval 0.4, Gao et al. 2021): an `LM`
whose three request types run through this package's own scoring and decoding, and
`run_harness`, which runs named harness tasks (built in or from local YAML) on an EvalTarget.

The harness is an optional dependency (`pip install "lit-transformer[eval]"`): it is imported
inside functions only, so that the package imports without it.

- loglikelihood: choice.loglikelihoods, the code the `choice` kind scores with, so a
  multiple_choice task and the same rows as a choice evaluation give the same acc and acc_norm.
- loglikelihood_rolling: choice.rolling_loglikelihoods (decoders).
- generate_until: BatchGenerator (the KV-cache decoding of `generate --input`), greedy unless the
  request asks for sampling, the text cut before the first of the request's `until` strings.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence

import numpy
import torch

from lit_transformer.errors import RunError, first_line
from lit_transformer.evaluation.batch_generate import BatchGenerator, ContextNotes, Decoding
from lit_transformer.evaluation.choice import BATCH_SIZE, loglikelihoods, rolling_loglikelihoods
from lit_transformer.evaluation.eval_target import EvalTarget

MAX_GEN_TOKS = 256  # the harness's default for generate_until requests that do not say


def _lm_eval():
    try:
        import lm_eval
    except ImportError:
        raise RunError('the lm-evaluation-harness is not installed: pip install "lit-transformer[eval]"') from None
    return lm_eval


def cut_at(text: str, until: Sequence[str]) -> str:
    """The text before the first occurrence of any stop string."""
    cut = len(text)
    for stop in until:
        if stop:
            at = text.find(stop)
            if 0 <= at < cut:
                cut = at
    return text[:cut]


def generate_texts(
    target: EvalTarget, requests: Sequence[tuple[str, dict]], *, batch_size: int = BATCH_SIZE
) -> list[str]:
    """The continuation of each (context, gen_kwargs) request as the harness's generate_until
    wants it: until (a string or list of them), max_gen_toks; do_sample, temperature, top_k and
    top_p as the harness names them (greedy when do_sample is false or temperature is 0)."""
    if target.arch == "encoder":
        raise RunError("generate_until needs a decoder or an encoder-decoder; this model is an encoder")
    style = "continue" if target.arch == "decoder" else "transform"
    groups: dict[Decoding, list[int]] = {}
    for n, (_, kwargs) in enumerate(requests):
        groups.setdefault(_decoding(kwargs), []).append(n)
    out = [""] * len(requests)
    model = target.model
    was_training = model.training
    try:
        for decoding, rows in groups.items():
            generator = BatchGenerator(
                model,
                target.tokenizer,
                target.special,
                style,
                decoding,
                batch_size=batch_size,
                notes=ContextNotes(),
                bidirectional_prompt=target.prefix_lm,
            )
            with target.autocast():
                texts = generator([requests[n][0] for n in rows])
            for n, text in zip(rows, texts):
                out[n] = cut_at(text, _until(requests[n][1]))
    finally:
        model.train(was_training)
    return out


def _until(kwargs: dict) -> list[str]:
    until = kwargs.get("until") or []
    return [until] if isinstance(until, str) else list(until)


def _decoding(kwargs: dict) -> Decoding:
    known = {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise RunError(f"generate_until: generation keys {unknown} are not supported (known: {sorted(known)})")
    temperature = float(kwargs.get("temperature", 1.0))
    sample = bool(kwargs.get("do_sample", False)) and temperature > 0
    return Decoding(
        max_new_tokens=int(kwargs.get("max_gen_toks", MAX_GEN_TOKS)),
        do_sample=sample,
        temperature=temperature if sample else 1.0,
        top_k=kwargs.get("top_k") if sample else None,
        top_p=kwargs.get("top_p") if sample else None,
    )


@functools.cache
def _adapter_class():
    """The LM subclass, made once on first use: lm_eval is imported only here."""
    from lm_eval.api.model import LM

    class LitTransformerLM(LM):
        """An EvalTarget as a harness model (module docstring)."""

        def __init__(self, target: EvalTarget, batch_size: int = BATCH_SIZE):
            super().__init__()
            self.target, self.batch_size = target, batch_size

        def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            return loglikelihoods(self.target, [r.args for r in requests], batch_size=self.batch_size)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            return rolling_loglikelihoods(self.target, [r.args[0] for r in requests], batch_size=self.batch_size)

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            return generate_texts(self.target, [r.args for r in requests], batch_size=self.batch_size)

    return LitTransformerLM


def harness_model(target: EvalTarget, *, batch_size: int = BATCH_SIZE):
    """An `lm_eval.api.model.LM` that evaluates `target`."""
    _lm_eval()
    return _adapter_class()(target, batch_size)


def run_harness(
    target: EvalTarget,
    tasks: list[str],
    *,
    include_path: str | None = None,
    limit: int | None = None,
    batch_size: int = BATCH_SIZE,
) -> dict[str, float]:
    """Harness tasks (names of built-in tasks, or of tasks defined by YAML files under
    include_path) on `target`, zero-shot, as {"<task>/<metric>": value}; a metric of a filter
    other than the default is "<task>/<metric>/<filter>". limit: the first N documents of each
    task. The harness seeds Python's, numpy's and torch's generators: they are put back after,
    so a run that evaluates keeps its random streams."""
    _lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    if not tasks:
        raise RunError("lm-eval: no tasks named")
    # indexing the harness's own thousands of task files takes seconds: tasks that all live
    # under include_path are found without them
    manager = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is None or any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=include_path)
    missing = [t for t in tasks if t not in manager.all_tasks]
    if missing:
        where = f" (nor under {include_path})" if include_path else ""
        raise RunError(f"lm-eval: no task named {', '.join(missing)} in the harness{where}")
    py_state, np_state = random.getstate(), numpy.random.get_state()
    with torch.random.fork_rng(devices=[target.device] if target.device.type == "cuda" else []):
        try:
            results = simple_evaluate(
                model=harness_model(target, batch_size=batch_size),
                tasks=list(tasks),
                limit=limit,
                task_manager=manager,
                log_samples=False,
            )
        except RunError:
            raise
        except Exception as error:  # a task's data or config: the harness's own message, on one line
            raise RunError(f"lm-eval {','.join(tasks)}: {first_line(error)}") from error
        finally:
            random.setstate(py_state)
            numpy.random.set_state(np_state)
    return flatten(results["results"] if results is not None else {})


def flatten(results: dict) -> dict[str, float]:
    """{"task": {"acc,none": 0.5, "acc_stderr,none": 0.1, "alias": "task"}} -> {"task/acc": 0.5, ...}."""
    out: dict[str, float] = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # the alias, and a stderr the harness could not compute ("N/A")
            metric, _, filter_name = key.partition(",")
            name = f"{task}/{metric}" if filter_name == "none" else f"{task}/{metric}/{filter_name}"
            out[name] = float(value)
    return out
