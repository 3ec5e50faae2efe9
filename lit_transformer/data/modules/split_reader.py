"""One split of a run's data as evaluation batches, without the training pipeline.

`read_split(plan, split)` tokenises and packs that split alone, through the token cache (a split
training read already is opened, not tokenised again), and collates it as training's validation
loader does: the same rows in the same order, the same collator, the same per-example generators
(seed, epoch 0, row index), so an evaluation computes the numbers training logged. The training
split is never read, and a node-local litdata store is never opened (only the training split lives
in one); a shared store (data.store_dir) holds the evaluation splits too, and they are read from it.
A streaming run's split is streamed, as training streamed it.

The readers answer what an objective asks of its data when it evaluates (`evaluation_streams`,
`measure_bytes_on`): the split's batches from val_dataloader() or test_dataloader() (the other
split's: []), its bytes per token, and a mixture's tasks that hold the split.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from itertools import islice

from torch.utils.data import DataLoader

from lit_transformer.data.batches.collate import example_generators
from lit_transformer.data.batches.collator_for import make_collator
from lit_transformer.data.batches.prefix import task_collator
from lit_transformer.data.batches.sampler import ResumableBatchSampler
from lit_transformer.data.data_config import DataConfig, TokenizerConfig
from lit_transformer.data.data_plan import DataPlan
from lit_transformer.data.modules.streaming import StreamingBlocks, estimate_bytes_per_token
from lit_transformer.data.sources.corpus import build_sources
from lit_transformer.data.tokens.examples import RaggedExamples
from lit_transformer.data.tokens.pack import LMBlocks
from lit_transformer.data.tokens.prepare import (
    Prepared,
    block_params,
    resolve_tokenizer,
    split_entry,
    tokenizer_for_data,
)
from lit_transformer.data.tokens.store_manifest import open_split
from lit_transformer.data.tokens.tokenizer import (
    SpecialTokens,
    check_extra_special_tokens,
    load_tokenizer,
)
from lit_transformer.errors import DataError

SPLITS = ("validation", "test")


class SplitReader:
    """`split` of one data kind's data. `label_names`: a classification split's labels in the
    model's order (its key in the cache is training's); None numbers the labels the split holds.
    `max_examples`: the first rows, in whole batches of data.eval_batch_size (else batch_size)."""

    def __init__(
        self,
        data: DataConfig,
        tokenizer: TokenizerConfig,
        kind: str,
        split: str,
        *,
        seed: int = 0,
        label_names: list | None = None,
        max_examples: int | None = None,
    ):
        if split not in SPLITS:
            raise DataError(f"split {split!r} is not one of {list(SPLITS)}")
        if tokenizer.path is None:
            raise DataError(f"reading the {split} split needs the run's tokenizer: tokenizer.path is not set")
        shared = data.store == "litdata" and data.store_dir is not None  # its files may be on no disk here
        self.data = dataclasses.replace(data, store="cache", num_workers=0)  # the store holds training's blocks
        self.kind, self.split, self.seed = kind, split, seed
        sources = {} if shared else build_sources(self.data, kind)  # reads nothing until iterated
        self.source = sources.get(split)
        if shared:
            tok, tok_hash = load_tokenizer(tokenizer.path), None
        else:
            tok, _, tok_hash = resolve_tokenizer(self.data, tokenizer, sources, build=False)
        cfg = self.data
        special = tokenizer_for_data(tok, kind, None, cfg)
        self.prepared = Prepared(
            kind, tok, special, {split: self.source} if self.source else {}, label_names=label_names
        )
        self.collator = make_collator(kind, cfg, tok, special)
        self.rows = cfg.eval_batch_size or cfg.batch_size
        self.max_batches = None if max_examples is None else math.ceil(max_examples / self.rows)
        self._examples = None
        self._bytes_per_token: float | None = None
        entry = open_split(data, split, tokenizer.path) if shared else None
        if entry is None and self.source is not None and not cfg.streaming:
            entry, _ = split_entry(self.source, kind, cfg, self.prepared, tok_hash, build=True)
        if entry is not None:
            self._examples = LMBlocks(entry) if entry.meta["kind"] == "lm" else RaggedExamples(entry)
            self._bytes_per_token = entry.meta["bytes"] / entry.meta["tokens"]
            if kind == "classify" and label_names is None:
                self.prepared.label_names = entry.meta["label_names"]

    @property
    def has_split(self) -> bool:
        return self.source is not None or self._examples is not None

    @property
    def tokenizer(self):
        return self.prepared.tokenizer

    @property
    def special_tokens(self) -> SpecialTokens:
        return self.prepared.special

    @property
    def label_names(self) -> list | None:
        return self.prepared.label_names

    def batches(self) -> Iterator[dict]:
        """The split's collated batches, the first max_batches of them."""
        return islice(self._stream() if self.data.streaming else self._rows(), self.max_batches)

    def val_dataloader(self):
        return self.batches() if self.split == "validation" and self.has_split else []

    def test_dataloader(self):
        return self.batches() if self.split == "test" and self.has_split else []

    def split_bytes_per_token(self, split: str) -> float | None:
        """UTF-8 bytes per token of the split (streaming: of its first ~1 MB); None for another."""
        if split != self.split or not self.has_split:
            return None
        if self._bytes_per_token is None:
            self._bytes_per_token = estimate_bytes_per_token(
                self.source, self.tokenizer, self.special_tokens.separator_id
            )
        return self._bytes_per_token

    def _rows(self) -> Iterator[dict]:
        # the sampler of training's validation loader on one process: epoch 0, in order, the last batch short
        sampler = ResumableBatchSampler(len(self._examples), self.rows, seed=self.seed, shuffle=False, drop_last=False)
        for epoch, _, indices in sampler:
            rows = [self._examples[i] for i in indices]
            yield self.collator(rows, example_generators(self.seed, epoch, indices))

    def _stream(self) -> Iterator[dict]:
        block_len, stride = block_params(self.kind, self.data)
        stream = StreamingBlocks(
            self.source,
            self.tokenizer.to_str(),
            self.special_tokens.separator_id,
            block_len=block_len,
            stride=stride,
            batch_size=self.rows,
            collator=self.collator,
            seed=self.seed,
            rank=0,
            world_size=1,
            shuffle=False,
            shuffle_buffer=self.data.shuffle_buffer,
            drop_last=False,
        )
        return iter(DataLoader(stream, batch_size=None))


