"""`kind: heldout`: the run's objective's own metrics (loss, perplexity, bits per byte, accuracy,
macro_f1, as fit the objective) on a named set: what training logs under val/ and test/.

The set is the run's own `split` (validation or test: the numbers training logged for the same
weights), or the entry's files (any format the data pipeline reads; the entry's format,
text_format and text_column override the run's data keys where set; a seq2seq run's aligned
source files with their target_files), or `embedded: stdlib_text`, the embedded standard-library
corpus's validation split. Either way that one split is tokenised and packed once, in build(),
by data/modules/split_reader.py (the token cache keeps it across runs; no training text is read),
so a call only collates and runs the model. A mixture reports every task's metrics as
`<task>/<metric>`; with `task`, that task's alone under the single objective's names.

max_examples caps the evaluation rows (the packed blocks of data.block_size tokens, or a
seq2seq task's examples), in whole evaluation batches of data.eval_batch_size rows (per task):
it counts what is computed, where a cap on documents would leave the cost to their lengths.

`scoring: masked` reports the set's pseudo-log-likelihood instead (Salazar et al. 2020; for an
encoder, or a decoder that trained masked prediction: masked_scoring.py): the same split packed in
plain blocks of data.block_size tokens (masked LM's), every token but the separators masked in
turn, as `pll_per_token` (nats, the mean over the scored tokens), `pseudo_perplexity` (its exp of
minus) and `tokens`. It is no perplexity: each token sees the whole block but itself, so it is
lower than a causal perplexity of the same text and the two do not compare. A block of T tokens
costs T rows of the model's forward pass, so cap it with max_examples. A mixture reads the
entry's `task`, else its first task that trained masked prediction (its data, its mode token).
`scoring: causal` is the objective's own metrics, refused on an encoder.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lit_transformer.data.data_config import CAPS, DataConfig
from lit_transformer.data.data_plan import DataPlan
from lit_transformer.errors import RunError, closest
from lit_transformer.evaluation.eval_target import EvalTarget
from lit_transformer.evaluation.masked_scoring import masked_tasks, pseudo_loglikelihoods, resolve_scoring
from lit_transformer.recipe.eval_schema import EvalConfig
from lit_transformer.recipe.schema import RunConfig
from lit_transformer.recipe.tasks import data_plan
from lit_transformer.training.rundir import LABELS_JSON

# what evaluate and heldout report for the names the objectives log under val/ and test/
EVALUATE_NAMES = {
    "ppl": "perplexity",
    "bpb": "bits_per_byte",
    "masked_accuracy": "accuracy",
    "token_accuracy": "accuracy",
}


def heldout_plan(entry: EvalConfig, cfg: RunConfig) -> DataPlan:
    """What the run of `cfg` reads (recipe.tasks.data_plan), with the entry's set as its validation
    split, whole (none of the run's caps), from the token cache (not streamed). A mixture's tasks
    take every source key from that set too, so each task reads it. The run's own plan for an
    entry of the run's own split. The run's config is not changed: only the plan's data sections."""
    plan = data_plan(cfg)
    if entry.split is not None:
        return plan
    changes: dict[str, Any] = {key: None for key in ("hub_name", *CAPS)}
    changes.update({key: [] for key in DataConfig.FILE_KEYS})  # train_files and val_files: below
    changes.update(streaming=False)
    if entry.embedded == "stdlib_text":
        changes.update(train_files=[], val_files=[])
    elif entry.target_files:  # aligned pairs: only the validation side is read
        changes.update(train_files=[], val_files=[], val_source_files=entry.files, val_target_files=entry.target_files)
    else:  # a training split must be named beside it; it is never read
        changes.update(train_files=list(entry.files), val_files=list(entry.files))
    for key in ("format", "text_format", "text_column"):
        if getattr(entry, key) is not None:
            changes[key] = getattr(entry, key)
    try:
        data = dataclasses.replace(plan.data, **changes)
    except ValueError as error:  # DataConfig's own checks (a format it does not know)
        raise RunError(f"eval.{entry.name}: {error}") from None
    sources = {k: getattr(data, k) for k in (*DataConfig.SOURCE_KEYS, "format", "text_format", "text_column")}
    tasks = tuple(dataclasses.replace(t, data=dataclasses.replace(t.data, **sources)) for t in plan.tasks)
    return dataclasses.replace(plan, data=data, tasks=tasks)


def trained_label_names(cfg: RunConfig) -> list | None:
    """A classification run's label names, in the model's order: its labels.json, which the run
    directory keeps beside the tokenizer.json that cfg.tokenizer.path names."""
    if cfg.tokenizer.path is None:
        return None
    path = Path(cfg.tokenizer.path).parent / LABELS_JSON
    return json.loads(path.read_text()).get("labels") if path.is_file() else None


def _checked(entry: EvalConfig, cfg: RunConfig) -> DataPlan:
    """heldout_plan(entry, cfg) after the checks every heldout entry gets: the tokenizer, the task."""
    where = f"eval.{entry.name}"
    if cfg.tokenizer.path is None:
        raise RunError(f"{where}: heldout reads the run's tokenizer.json; tokenizer.path is not set")
    names = [t.name for t in cfg.tasks]
    if entry.task is not None and not names:
        raise RunError(f"{where}.task={entry.task}: a {cfg.objective.name} run is one objective, not a mixture")
    if entry.task is not None and entry.task not in names:
        raise RunError(f"{where}.task={entry.task}: the mixture's tasks are {names}{closest(entry.task, names)}")
    return heldout_plan(entry, cfg)


def _read(entry: EvalConfig, data_format: str, read: Callable[[], Any]) -> Any:
    """read(): the split's reader, with the entry's files checked first (named by the entry's key,
    not by a data key) and a DataError or a missing split as one-line RunErrors."""
    from lit_transformer.data.sources.files import resolve_files
    from lit_transformer.errors import DataError

    where = f"eval.{entry.name}"
    try:
        for key in ("files", "target_files"):
            if getattr(entry, key):
                resolve_files(getattr(entry, key), f"{where}.{key}", data_format)
        data = read()
    except DataError as error:
        raise RunError(f"{where}: {error}") from None
    if not data.has_split:
        split = entry.split or "validation"
        named = " (the recipe names no data.test_files)" if split == "test" else ""
        raise RunError(f"{where}: the run's data has no {split} split{named}")
    return data


class Heldout:
    """A named set, tokenised and packed once; calling it computes the module's metrics."""

    def __init__(self, entry: EvalConfig, cfg: RunConfig):
        from lit_transformer.data.modules.split_reader import read_split

        self.entry = entry
        self.split = entry.split or "validation"
        plan = _checked(entry, cfg)
        # the model's labels: the run's own split is numbered by them, as training numbered it
        self.labels = trained_label_names(cfg)
        # Every rank reads the whole set as one process would (the reader knows no ranks): left to
        # torch.distributed, each rank took every other row and max_examples rows of its own. The
        # objective's metrics still sum over the ranks: identical sums leave their ratios unchanged.
        self.data = _read(
            entry,
            plan.data.format,
            lambda: read_split(
                plan,
                self.split,
                label_names=self.labels if entry.split is not None else None,
                max_examples=entry.max_examples,
            ),
        )

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        from lit_transformer.objectives import evaluate_batches

        module = target.module
        if module is None:
            raise RunError(
                f"eval.{self.entry.name}: a heldout evaluation computes the objective's loss and needs the "
                "objective module (a run or checkpoint), not a bare model directory"
            )
        out: dict[str, float] = {}
        # bits per byte of this set's text; the run's own bytes per token come back afterwards
        with module.bytes_measured_on(self.data, self.split):
            for prefix, batches in module.evaluation_streams(self.data, self.entry.task, self.split):
                batches = module.evaluation_batches(batches, self.data.label_names, self.labels)
                for key, value in evaluate_batches(module, batches).items():
                    name = key.rsplit("/", 1)[-1]  # a mixture's metrics come as <task>/<name>
                    out[prefix + EVALUATE_NAMES.get(name, name)] = float(value)
        return out


class MaskedHeldout:
    """A named set in plain blocks, read once; calling it computes its pseudo-log-likelihood."""

    def __init__(self, entry: EvalConfig, cfg: RunConfig):
        from lit_transformer.data.modules.split_reader import SplitReader

        self.entry = entry
        plan = _checked(entry, cfg)
        self.read = resolve_scoring(entry, cfg.model.arch, cfg).read
        task = masked_tasks(cfg) if entry.task is None else [t for t in cfg.tasks if t.name == entry.task]
        data = next(t.data for t in plan.tasks if t.name == task[0].name) if task else plan.data
        self.mode_token = task[0].mode_token if task else None
        self.rows = data.eval_batch_size or data.batch_size
        # masked LM's blocks (T tokens, stride T: pack.py), handed over as they are stored: the
        # collator's masking is this evaluation's to do, one token a row
        seed = cfg.trainer.seed
        self.data = _read(
            entry,
            data.format,
            lambda: SplitReader(
                data, cfg.tokenizer, "mlm", entry.split or "validation", seed=seed, max_examples=entry.max_examples
            ),
        )
        self.data.collator = lambda blocks, generators=None: [[int(t) for t in block] for block in blocks]

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        never = target.special.never_masked()
        lead = []
        if self.mode_token is not None:  # where TaskCollator put it: first, never masked
            lead = [target.tokenizer.token_to_id(self.mode_token)]
        items = []
        for blocks in self.data.batches():
            for block in blocks:
                ids = lead + block
                # separators are never masked in training; the first token has nothing before it to read at
                positions = [p for p in range(len(lead), len(ids)) if p >= self.read and ids[p] not in never]
                items.append((ids, positions))
        total = sum(pseudo_loglikelihoods(target, items, read=self.read, batch_size=self.rows))
        tokens = sum(len(positions) for _, positions in items)
        if tokens == 0:
            raise RunError(f"eval.{self.entry.name}: the set holds no token to score")
        per_token = total / tokens
        return {"pll_per_token": per_token, "pseudo_perplexity": math.exp(-per_token), "tokens": float(tokens)}


def build(entry: EvalConfig, cfg: RunConfig) -> Heldout | MaskedHeldout:
    """The heldout evaluation of `entry` for a run of `cfg` (cfg.tokenizer.path: the run's tokenizer)."""
    if entry.scoring == "masked":
        return MaskedHeldout(entry, cfg)
    if entry.scoring == "causal":
        resolve_scoring(entry, cfg.model.arch, cfg)  # an encoder has no causal scores
    return Heldout(entry, cfg)
