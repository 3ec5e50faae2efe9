"""Typed settings of the data pipeline: `DataConfig` and `TokenizerConfig`.

Both are plain dataclasses that `OmegaConf.structured` accepts (omegaconf 2.4 validates
`Literal` fields itself; `__post_init__` checks them again for direct construction). An
empty `train_files` (with no `hub_name` and no `source_files`) selects the embedded corpus
or task built from the Python standard library (see `stdlib.py`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args

from lit_transformer.errors import DataError, closest

Objective = Literal["mlm", "clm", "span", "seq2seq", "classify"]
OBJECTIVES = get_args(Objective)
LM_OBJECTIVES = ("mlm", "clm", "span")
BLOCK_WARMUP_OBJECTIVES = ("clm", "mlm")  # batches of packed (B, T) rows, one token per position (block_warmup.py)

Format = Literal["auto", "text", "jsonl", "json", "csv", "tsv", "parquet"]
TextFormat = Literal["lines", "paragraphs", "file"]
Task = Literal["single_label", "multi_label", "regression"]
TokenizerKind = Literal["bpe", "wordpiece", "unigram"]
Store = Literal["cache", "litdata"]
AUTO = "auto"  # a value resolved when the run starts (recipe/auto_rules.py)
SIZE = re.compile(r"^\d+(\.\d+)?\s*[kmgt]?b?$", re.IGNORECASE)  # what litdata's max_cache_size parses
CAPS = ("max_documents", "max_train_bytes", "max_val_bytes")
# object stores a shared store and its input files may live in (object_store.py): the one the tests
# exercise against a real server
URL_SCHEMES = ("s3",)


@dataclass
class DataConfig:
    # The keys that list a run's text files (files, globs or directories), and all the keys that
    # say where its text comes from and how much of it is read: a mixture task's `data` may
    # override them (recipe/tasks.py), a heldout evaluation replaces them (evaluation/heldout.py).
    FILE_KEYS: ClassVar[tuple[str, ...]] = (
        "train_files",
        "val_files",
        "test_files",
        "source_files",
        "target_files",
        "val_source_files",
        "val_target_files",
    )
    SOURCE_KEYS: ClassVar[tuple[str, ...]] = (*FILE_KEYS, "hub_name", *CAPS, "streaming", "num_workers")

    # Corpus: files, globs or directories. Empty everywhere: the embedded stdlib corpus/task.
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    # evaluated once training ends (test/... metrics) and by `evaluate --split test`
    test_files: list[str] = field(default_factory=list)
    format: Format = "auto"  # auto: from each file's extension (.txt, .jsonl, .csv, ...)
    # .txt: one document per non-blank line, per blank-line separated paragraph, or per file
    text_format: TextFormat = "paragraphs"
    text_column: str = "text"
    text_pair_column: str | None = None  # classify: second segment of a pair
    label_column: str = "label"
    source_column: str = "source"  # seq2seq from jsonl/csv/tsv/parquet
    target_column: str = "target"
    source_files: list[str] = field(default_factory=list)  # seq2seq from aligned text files
    target_files: list[str] = field(default_factory=list)
    val_source_files: list[str] = field(default_factory=list)
    val_target_files: list[str] = field(default_factory=list)
    hub_name: str | None = None  # a datasets hub name; needs network
    hub_config: str | None = None
    hub_train_split: str = "train"
    hub_val_split: str | None = "validation"
    task: Task = "single_label"  # classify only
    val_fraction: float = 0.02  # held out by a stable text hash when val_files is empty
    max_documents: int | None = None  # cap on training documents (tiny recipes)
    max_train_bytes: int | None = None  # cap on training UTF-8 bytes (tiny recipes)
    max_val_bytes: int | None = None
    max_line_bytes: int = 1 << 20  # a longer line is skipped and counted (corpus.py)
    streaming: bool = False  # tokenize and pack on the fly, no token cache (LM objectives)
    shuffle_buffer: int = 1024  # streaming: blocks held for shuffling
    # LM objectives: where packed training blocks are read from. cache: the memory-mapped token
    # cache, the fastest on one machine. litdata: the same blocks also written as litdata shards
    # (store.py), read with disjoint shards per rank and resumed without reading skipped blocks:
    # for corpora that outgrow one node (the optional `store` extra; docs/data.md)
    store: Store = "cache"
    # data.store=litdata: where the store lives. None: each node writes its own under the cache
    # directory, from its token cache. A directory shared by the nodes, or an s3:// URL: one store
    # that `prepare` writes once (in parts with --part i/N) and every node reads with no local
    # training cache (remote_store.py; docs/data.md, "A shared store")
    store_dir: str | None = None
    # a data.store_dir on an object store: the local chunk cache's bound, e.g. "50GB" (litdata's
    # max_cache_size: chunks already read are deleted). None: litdata's default, 75% of the free disk
    store_cache_limit: str | None = None
    block_size: int = 128  # LM objectives: tokens per example (span: encoder input length)
    max_length: int = 128  # classify / seq2seq source truncation
    max_target_length: int = 128  # seq2seq target truncation
    mlm_probability: float = 0.15  # BERT (Devlin et al. 2019, 3.1)
    mask_replace_prob: float = 0.8  # of the selected tokens: [MASK] ...
    random_replace_prob: float = 0.1  # ... a random token; the rest stay unchanged
    whole_word_mask: bool = False
    # mlm / clm on packed blocks: a token attends only within its own document, and positions
    # restart at each document start (the collator sends document_ids and position_ids)
    document_mask: bool = False
    # clm / mlm: sequence-length warmup (block_warmup.py). For the first block_warmup_steps
    # optimizer steps every packed block is cut into rows of block_warmup_start tokens, doubling
    # in equal stages up to block_size: a step keeps its tokens while the attention is cheaper and
    # the context shorter. 0: off. block_size / block_warmup_start must be a power of two
    block_warmup_steps: int = 0
    block_warmup_start: int = 32
    # batch-size warmup (batch_warmup.py): for the first batch_warmup_steps optimizer steps a
    # batch holds batch_warmup_start examples, doubling in equal stages up to batch_size, cut from
    # the same shuffled order (nothing skipped). 0: off. batch_size / batch_warmup_start must be a
    # power of two
    batch_warmup_steps: int = 0
    batch_warmup_start: int = 4
    noise_density: float = 0.15  # T5 span corruption (Raffel et al. 2020, 3.1.4)
    mean_span_length: float = 3.0
    batch_size: int | str = 32  # "auto": sized from the time budget when the run starts (recipe/auto_rules.py)
    # seq2seq / classify: batches of similar length holding at most this many tokens (examples x
    # the longest source or target) instead of batch_size examples (fairseq's --max-tokens)
    batch_tokens: int | None = None
    eval_batch_size: int | None = None  # None: batch_size
    shuffle: bool = True
    num_workers: int = 0
    # Processes that datasets uses to read jsonl/csv/parquet, and that tokenize-and-pack LM splits
    # (pack.py). None: datasets' default; packing is automatic: one process for the first 16 MB of
    # text, then min(available cores, 8). 1: one process. Never part of a cache key (same output).
    num_proc: int | None = None
    cache_dir: str | None = None  # None: $LIT_TRANSFORMER_CACHE or ~/.cache/lit_transformer

    def __post_init__(self):
        _check_choice("data.format", self.format, get_args(Format))
        _check_choice("data.text_format", self.text_format, get_args(TextFormat))
        _check_choice("data.task", self.task, get_args(Task))
        _check_choice("data.store", self.store, get_args(Store))
        if self.store_cache_limit is not None and not SIZE.match(str(self.store_cache_limit)):
            raise DataError(
                f"data.store_cache_limit={self.store_cache_limit!r} is not a size such as '50GB' or '500MB'"
            )
        if self.streaming and self.store != "cache":
            raise DataError(
                f"data.streaming=true reads no stored blocks; data.store={self.store!r} needs "
                "data.streaming=false (or leave data.store=cache)"
            )
        for name in ("block_size", "max_length", "max_target_length", "batch_size", "max_line_bytes", "shuffle_buffer"):
            _check_positive(f"data.{name}", getattr(self, name), auto=name == "batch_size")
        for name in (
            "max_documents",
            "max_train_bytes",
            "max_val_bytes",
            "eval_batch_size",
            "num_proc",
            "batch_tokens",
        ):
            if getattr(self, name) is not None:
                _check_positive(f"data.{name}", getattr(self, name))
        self._check_block_warmup()
        self._check_batch_warmup()
        if self.num_workers < 0:
            raise DataError(f"data.num_workers={self.num_workers} must be >= 0")
        for name in ("val_fraction", "mlm_probability", "mask_replace_prob", "random_replace_prob", "noise_density"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise DataError(f"data.{name}={value} must be in [0, 1)")
        if self.mask_replace_prob + self.random_replace_prob > 1.0:
            raise DataError(
                f"data.mask_replace_prob + data.random_replace_prob = "
                f"{self.mask_replace_prob + self.random_replace_prob} exceeds 1"
            )
        if self.mean_span_length < 1.0:
            raise DataError(f"data.mean_span_length={self.mean_span_length} must be >= 1")
        if len(self.source_files) != len(self.target_files):
            raise DataError(
                f"data.source_files has {len(self.source_files)} entries but data.target_files has "
                f"{len(self.target_files)}; they must pair up one to one"
            )
        if len(self.val_source_files) != len(self.val_target_files):
            raise DataError(
                f"data.val_source_files has {len(self.val_source_files)} entries but "
                f"data.val_target_files has {len(self.val_target_files)}"
            )

    def _check_block_warmup(self) -> None:
        steps, start = self.block_warmup_steps, self.block_warmup_start
        if not isinstance(steps, int) or steps < 0:
            raise DataError(f"data.block_warmup_steps={steps!r} must be an integer >= 0 (0: off)")
        _check_positive("data.block_warmup_start", start)
        if steps and not halved_down_to(self.block_size, start):
            raise DataError(
                f"data.block_warmup_start={start} must be data.block_size={self.block_size} divided by a "
                "power of two (2, 4, 8, ...): blocks are cut into rows of that length"
            )

    def _check_batch_warmup(self) -> None:
        steps, start = self.batch_warmup_steps, self.batch_warmup_start
        if not isinstance(steps, int) or steps < 0:
            raise DataError(f"data.batch_warmup_steps={steps!r} must be an integer >= 0 (0: off)")
        if not steps:
            return
        why = (
            "data.batch_tokens is set (token batches)"
            if self.batch_tokens is not None
            else "data.streaming=true"
            if self.streaming
            else f"data.store={self.store}"
            if self.store != "cache"
            else None
        )
        if why is not None:
            raise DataError(f"data.batch_warmup_steps cuts batches of data.batch_size examples; {why}")
        if self.batch_size != AUTO:
            check_batch_warmup(self.batch_size, start)


def check_store_dir(cfg: DataConfig) -> None:
    """The settings a shared store (data.store_dir) needs, each refusal one line. Checked when a
    recipe is read and again where the store is prepared or opened; not in __post_init__, since a
    copy of a run's data section made for another purpose (store=cache) may keep the key."""
    if cfg.store_dir is None:
        if cfg.store_cache_limit is not None:
            raise DataError(
                f"data.store_cache_limit={cfg.store_cache_limit!r} bounds the chunk cache of a data.store_dir "
                "on an object store; set data.store_dir or leave the limit unset"
            )
        return
    if cfg.store != "litdata":
        raise DataError(f"data.store_dir={cfg.store_dir!r} holds a litdata store: set data.store=litdata")
    scheme = cfg.store_dir.split("://", 1)[0].lower() if "://" in cfg.store_dir else None
    if scheme is not None and scheme not in URL_SCHEMES:
        raise DataError(
            f"data.store_dir={cfg.store_dir!r}: {scheme}:// is not supported; use a directory (local or shared) or "
            "an s3:// URL (AWS S3 or an S3-compatible server, with AWS_ENDPOINT_URL)"
        )
    if not cfg.train_files or cfg.hub_name:
        raise DataError(
            f"data.store_dir={cfg.store_dir!r} is prepared from data.train_files (files, globs, directories or "
            "s3:// URLs); the embedded corpus and data.hub_name are not read into one"
        )
    for key in CAPS:
        if getattr(cfg, key) is not None:
            raise DataError(
                f"data.{key}={getattr(cfg, key)} caps the corpus in file order, which a store prepared file by "
                f"file (and in parts) cannot apply: set data.{key}=null with data.store_dir"
            )