class MixtureSplitReader:
    """`split` of every task of a mixture that has one: task t's reader is seeded seed + t and
    collates as the mixture's task t (prefix.task_collator: its prefix or mntp collator, its mode
    token in front)."""

    def __init__(self, plan: DataPlan, split: str, *, max_examples: int | None = None):
        arch = plan.mixture.arch
        self.split = split
        self.readers: list[SplitReader] = []
        for t, task in enumerate(plan.tasks):
            reader = SplitReader(
                task.data, plan.tokenizer, task.pipeline, split, seed=plan.seed + t, max_examples=max_examples
            )
            modes = check_extra_special_tokens(
                reader.tokenizer, plan.tokenizer.extra_special_tokens, plan.tokenizer.path
            )
            reader.collator = task_collator(
                task,
                t,
                arch=arch,
                base=reader.collator,
                special=reader.special_tokens,
                vocab_size=reader.tokenizer.get_vocab_size(with_added_tokens=True),
                mode_token_id=modes[task.mode_token] if task.mode_token is not None else None,
            )
            self.readers.append(reader)

    @property
    def has_split(self) -> bool:
        return any(r.has_split for r in self.readers)

    @property
    def label_names(self) -> None:
        return None

    @property
    def val_tasks(self) -> list[int]:
        return [t for t, r in enumerate(self.readers) if r.has_split] if self.split == "validation" else []

    @property
    def test_tasks(self) -> list[int]:
        return [t for t, r in enumerate(self.readers) if r.has_split] if self.split == "test" else []

    def val_dataloader(self) -> list:
        return [self.readers[t].batches() for t in self.val_tasks]

    def test_dataloader(self) -> list:
        return [self.readers[t].batches() for t in self.test_tasks]

    def bytes_per_token_of(self, t: int, split: str = "validation") -> float | None:
        return self.readers[t].split_bytes_per_token(split)


def read_split(
    plan: DataPlan, split: str, *, label_names: list | None = None, max_examples: int | None = None
) -> SplitReader | MixtureSplitReader:
    """`split` (validation or test) of the data `plan` describes, its tokenizer at plan.tokenizer.path."""
    if plan.mixture is not None:
        return MixtureSplitReader(plan, split, max_examples=max_examples)
    return SplitReader(
        plan.data,
        plan.tokenizer,
        plan.kind,
        split,
        seed=plan.seed,
        label_names=label_names,
        max_examples=max_examples,
    )
