"""Mixtures of tasks on one set of weights (UniLM, UL2, T5's multi-task mixtures): what each
task objective needs from the model and the data, each task's data settings, and the checks a
recipe with `tasks:` gets when it is read.

A task objective trains one attention mode of the shared core:
  mlm        bidirectional: an encoder, or a decoder with every row fully visible (UniLM)
  clm        causal: a decoder
  prefix_lm  a decoder bidirectional over a prefix and causal after it (UniLM's seq2seq mask,
             T5's prefix LM), or an encoder-decoder that encodes the prefix and decodes the rest
             (UL2's S-denoiser)
  mntp       masked next-token prediction (GPT-BERT, Charpentier and Samuel 2024): a decoder
             reading masked rows bidirectionally, each masked token predicted at the position
             before it (data/batches/mntp.py)
  span       T5 span corruption: an encoder-decoder (UL2's R- and X-denoisers)
  seq2seq    supervised source -> target pairs: an encoder-decoder

`mixture.mixing: row` stacks rows of every task in each batch, which only a decoder's clm, mlm,
mntp and prefix_lm tasks of one row length and one batch size can share (ROW_MIXING).

Nothing here imports torch or Lightning.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lit_transformer.data.data_config import DataConfig
from lit_transformer.data.data_plan import DataPlan, MixtureSettings, MixtureTask
from lit_transformer.errors import DataError, RecipeError
from lit_transformer.recipe import registry
from lit_transformer.recipe.schema import RunConfig, TaskConfig


@dataclass(frozen=True)
class TaskObjectiveSpec:
    archs: tuple[str, ...]  # model.arch values it trains
    pipelines: dict  # model.arch -> the data pipeline's kind (data.data_config.OBJECTIVES): token cache, collator
    parameters: tuple[str, ...] = ()  # the task keys of its objective (each replaces the data key of that name)
    length_keys: tuple[str, ...] = ("block_size",)  # data keys that bound what the model reads
    bidirectional: bool = False  # trains a decoder's fully bidirectional mode (classification reads it)
    # a masked token's prediction is read at the position before it (mntp: the causal head's
    # convention), not at its own position (mlm); masked scoring must read it there too
    shifted_targets: bool = False
    # its loss predicts the text in order (a whole block, or the continuation after a prefix), so
    # it converts to bits per byte of the text; mlm and span predict corrupted tokens only
    predicts_text_in_order: bool = False


TASK_OBJECTIVES: dict[str, TaskObjectiveSpec] = {
    "mlm": TaskObjectiveSpec(
        ("encoder", "decoder"),
        {"encoder": "mlm", "decoder": "mlm"},
        parameters=("mlm_probability", "mask_replace_prob", "random_replace_prob"),
        bidirectional=True,
    ),
    "clm": TaskObjectiveSpec(("decoder",), {"decoder": "clm"}, predicts_text_in_order=True),
    # a decoder's prefix LM reads next-token blocks (T + 1 tokens); an encoder-decoder's splits
    # plain blocks of T tokens into what it encodes and what it decodes
    "prefix_lm": TaskObjectiveSpec(
        ("decoder", "encoder_decoder"), {"decoder": "clm", "encoder_decoder": "mlm"}, predicts_text_in_order=True
    ),
    # reads the clm pipeline's next-token blocks (T + 1 tokens), so it shares a clm task's token cache
    "mntp": TaskObjectiveSpec(
        ("decoder",),
        {"decoder": "clm"},
        parameters=("mask_rate_start", "mask_rate_end", "max_span_length", "mask_replace_prob", "random_replace_prob"),
        bidirectional=True,
        shifted_targets=True,
    ),
    "span": TaskObjectiveSpec(
        ("encoder_decoder",), {"encoder_decoder": "span"}, parameters=("noise_density", "mean_span_length")
    ),
    "seq2seq": TaskObjectiveSpec(
        ("encoder_decoder",), {"encoder_decoder": "seq2seq"}, length_keys=("max_length", "max_target_length")
    ),
}

# the recipe's data keys that a task's own objective parameters replace
_OBJECTIVE_PARAMETERS = (
    "mlm_probability",
    "mask_replace_prob",
    "random_replace_prob",
    "noise_density",
    "mean_span_length",
)
# task keys of one objective's own, with no data key behind them
_TASK_PARAMETERS = ("mask_rate_start", "mask_rate_end", "max_span_length")
MAX_SPAN_LENGTH = 3  # mntp's default (GPT-BERT's SpanMaskingStrategy)
# task objectives whose rows on a decoder carry attention modes (Stack.forward's prefix_lengths:
# a bidirectional prefix, or the whole row), which need full softmax attention
MODE_OBJECTIVES = ("mlm", "mntp", "prefix_lm")
# mixture.mixing=row: the task objectives whose rows stack in one batch, by model.arch
ROW_MIXING = {"decoder": ("clm", "mlm", "mntp", "prefix_lm")}


def pipeline(task: TaskConfig, arch: str) -> str:
    """The data pipeline kind (token cache and collator) of a task on a model architecture."""
    return TASK_OBJECTIVES[task.objective].pipelines[arch]


def task_datas(cfg: RunConfig) -> list[DataConfig]:
    """The data sections a run reads: each task's (task_data), or the recipe's own."""
    return [task_data(cfg, task) for task in cfg.tasks] if cfg.tasks else [cfg.data]


def task_data(cfg: RunConfig, task: TaskConfig) -> DataConfig:
    """The recipe's data section with the task's `data` overrides and objective parameters."""
    changes = {k: v for k, v in dataclasses.asdict(task.data).items() if v is not None}
    for key in DataConfig.FILE_KEYS:
        if isinstance(changes.get(key), str):  # one file where a list is expected
            changes[key] = [changes[key]]
    changes.update({k: getattr(task, k) for k in _OBJECTIVE_PARAMETERS if getattr(task, k) is not None})
    try:
        return dataclasses.replace(cfg.data, **changes)
    except DataError as error:
        raise RecipeError(f"tasks.{task.name}: {error}") from None


def mode_tokens(cfg: RunConfig) -> list[str]:
    """The tasks' mode tokens, each once, in the order the tasks name them."""
    return list(dict.fromkeys(t.mode_token for t in cfg.tasks if t.mode_token is not None))