def halved_down_to(full: int, start: int) -> bool:
    """Whether `start` is `full` halved one or more times: full / start a power of two >= 2 (the
    warmups double their size in stages from start up to full)."""
    ratio = full // start
    return start < full and full % start == 0 and ratio & (ratio - 1) == 0


def check_batch_warmup(batch_size: int, start: int) -> None:
    """batch_size / start must be a power of two: warmup batches double up to the batch size."""
    if not (isinstance(start, int) and start > 0 and halved_down_to(batch_size, start)):
        raise DataError(
            f"data.batch_warmup_start={start} must be data.batch_size={batch_size} divided by a power of "
            "two (2, 4, 8, ...): warmup batches double up to the batch size"
        )


@dataclass
class TokenizerConfig:
    path: str | None = None  # an existing tokenizer.json; None: train one on the training split
    kind: TokenizerKind = "bpe"  # bpe: GPT-2 byte-level; wordpiece: BERT; unigram: T5
    vocab_size: int | str = 8000  # "auto": sized from the corpus when the run starts (recipe/auto_rules.py)
    min_frequency: int = 2
    num_sentinels: int = 100  # T5 <extra_id_0> ... <extra_id_99>
    lowercase: bool = False  # wordpiece and unigram normalisers
    max_train_bytes: int | None = None  # text fed to the tokenizer trainer
    # Extra special tokens added when a tokenizer is trained, e.g. UL2's mode tokens [NLU], [NLG],
    # [S2S] (Tay et al. 2022): each becomes one id and is never split or masked. A tokenizer loaded
    # from `path` must already hold them (the model's vocabulary is sized from that file).
    extra_special_tokens: list[str] = field(default_factory=list)

    def __post_init__(self):
        _check_choice("tokenizer.kind", self.kind, get_args(TokenizerKind))
        for token in self.extra_special_tokens:
            if not isinstance(token, str) or not token.strip() or token.strip() != token:
                raise DataError(
                    f"tokenizer.extra_special_tokens: {token!r} must be a non-empty string without surrounding spaces"
                )
            if self.extra_special_tokens.count(token) > 1:
                raise DataError(f"tokenizer.extra_special_tokens: {token!r} is listed twice")
        _check_positive("tokenizer.vocab_size", self.vocab_size, auto=True)
        _check_positive("tokenizer.min_frequency", self.min_frequency)
        if self.num_sentinels < 0:
            raise DataError(f"tokenizer.num_sentinels={self.num_sentinels} must be >= 0")
        if self.max_train_bytes is not None:
            _check_positive("tokenizer.max_train_bytes", self.max_train_bytes)


def check_objective(objective: str) -> str:
    _check_choice("objective", objective, OBJECTIVES)
    return objective


def from_dict(cls, values: Mapping[str, Any], prefix: str):
    """Build `cls` from a mapping; an unknown key is an error naming it and the closest key."""
    names = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in names:
            raise DataError(f"unknown key {prefix}.{key}{closest(key, names)}")
    return cls(**values)


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise DataError(f"{name}={value!r} is not one of {list(allowed)}{closest(str(value), allowed)}")


def _check_positive(name: str, value, *, auto: bool = False) -> None:
    """A positive integer (or, with `auto`, the string "auto")."""
    if auto and value == AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise DataError(f"{name}={value!r} must be a positive integer" + (" or 'auto'" if auto else ""))
