"""The recipe's `eval` section: named evaluations run during training and by `evaluate`.

One flat dataclass for every kind (as TaskConfig is for every objective of a mixture): an
entry sets the keys its kind reads, and `__post_init__` refuses, in one line naming the
entry, a key that another kind reads or a required key left out. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from omegaconf import MISSING

from lit_transformer.errors import RecipeError, closest
from lit_transformer.recipe.entries import build_entry, list_entries

# heldout: loss / perplexity / bits per byte on a named text set; classify: a probe on a labelled
# train and dev file; choice: zero-shot multiple choice by log-likelihood (the lm-evaluation-
# harness's acc and acc_norm); pairs: minimal pairs (BLiMP), the good sentence more likely than the
# bad one; translate: BLEU and chrF of decoded source sentences
EvalKind = Literal["heldout", "classify", "choice", "pairs", "translate"]
EVAL_KINDS = typing.get_args(EvalKind)
# how choice, pairs and heldout score text: causal (next-token log-probabilities) or masked
# (pseudo-log-likelihood, evaluation/masked_scoring.py); null: the model's natural one
Scoring = Literal["causal", "masked"]
SCORINGS = typing.get_args(Scoring)
# heldout, translate: the run's own split instead of files (what training logged as val/ or test/)
Split = Literal["validation", "test"]
SPLITS = typing.get_args(Split)
# linear: frozen backbone features, pooled as finetune pools, then logistic regression;
# finetune: a copy of the backbone fine-tuned with a fresh head for `steps` steps
ProbeMode = Literal["linear", "finetune"]
# data sets built from the Python standard library, so the tiny recipes evaluate out of the box:
# stdlib_text (heldout: the embedded corpus's validation files), docstring_package (classify: the
# embedded 8-package docstring task), docstring_function (choice: which of four function names
# goes with a docstring), next_line (choice: which of four lines continues a function)
Embedded = Literal["stdlib_text", "docstring_package", "docstring_function", "next_line"]
EMBEDDED_KIND = {
    "stdlib_text": "heldout",
    "docstring_package": "classify",
    "docstring_function": "choice",
    "next_line": "choice",
}

# the keys each kind reads besides name, kind, every_n_steps, max_examples and embedded
KIND_KEYS = {
    "heldout": ("files", "target_files", "split", "task", "format", "text_format", "text_column", "scoring"),
    "classify": (
        "files",
        "train_files",
        "format",
        "text_column",
        "text_pair_column",
        "label_column",
        "mode",
        "steps",
        "lr",
        "pooling",
        "mode_token",
    ),
    "choice": ("files", "mode_token", "scoring"),
    "pairs": ("files", "good_column", "bad_column", "group_column", "mode_token", "scoring"),
    "translate": ("files", "target_files", "split", "num_beams", "length_penalty", "max_new_tokens", "mode_token"),
}
COMMON_KEYS = ("name", "kind", "every_n_steps", "max_examples", "embedded")


@dataclass
class EvalConfig:
    name: str = MISSING  # logged as eval/<name>/<metric>; unique within the section
    kind: EvalKind = MISSING
    # run at every validation whose step is a multiple of this (null: every validation) and at the end
    every_n_steps: int | None = None
    max_examples: int | None = None  # the first N examples (rows, sentences, documents); null: all
    embedded: Embedded | None = None  # a built-in set instead of files (its kind must match)
    split: Split | None = None  # heldout, translate: the run's own split instead of files
    task: str | None = None  # heldout of a mixture: only this task, under the single objective's names
    # heldout: text files or globs (any format data reads); classify: the labelled dev file(s);
    # choice: jsonl rows {context, choices, label}; pairs: jsonl rows of a good and a bad sentence
    # (BLiMP's files); translate: source sentences, one per line
    files: list[str] = field(default_factory=list)
    train_files: list[str] = field(default_factory=list)  # classify: the probe's labelled training file(s)
    # translate (and heldout of a seq2seq run): reference sentences aligned line by line with files
    target_files: list[str] = field(default_factory=list)
    # how the files read, as the data section's keys of the same names (null: the run's data section's value)
    format: str | None = None
    text_format: str | None = None
    text_column: str | None = None
    text_pair_column: str | None = None
    label_column: str | None = None
    mode: ProbeMode = "linear"  # classify
    steps: int = 100  # classify, mode finetune: optimizer steps of the probe's fine-tuning
    lr: float = 1e-4  # classify, mode finetune: AdamW learning rate (the head gets 10x)
    pooling: str | None = None  # classify: first | mean | last; null: finetune's default for the architecture
    # translate: null takes the recipe's objective.num_beams / objective.length_penalty / data.max_target_length
    num_beams: int | None = None
    length_penalty: float | None = None
    max_new_tokens: int | None = None
    # pairs: the columns of a row's good and bad sentence (BLiMP's names), and of its group (BLiMP's
    # UID: accuracy per group, and the mean over groups as BLiMP reports it); null: no groups
    good_column: str = "sentence_good"
    bad_column: str = "sentence_bad"
    group_column: str | None = None
    # choice, pairs, heldout: causal or masked (pseudo-log-likelihood); null: an encoder masked, a decoder
    # and an encoder-decoder causal (heldout: the objective's own metrics)
    scoring: Scoring | None = None
    # classify, choice, pairs, translate: a special token of the run's tokenizer (a UL2 mixture's [NLU],
    # [NLG], [S2S]) put before every input where the mixture's TaskCollator puts it, so a model that
    # always read one is evaluated as it trained. heldout reads none: its rows go through the
    # objective's own collators, which put each task's token already
    mode_token: str | None = None

    def __post_init__(self):
        where = f"eval.{self.name}"
        if self.kind not in EVAL_KINDS:
            raise RecipeError(
                f"{where}.kind={self.kind!r} is not one of {list(EVAL_KINDS)}{closest(self.kind, EVAL_KINDS)}"
            )
        for f in dataclasses.fields(self):
            if f.name in COMMON_KEYS or f.name in KIND_KEYS[self.kind]:
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            if getattr(self, f.name) != default:
                users = [k for k, keys in KIND_KEYS.items() if f.name in keys]
                raise RecipeError(
                    f"{where}.{f.name}: a {self.kind} evaluation does not read {f.name} (it is for {', '.join(users)})"
                )
        if self.split is not None:
            if self.split not in SPLITS:
                raise RecipeError(f"{where}.split={self.split!r} is not one of {list(SPLITS)}")
            if self.embedded is not None or self.files or self.target_files:
                raise RecipeError(f"{where}: split={self.split!r} reads the run's own data; it takes no files")
        elif self.embedded is not None:
            need_kind = EMBEDDED_KIND[self.embedded]
            if need_kind != self.kind:
                raise RecipeError(f"{where}.embedded={self.embedded!r} is a {need_kind} set, not {self.kind}")
            if self.files or self.train_files or self.target_files:
                raise RecipeError(f"{where}: embedded={self.embedded!r} and files are both set: name one")
        elif not self.files:
            other = ["embedded: a built-in set"] if self.kind in EMBEDDED_KIND.values() else []
            other += ["split: the run's own"] if "split" in KIND_KEYS[self.kind] else []
            alternatives = f" (or {' or '.join(other)})" if other else ""
            raise RecipeError(f"{where}: a {self.kind} evaluation needs files{alternatives}")
        if self.embedded is None and "train_files" in KIND_KEYS[self.kind] and not self.train_files:
            raise RecipeError(f"{where}.train_files: a {self.kind} probe needs labelled training files")
        if self.kind == "heldout" and self.target_files and len(self.target_files) != len(self.files):
            raise RecipeError(
                f"{where}.target_files: {len(self.target_files)} file(s) for {len(self.files)} source file(s); "
                "aligned pairs need one reference file per source file"
            )
        if self.kind == "translate" and self.files and len(self.target_files) != len(self.files):
            raise RecipeError(
                f"{where}.target_files: {len(self.target_files)} file(s) for {len(self.files)} source file(s); "
                "each source file needs its aligned reference file"
            )
        for key in ("every_n_steps", "max_examples", "steps", "num_beams", "max_new_tokens"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise RecipeError(f"{where}.{key}={value!r} must be a positive integer")
        if self.lr <= 0:
            raise RecipeError(f"{where}.lr={self.lr!r} must be positive")
        if self.mode_token is not None and (not isinstance(self.mode_token, str) or not self.mode_token.strip()):
            raise RecipeError(f"{where}.mode_token={self.mode_token!r} must be a token, e.g. [NLU]")
        if self.scoring is not None and self.scoring not in SCORINGS:
            raise RecipeError(f"{where}.scoring={self.scoring!r} is not one of {list(SCORINGS)}")
        columns = {"good_column": self.good_column, "bad_column": self.bad_column, "group_column": self.group_column}
        for key, value in columns.items():
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise RecipeError(f"{where}.{key}={value!r} must be a column name")
        if self.good_column == self.bad_column:
            raise RecipeError(f"{where}: good_column and bad_column are both {self.good_column!r}; name two columns")
        if self.pooling is not None and self.pooling not in ("first", "mean", "last"):
            raise RecipeError(f"{where}.pooling={self.pooling!r} is not one of first, mean, last")


# ----------------------------------------------------------------------------- reading a section

# the keys of an entry that hold lists of files: a single name means a list of one
FILE_KEYS = ("files", "train_files", "target_files")


def eval_entries(entries: Any, source: str) -> list[EvalConfig]:
    """The EvalConfigs of an `eval:` list read from `source` (a recipe, a suite file), each
    entry checked alone so that a one-line RecipeError names the file, the entry
    (`eval[i] (name)`) and the key (OmegaConf names a key inside a list without its index).
    Names are unique: they prefix the metrics. A single file name becomes a list of one, in place."""
    if entries is None:
        return []
    out: list[EvalConfig] = []
    keys = [f.name for f in dataclasses.fields(EvalConfig)]
    example, what = "[{name: held, kind: heldout}]", "an evaluation is a mapping with name and kind"
    for where, entry in list_entries(entries, source, "eval", example, what):
        for key in FILE_KEYS:
            if isinstance(entry.get(key), str):
                entry[key] = [entry[key]]
        # EvalConfig's own checks name `eval.<name>.<key>`; `where` names the entry already
        out.append(build_entry(EvalConfig, entry, source, where, keys, named=f"eval.{entry.get('name')}"))
    names = [e.name for e in out]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise RecipeError(
                f"{source}: eval[{index}] ({name}): the name {name!r} is also eval[{names.index(name)}]'s; "
                "names must be unique (metrics are logged as eval/<name>/...)"
            )
    return out
