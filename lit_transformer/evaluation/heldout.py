"""`kind: heldout`: the run's objective's own metrics (loss, perplexity, bits per byte, as fits
the objective) on a named text set, as `evaluate --data FILE` computes them on that file.

The set is the entry's files (any format the data pipeline reads; the entry's format,
text_format and text_column override the run's data keys where set), or `embedded:
stdlib_text`, the embedded standard-library corpus's validation split (what the data pipeline
reads when data.train_files is empty). Either way it is tokenised and packed once, in build(),
through the objective's own data module (the token cache keeps it across runs), so a call only
collates and runs the model. A mixture reports every task's metrics as `<task>/<metric>`.

max_examples caps the evaluation rows (the packed blocks of data.block_size tokens, or a
seq2seq task's examples), in whole evaluation batches of data.eval_batch_size rows: it counts
what is computed, where a cap on documents would leave the cost to their lengths.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lit_transformer.errors import RunError
from lit_transformer.evaluation.eval_target import EvalTarget
from lit_transformer.recipe import registry
from lit_transformer.recipe.eval_schema import EvalConfig
from lit_transformer.recipe.schema import RunConfig

# what evaluate and heldout report for the names the objectives log under val/ and test/
EVALUATE_NAMES = {
    "ppl": "perplexity",
    "bpb": "bits_per_byte",
    "masked_accuracy": "accuracy",
    "token_accuracy": "accuracy",
}
# The data pipeline builds a training split whatever it is asked: for the embedded corpus the
# heldout set is its validation split, and its 12 MB training split is cut to this many bytes,
# tokenised for nothing, instead of the whole of it.
UNREAD_TRAIN_BYTES = 1 << 16
# the data keys that say where a run's text comes from and how much of it is read: all replaced
_SOURCE_KEYS = (
    "train_files",
    "val_files",
    "test_files",
    "source_files",
    "target_files",
    "val_source_files",
    "val_target_files",
    "hub_name",
    "max_documents",
    "max_train_bytes",
    "max_val_bytes",
    "streaming",
    "num_workers",
)


def heldout_config(entry: EvalConfig, cfg: RunConfig) -> RunConfig:
    """The run's config reading the entry's text as its training and validation split, whole
    (none of the run's caps), from a token cache (not streamed). Workers: none, since an
    evaluation inside a training step would start worker processes at every call. A mixture's
    tasks lose their own source keys, so every task reads the entry's text."""
    changes: dict[str, Any] = dict(
        test_files=[],
        source_files=[],
        target_files=[],
        val_source_files=[],
        val_target_files=[],
        hub_name=None,
        max_documents=None,
        max_train_bytes=None,
        max_val_bytes=None,
        streaming=False,
        store="cache",  # a held-out set is read whole from the cache; the run's store holds its training blocks
        num_workers=0,
    )
    if entry.embedded == "stdlib_text":
        changes.update(train_files=[], val_files=[], max_train_bytes=UNREAD_TRAIN_BYTES)
    else:
        changes.update(train_files=list(entry.files), val_files=list(entry.files))
    for key in ("format", "text_format", "text_column"):
        if getattr(entry, key) is not None:
            changes[key] = getattr(entry, key)
    try:
        data = dataclasses.replace(cfg.data, **changes)
    except ValueError as error:  # DataConfig's own checks (a format it does not know)
        raise RunError(f"eval.{entry.name}: {error}") from None
    cleared = {k: None for k in (*_SOURCE_KEYS, "format", "text_format", "text_column")}
    tasks = [dataclasses.replace(t, data=dataclasses.replace(t.data, **cleared)) for t in cfg.tasks]
    return dataclasses.replace(cfg, data=data, tasks=tasks, objective=dataclasses.replace(cfg.objective, bleu=False))


class Heldout:
    """A named text set, tokenised and packed once; calling it computes the module's metrics."""

    def __init__(self, entry: EvalConfig, cfg: RunConfig):
        import lit_transformer.objectives  # noqa: F401  (registers the objective classes)
        from lit_transformer.data.sources.files import resolve_files
        from lit_transformer.errors import DataError

        self.entry = entry
        self.cfg = heldout_config(entry, cfg)
        if self.cfg.tokenizer.path is None:
            raise RunError(f"eval.{entry.name}: heldout reads the run's tokenizer.json; tokenizer.path is not set")
        try:
            if entry.files:  # named by the entry's key, before the pipeline names data.train_files
                resolve_files(entry.files, f"eval.{entry.name}.files", self.cfg.data.format)
            self.data = registry.objective_class(self.cfg.objective.name).data_module(self.cfg, None, None, 0)
            # Every rank reads the whole set as one process would: left to torch.distributed, each
            # rank's loader took every other row and max_examples rows of its own (twice the rows
            # of a one-process run, other numbers). The objective's metrics still sum over the
            # ranks when they compute: identical sums on every rank leave their ratios unchanged.
            self.data.read_whole()
            self.data.prepare_data()
            self.data.setup("fit")
        except DataError as error:
            raise RunError(f"eval.{entry.name}: {error}") from None
        eval_rows = self.cfg.data.eval_batch_size or self.cfg.data.batch_size
        self.max_batches = None if entry.max_examples is None else math.ceil(entry.max_examples / eval_rows)

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        from lit_transformer.objectives import evaluate_batches

        module = target.module
        if module is None:
            raise RunError(
                f"eval.{self.entry.name}: a heldout evaluation computes the objective's loss and needs the "
                "objective module (a run or checkpoint), not a bare model directory"
            )
        out: dict[str, float] = {}
        with measured_on(module, self.data, "validation"):
            for prefix, batches in module.evaluation_streams(self.data, None, "validation"):
                batches = module.evaluation_batches(batches, self.data.label_names, None)
                for key, value in evaluate_batches(module, batches, self.max_batches).items():
                    name = key.rsplit("/", 1)[-1]  # a mixture's metrics come as <task>/<name>
                    out[prefix + EVALUATE_NAMES.get(name, name)] = float(value)
        return out


@contextmanager
def measured_on(module: Any, data: Any, split: str) -> Iterator[None]:
    """The module's bits per byte measured on `split` of `data` for the duration: the bytes per
    token of the run's own validation text come back afterwards, or training's next validation
    would divide its loss by this set's."""
    # ObjectiveBase keeps it in bytes_per_token, MultiTaskLM per task in _task_bpb
    saved = {name: getattr(module, name) for name in ("bytes_per_token", "_task_bpb") if hasattr(module, name)}
    module.measure_bytes_on(data, split)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def build(entry: EvalConfig, cfg: RunConfig) -> Heldout:
    """The heldout evaluation of `entry` for a run of `cfg` (cfg.tokenizer.path: the run's tokenizer)."""
    return Heldout(entry, cfg)