def longest_task_input(cfg: RunConfig) -> tuple[str, int]:
    """(key, value) of the longest sequence any task feeds the model (a mode token adds one)."""
    best = ("", 0)
    for task in cfg.tasks:
        data = task_data(cfg, task)
        for key in TASK_OBJECTIVES[task.objective].length_keys:
            length = getattr(data, key) + (task.mode_token is not None)
            if length > best[1]:
                best = (f"tasks.{task.name}: data.{key}", length)
    return best


def check_mixture(cfg: RunConfig, arch: str, source: str) -> None:
    """One-line RecipeErrors for a mixture the model cannot train or the data cannot feed."""
    names = [t.name for t in cfg.tasks]
    for name in names:
        if names.count(name) > 1:
            raise RecipeError(f"{source}: tasks: the name {name!r} is used twice; task names must be unique")
        if not name or "/" in name or name.strip() != name:
            raise RecipeError(f"{source}: tasks: name {name!r} must be non-empty, without '/' or surrounding spaces")
    for task in cfg.tasks:
        spec = TASK_OBJECTIVES[task.objective]
        if arch not in spec.archs:
            raise RecipeError(
                f"{source}: tasks.{task.name}.objective={task.objective} needs model.arch in "
                f"{list(spec.archs)}, got {arch!r}"
            )
        data = task_data(cfg, task)
        if data.document_mask:
            raise RecipeError(
                f"{source}: tasks.{task.name}: data.document_mask=true is not offered in a mixture "
                "(a mode token and prefix positions would cross packed documents)"
            )
        if data.streaming:
            raise RecipeError(
                f"{source}: tasks.{task.name}: data.streaming=true is not offered in a mixture "
                "(the mixture draws batches from each task's token cache)"
            )
        if data.store != "cache":
            raise RecipeError(
                f"{source}: tasks.{task.name}: data.store={data.store} is not offered in a mixture "
                "(the mixture draws batches from each task's token cache)"
            )
        if data.batch_tokens is not None:
            raise RecipeError(
                f"{source}: tasks.{task.name}: data.batch_tokens is not offered in a mixture "
                "(each task's batches hold data.batch_size examples)"
            )
        for key in (*_OBJECTIVE_PARAMETERS, *_TASK_PARAMETERS):
            if key not in spec.parameters and getattr(task, key) is not None:
                takes = [name for name, other in TASK_OBJECTIVES.items() if key in other.parameters]
                raise RecipeError(
                    f"{source}: tasks.{task.name}.{key} applies to objective {', '.join(takes)}, not {task.objective}"
                )
    if cfg.mixture.mixing == "row":
        _check_row_mixing(cfg, arch, source)


