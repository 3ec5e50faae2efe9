"""`TextDataModule`: one LightningDataModule for every objective.

- `prepare_data` (local rank 0): trains or loads the tokenizer and fills the token cache; with a
  shared store (data.store_dir, written beforehand by `prepare`) it only opens the store.
- `setup` (every rank): opens the cache by memory map; tokenizes nothing. Under a Trainer with
  several processes the ranks then compare fingerprints of what they read (`agree_on_data`):
  nodes build their own caches (no shared filesystem is assumed), and a node whose cache
  differs fails before the first step instead of training on other data.
- dataloaders yield collated batches; each example's collator generator is seeded by
  (seed, epoch, example index), so the masks depend neither on workers, nor on resuming, nor
  on how many ranks share the global batch (streaming: by (seed, epoch, rank, batch index)).
- `state_dict` holds (epoch, batches consumed in it) and the layout they were counted on (ranks,
  batch, accumulation); Lightning saves it in checkpoints and restores it before building
  dataloaders, and the sampler then skips exactly those batches: on another world size, the same
  prefix of the epoch (sampler.carry).
  Consumed batches are counted in `on_before_batch_transfer`, which Lightning calls once per
  training batch it actually uses (prefetched batches are not counted).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lit_transformer.data.batches.batch_warmup import WarmupBatchSampler
from lit_transformer.data.batches.block_warmup import cut_rows, warmup_row_length
from lit_transformer.data.batches.collate import example_generators
from lit_transformer.data.batches.collator_for import make_collator
from lit_transformer.data.batches.sampler import ResumableBatchSampler, TokenBatchSampler
from lit_transformer.data.data_config import (
    BLOCK_WARMUP_OBJECTIVES,
    LM_OBJECTIVES,
    DataConfig,
    TokenizerConfig,
    check_objective,
)
from lit_transformer.data.modules.streaming import STATE_KEY, StreamingBlocks, estimate_bytes_per_token
from lit_transformer.data.tokens import prepare
from lit_transformer.data.tokens.cache import cache_lock, cache_root
from lit_transformer.data.tokens.examples import RaggedExamples
from lit_transformer.data.tokens.pack import LMBlocks
from lit_transformer.data.tokens.prepare import Prepared, block_params, require_litdata, write_run_files
from lit_transformer.data.tokens.store_manifest import open_store
from lit_transformer.errors import DataError

# what a data state records of the layout it was counted on (sampler.carry): ranks, the sampler's
# batch, and micro-batches per optimizer step (resuming keeps the global batch: training/checkpoints.py)
LAYOUT_KEYS = ("world_size", "batch_size", "batch_tokens", "accumulate")


class _CollatedBatches(torch.utils.data.Dataset):
    """Map-style dataset whose keys are sampler batches: (epoch, batch index, example indices)."""

    def __init__(self, examples, collator: Callable, seed: int):
        self.examples, self.collator, self.seed = examples, collator, seed

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, key) -> dict:
        epoch, index, indices = key
        return self.collator([self.examples[i] for i in indices], example_generators(self.seed, epoch, indices))


class EpochLoader(DataLoader):
    """A DataLoader that asks its data module where to start (`_begin_train_epoch`) each time
    iteration starts (TextDataModule: the epoch and the batches already used in it).

    Its state is the data module's position, so Lightning also sees it as resumable (and does
    not warn that a mid-epoch resume is unreliable)."""

    def __init__(self, *args, owner: RankedDataModule, **kwargs):
        super().__init__(*args, **kwargs)
        self._owner = owner

    def __iter__(self):
        self._owner._begin_train_epoch()
        return super().__iter__()

    def state_dict(self) -> dict:
        return self._owner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._owner.load_state_dict(state)


def data_fingerprint(prepared: Prepared) -> str:
    """A short hash of what a process trains and validates on: its tokenizer, and per split the
    cache entry's key (corpus, recipe options and tokenizer) and the shapes of its arrays (a cache
    truncated or altered after it was written reads differently, under the same key)."""
    parts: list = [hashlib.sha256(prepared.tokenizer.to_str().encode()).hexdigest()]
    for split, entry in sorted(prepared.entries.items()):
        parts.append([split, entry.path.name, entry.meta["arrays"]])
    if prepared.store_key is not None:  # a shared store: its training shards are part of the data
        parts.append(prepared.store_key)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def agree_on_data(fingerprint: str, node: int, where: str) -> None:
    """Every rank of an initialised process group checks that all ranks read the same data (their
    `data_fingerprint`s); the first rank that differs from rank 0 is named, with its node and cache,
    in a one-line DataError that every rank raises, so that none is left waiting in a collective."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (fingerprint, node, where))
    first = seen[0]
    for rank, (other, other_node, other_where) in enumerate(seen):
        if other != first[0]:
            raise DataError(
                f"the token caches differ between nodes: rank 0 (node {first[1]}) reads data {first[0]} "
                f"from {first[2]}, rank {rank} (node {other_node}) reads data {other} from {other_where}; "
                "every node must prepare the same corpus with the same recipe (delete the differing "
                "cache directory and run again)"
            )