def _check_row_mixing(cfg: RunConfig, arch: str, source: str) -> None:
    """mixture.mixing=row stacks every task's rows in one batch: one shape for all of them."""
    stackable = ROW_MIXING.get(arch, ())
    for task in cfg.tasks:
        if task.objective not in stackable:
            raise RecipeError(
                f"{source}: mixture.mixing=row stacks rows of {list(ROW_MIXING['decoder'])} tasks of a decoder; "
                f"tasks.{task.name}.objective={task.objective} on model.arch={arch} has batches of another "
                "shape: use mixture.mixing=step"
            )
    first = cfg.tasks[0]
    shape = _row_shape(cfg, first)
    for task in cfg.tasks[1:]:
        if _row_shape(cfg, task) != shape:
            raise RecipeError(
                f"{source}: mixture.mixing=row stacks rows of one length and one data.batch_size: tasks.{task.name} "
                f"has (length, batch) {_row_shape(cfg, task)}, tasks.{first.name} {shape}; make data.block_size, "
                "data.batch_size and the mode tokens agree, or use mixture.mixing=step"
            )


def _row_shape(cfg: RunConfig, task: TaskConfig) -> tuple[int, int]:
    """(tokens a decoder row of the task holds, examples per batch): every decoder pipeline's
    row is data.block_size tokens (a next-token block of T + 1 gives T inputs), with its mode token."""
    data = task_data(cfg, task)
    return data.block_size + (task.mode_token is not None), data.batch_size


def trains_bidirectional_mode(cfg: RunConfig) -> bool:
    """Whether a mixture trained its decoder's fully bidirectional mode (a task like UniLM's MLM)."""
    return any(TASK_OBJECTIVES[t.objective].bidirectional for t in cfg.tasks)


def data_plan(cfg: RunConfig) -> DataPlan:
    """What the run of `cfg` reads (data/modules/builder.py builds it): the objective's data kind
    (the registry's), or for a mixture each task's data settings and pipeline, one tokenizer
    trained on the recipe's own data section, and the mixing rates."""
    kind = registry.spec(cfg.objective.name).data
    if not cfg.tasks:
        return DataPlan(kind=kind, data=cfg.data, tokenizer=cfg.tokenizer, seed=cfg.trainer.seed)
    arch = cfg.model.arch
    tasks = tuple(
        MixtureTask(
            name=t.name,
            objective=t.objective,
            pipeline=pipeline(t, arch),
            data=task_data(cfg, t),
            prefix_fraction=t.prefix_fraction,
            mode_token=t.mode_token,
            **_mask_schedule(cfg, t),
        )
        for t in cfg.tasks
    )
    m = cfg.mixture
    mixing = MixtureSettings(
        arch=arch,
        rates=m.rates,
        weights=tuple(t.weight for t in cfg.tasks),
        cap=m.cap,
        temperature=m.temperature,
        accumulate=cfg.trainer.accumulate_grad_batches,
        mixing=m.mixing,
        max_steps=cfg.trainer.max_steps,
        max_time=cfg.trainer.max_time,
    )
    return DataPlan(
        kind=kind, data=cfg.data, tokenizer=cfg.tokenizer, seed=cfg.trainer.seed, tasks=tasks, mixture=mixing
    )


def _mask_schedule(cfg: RunConfig, task: TaskConfig) -> dict:
    """An mntp task's mask rates and span length, the defaults filled in (TaskConfig's comments)."""
    if task.objective != "mntp":
        return {}
    end = task.mask_rate_end if task.mask_rate_end is not None else task_data(cfg, task).mlm_probability
    return dict(
        mask_rate_start=task.mask_rate_start if task.mask_rate_start is not None else end,
        mask_rate_end=end,
        max_span_length=task.max_span_length if task.max_span_length is not None else MAX_SPAN_LENGTH,
    )