class RankedDataModule(L.LightningDataModule):
    """A data module's rank and world size: as given (`_rank`, `_world`), else the trainer's,
    else torch.distributed's when it is initialised, else a single process."""

    _rank: int | None = None
    _world: int | None = None

    @property
    def rank(self) -> int:
        if self._rank is not None:
            return self._rank
        if self.trainer is not None:
            return self.trainer.global_rank
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    def read_whole(self) -> None:
        """Read every row on every rank, as one process would (evaluations that run the same
        data on every rank); before setup."""
        self._rank, self._world = 0, 1

    @property
    def world_size(self) -> int:
        if self._world is not None:
            return self._world
        if self.trainer is not None:
            return self.trainer.world_size
        return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


class TextDataModule(RankedDataModule):
    def __init__(
        self,
        data: DataConfig,
        tokenizer: TokenizerConfig,
        objective: str,
        *,
        seed: int = 0,
        run_dir: str | None = None,
        model_vocab_size: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ):
        super().__init__()
        self.data, self.tokenizer_cfg, self.objective = data, tokenizer, check_objective(objective)
        if data.batch_tokens is not None and self.objective in LM_OBJECTIVES:
            raise DataError(
                f"data.batch_tokens is for seq2seq and classify; {objective!r} trains on packed blocks "
                "of data.block_size tokens: set data.batch_size"
            )
        if data.block_warmup_steps and self.objective not in BLOCK_WARMUP_OBJECTIVES:
            raise DataError(
                f"data.block_warmup_steps cuts packed blocks into shorter rows: it applies to objective in "
                f"{list(BLOCK_WARMUP_OBJECTIVES)}, not {objective!r} (set data.block_warmup_steps=0)"
            )
        self.seed, self.run_dir, self.model_vocab_size = seed, run_dir, model_vocab_size
        self._rank, self._world = rank, world_size
        self._prepared: Prepared | None = None
        self._datasets: dict = {}
        self._train_sampler: ResumableBatchSampler | None = None
        self._train_stream: StreamingBlocks | None = None
        self._stream_resume: dict | None = None  # streaming: the workers' positions of a loaded state
        self._epoch = 0  # epoch of the current (or next) training iteration
        self._consumed = 0  # training batches of that epoch used so far
        self._resume: tuple[int, int] | None = None
        self._saved_layout: dict | None = None  # the layout the resumed position was counted on
        self.carried: tuple[int, int] | None = None  # (saved, carried) batches of a resume on another layout
        self._next_epoch = 0  # without a trainer: epochs count iterations of the train loader
        self._stream_bytes_per_token: dict[str, float] = {}  # by split
        # data.store=litdata: the layout (store.StoreLoader.layout) the resumed epoch's order was cut
        # for, when it is not this run's; the store's loader, once built
        self._store_origin: tuple | None = None
        self._saved_order: tuple | None = None
        self._store = None

    # ------------------------------------------------------------------ Lightning hooks

    def prepare_data(self) -> None:
        with cache_lock(cache_root(self.data.cache_dir)):  # one process of the node tokenizes, the others wait
            prepared = self._open_or_build(build=True)
        if self.run_dir is not None:
            write_run_files(prepared, self.run_dir, self.data.task)
        self._prepared = prepared  # this process's setup needs nothing more

    def setup(self, stage: str | None = None) -> None:
        if self._prepared is None:
            # a single process may build what is missing; other ranks rely on prepare_data
            self._prepared = self._open_or_build(build=self.world_size == 1)
            if self.run_dir is not None and self.rank == 0 and not (Path(self.run_dir) / "tokenizer.json").exists():
                write_run_files(self._prepared, self.run_dir, self.data.task)
        self.collator = self._make_collator()
        for split, entry in self._prepared.entries.items():
            self._datasets[split] = LMBlocks(entry) if entry.meta["kind"] == "lm" else RaggedExamples(entry)
        if self.trainer is not None:  # Lightning's setup hook: the process group exists, every rank is here
            agree_on_data(self.fingerprint(), self.trainer.node_rank, str(cache_root(self.data.cache_dir)))

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", train=True)

    def val_dataloader(self):
        return self._loader("validation", train=False) if self._has_split("validation") else []

    def test_dataloader(self):
        return self._loader("test", train=False) if self._has_split("test") else []

    def generation_dataloader(self):
        """Validation batches whose texts prompt the sample generations ([] without a split)."""
        return self.val_dataloader()

    def state_dict(self) -> dict:
        # with the layout the position was counted on, so that a resume on other ranks carries it
        state = {"epoch": self._epoch, "batches": self._consumed, "seed": self.seed, **self._layout()}
        if self._train_stream is not None or self._stream_resume is not None:  # streaming: where each worker is
            state["stream"] = self._stream_resume or self._train_stream.state()
        if self._store is not None:  # the layout this epoch's order was cut for (store.py, "Resuming")
            state["store_order"] = list(self._store_origin or self._store.layout)
        return state

    def load_state_dict(self, state: dict) -> None:
        self._resume = (int(state["epoch"]), int(state["batches"]))
        self._epoch, self._consumed = self._resume
        self._next_epoch = self._resume[0]
        # checkpoints written before the layout was saved resume as on this layout
        self._saved_layout = {k: state[k] for k in LAYOUT_KEYS} if "world_size" in state else None
        self._stream_resume = state.get("stream")  # absent (older checkpoints): the stream skips batches
        self._saved_order = tuple(state["store_order"]) if "store_order" in state else None

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        if self.trainer is None or self.trainer.training:
            self._consumed += 1
        if isinstance(batch, dict) and STATE_KEY in batch:  # a training stream's position, not for the model
            self._train_stream.note(batch.pop(STATE_KEY))
        return batch

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        # sequence-length warmup: training batches only, by the optimizer step about to be taken
        if self.data.block_warmup_steps and self.trainer is not None and self.trainer.training:
            length = warmup_row_length(
                self.trainer.global_step,
                block_size=self.data.block_size,
                start=self.data.block_warmup_start,
                steps=self.data.block_warmup_steps,
            )
            batch = cut_rows(batch, length)
        return batch

    # ------------------------------------------------------------------ what training needs

    def fingerprint(self) -> str:
        """`data_fingerprint` of the prepared data (after setup)."""
        return data_fingerprint(self._ready())

    @property
    def tokenizer(self):
        return self._ready().tokenizer

    @property
    def special_tokens(self):
        return self._ready().special

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def label_names(self) -> list | None:
        return self._ready().label_names

    @property
    def num_labels(self) -> int | None:
        if self.objective != "classify":
            return None
        return 1 if self.data.task == "regression" else len(self.label_names or [])

    @property
    def bytes_per_token(self) -> float | None:
        """Validation UTF-8 bytes per token (separators included): bits/byte = loss / ln 2 / this."""
        return self.split_bytes_per_token("validation")

    def split_bytes_per_token(self, split: str) -> float | None:
        """UTF-8 bytes per token of `split` (validation or test); None without that split."""
        prepared = self._ready()
        entry = prepared.entries.get(split)
        if entry is not None:
            return entry.meta["bytes"] / entry.meta["tokens"]
        if split not in prepared.sources:
            return None
        if split not in self._stream_bytes_per_token:  # streaming: measure on the first ~1 MB
            self._stream_bytes_per_token[split] = estimate_bytes_per_token(
                prepared.sources[split], prepared.tokenizer, prepared.special.separator_id
            )
        return self._stream_bytes_per_token[split]

    # ------------------------------------------------------------------ internals

    def _ready(self) -> Prepared:
        if self._prepared is None:
            self.setup()
        return self._prepared

    def _open_or_build(self, *, build: bool) -> Prepared:
        """A shared store (data.store_dir), prepared beforehand and only read; else the cache, built
        where missing when `build`."""
        data, vocab = self.data, self.model_vocab_size
        if data.store == "litdata" and data.store_dir is not None:
            require_litdata()
            return open_store(data, self.tokenizer_cfg, self.objective, model_vocab_size=vocab)
        return prepare.build(data, self.tokenizer_cfg, self.objective, build=build, model_vocab_size=vocab)

    def _has_split(self, split: str) -> bool:
        return split in self._prepared.sources or split in self._prepared.entries

    def _make_collator(self) -> Callable:
        return make_collator(self.objective, self.data, self._prepared.tokenizer, self._prepared.special)

    def _begin_train_epoch(self) -> None:
        epoch = self.trainer.current_epoch if self.trainer is not None else self._next_epoch
        self._next_epoch = epoch + 1
        skip = self._resume[1] if self._resume is not None and self._resume[0] == epoch else 0
        self._store_origin = self._saved_store_order() if skip else None
        if self._train_sampler is not None:
            self._train_sampler.set_epoch(epoch)  # before _carry: a warmup sampler carries by epoch
        if self._resume is not None and self._saved_layout is not None:
            carried = self._carry(skip, epoch)
            if self._saved_layout != self._layout():  # training.checkpoints.ResumeCounters moves Lightning's count
                self.carried = (skip, carried)
            skip = carried
        self._resume, self._saved_layout = None, None
        self._epoch, self._consumed = epoch, skip
        if self._train_sampler is not None:
            self._train_sampler.resume(epoch, skip)
        if self._train_stream is not None:
            self._train_stream.set_epoch(epoch, skip, resume=self._stream_resume)
        self._stream_resume = None

    def _layout(self) -> dict:
        """How this run cuts its data into optimizer steps (LAYOUT_KEYS)."""
        accumulate = self.trainer.accumulate_grad_batches if self.trainer is not None else 1
        cfg = self.data
        return dict(
            world_size=self.world_size, batch_size=cfg.batch_size, batch_tokens=cfg.batch_tokens, accumulate=accumulate
        )

    def _carry(self, batches: int, epoch: int) -> int:
        """`batches` of `epoch` used per rank on the saved layout, as this layout's count (sampler.carry)."""
        saved, now, cfg = self._saved_layout, self._layout(), self.data
        keys = ("world_size", "batch_size", "batch_tokens")
        if batches == 0 or all(saved[k] == now[k] for k in keys):
            return batches
        where = (
            f"the checkpoint stopped after {batches} batches of epoch {epoch} on each of {saved['world_size']} "
            f"ranks (data.batch_size={saved['batch_size']}, data.batch_tokens={saved['batch_tokens']})"
        )
        if self._train_sampler is None and cfg.streaming:  # sharded by rank as read: no one order to skip in
            raise DataError(
                f"{where}: data.streaming=true resumes only on the layout it was saved with; set trainer.devices x "
                f"trainer.num_nodes = {saved['world_size']} and data.batch_size={saved['batch_size']}"
            )
        if self._train_sampler is None:  # the store: the saved order's first samples (store.py, "Resuming")
            done, step = batches * saved["batch_size"] * saved["world_size"], cfg.batch_size * self.world_size
            if done % step:
                raise DataError(
                    f"{where}: {done} blocks, not a whole number of global micro-batches of {step} blocks on "
                    f"{self.world_size} ranks; choose trainer.devices and data.batch_size so that it is"
                )
            return done // step
        if saved["batch_tokens"] != cfg.batch_tokens:
            raise DataError(
                f"{where}: data.batch_tokens cuts the batches, resume with data.batch_tokens={saved['batch_tokens']}"
            )
        unit = saved["batch_size"] if saved["batch_tokens"] is None else 1
        carried = self._train_sampler.carry(batches, saved["world_size"], unit)
        if carried is None:
            done, step = batches * unit * saved["world_size"], self._train_sampler.unit * self.world_size
            kind = "examples" if cfg.batch_tokens is None else "batches"
            raise DataError(
                f"{where}: {done} {kind}, not a whole number of global micro-batches of {step} {kind} on "
                f"{self.world_size} ranks; choose trainer.devices and data.batch_size so that it is"
            )
        return carried

    def _loader(self, split: str, *, train: bool) -> DataLoader:
        self._ready()
        cfg = self.data
        batch_size = cfg.batch_size if train else (cfg.eval_batch_size or cfg.batch_size)
        kwargs = dict(batch_size=None, num_workers=cfg.num_workers, pin_memory=torch.cuda.is_available())
        if train and cfg.store == "litdata":
            return self._store_loader(batch_size)
        if cfg.streaming:
            block_len, stride = block_params(self.objective, cfg)
            stream = StreamingBlocks(
                self._prepared.sources[split],
                self._prepared.tokenizer.to_str(),
                self._prepared.special.separator_id,
                block_len=block_len,
                stride=stride,
                batch_size=batch_size,
                collator=self.collator,
                seed=self.seed,
                rank=self.rank,
                world_size=self.world_size,
                shuffle=train and cfg.shuffle,
                shuffle_buffer=cfg.shuffle_buffer,
                drop_last=train,
                num_workers=cfg.num_workers,
                carry_state=train,
            )
            if not train:
                return DataLoader(stream, **kwargs)
            self._train_stream = stream
            return EpochLoader(stream, owner=self, **kwargs)
        examples = self._datasets[split]
        if train and cfg.batch_tokens is not None:  # RaggedExamples: __init__ refused packed LM blocks
            sampler = TokenBatchSampler(
                examples.lengths(),
                cfg.batch_tokens,
                seed=self.seed,
                shuffle=cfg.shuffle,
                rank=self.rank,
                world_size=self.world_size,
            )
        else:
            warmup = {}  # batch-size warmup: counted in micro-batches, as Lightning takes them
            if train and cfg.batch_warmup_steps:
                items = cfg.batch_warmup_steps * self._layout()["accumulate"]
                warmup = dict(warmup_items=items, start=cfg.batch_warmup_start)
            sampler = (WarmupBatchSampler if warmup else ResumableBatchSampler)(
                len(examples),
                batch_size,
                **warmup,
                seed=self.seed,
                shuffle=train and cfg.shuffle,
                drop_last=train,
                rank=self.rank,
                world_size=self.world_size,
            )
        dataset = _CollatedBatches(examples, self.collator, self.seed)
        if not train:
            return DataLoader(dataset, sampler=sampler, **kwargs)
        self._train_sampler = sampler
        return EpochLoader(dataset, sampler=sampler, owner=self, **kwargs)

    def _store_loader(self, batch_size: int) -> DataLoader:
        """data.store=litdata: training batches from the litdata shards (store.py); validation and
        test stay on the token cache, which every rank reads whole or in its own rows anyway."""
        from lit_transformer.data.tokens.store import StoreLoader  # litdata: an optional extra, checked by build

        self._store = StoreLoader(
            self._prepared.store,
            collator=self.collator,
            batch_size=batch_size,
            seed=self.seed,
            shuffle=self.data.shuffle,
            rank=self.rank,
            world_size=self.world_size,
            num_nodes=self.trainer.num_nodes if self.trainer is not None else 1,
            num_workers=self.data.num_workers,
            pin_memory=torch.cuda.is_available(),
            owner=self,
            cache_dir=self._chunk_cache(),
            max_cache_size=self.data.store_cache_limit,
        )
        return self._store

    def _chunk_cache(self) -> str | None:
        """This rank's own chunk cache (data.store_cache_limit): two ranks sharing one raced on litdata's index."""
        key = self._prepared.store_key
        return str(cache_root(self.data.cache_dir) / "stores" / key[:32] / "chunks" / f"r{self.rank}") if key else None

    def _saved_store_order(self) -> tuple | None:
        """The layout the resumed epoch's order was cut for (older checkpoints: as saved, nodes and workers as now)."""
        if self._saved_order is not None:
            return self._saved_order
        if self._saved_layout is None or self._store is None:
            return None
        _, nodes, workers, _ = self._store.layout
        return self._saved_layout["world_size"], nodes, workers, self._saved_layout["batch_size"]
