"""`data.store: litdata`: the packed training blocks as litdata shards, for corpora that outgrow one node.

Why litdata (Lightning's optimize/stream library) and not an engine of our own: it writes chunked
shards with a pool of processes, reads them from a local path or an object store, assigns whole
chunks to ranks and DataLoader workers (disjoint, every block once per epoch), shuffles the chunk
order and the blocks inside each chunk by (seed, epoch), and resumes from a sample count by
arithmetic over the chunk intervals: the skipped blocks are never read. mosaicml-streaming, the
alternative, pins numpy<2.2 and transformers<5 (docs/data.md, "A sharded token store").

Writing: the train split's blocks are those of the token cache (prepare.py: same tokenizer, same
packing), copied into shards by `litdata.optimize` with one process per core. Each item is
{"index": block index in the cache, "tokens": the block}: the index keys the collator's generators
(collate.example_generators), so a block gets the same masks from either store. Each node writes
its own local store, under the cache's lock, into a temporary directory renamed into place when
complete (cache.py's rule): two nodes never write the same shard, and a store is never half there.

Reading: `StoreLoader` is litdata's StreamingDataLoader; the data module's (epoch, batches used)
is its state, as for the cache's sampler, and positions litdata's replay at the next batch.
litdata's epoch counter is ours + 1 (its loader counts epochs from 1). The same loader reads a
shared store (remote_store.py): a directory in place, or an s3:// URL through a local chunk cache
bounded by data.store_cache_limit (litdata's max_cache_size; it deletes chunks already read).

Resuming on another layout (ranks, nodes, DataLoader workers, batch): litdata cuts an epoch's
order for the layout that reads it, each rank taking whole chunks. Its elastic resume
(litdata/streaming/elastic.py) rebuilds the order the epoch began with as one stream, global
batch after global batch, drops the samples already trained and deals the rest onto the new
layout. A position of K batches on W ranks of B is the stream's first K x W x B samples, so the
new layout's optimizer steps hold the same blocks as the old one's would have: `start(...,
origin=layout the epoch began on)`. The epoch after it is cut for the new layout.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from litdata import StreamingDataLoader, StreamingDataset, optimize
from litdata.utilities.env import _DistributedEnv

from lit_transformer.data.batches.collate import example_generators
from lit_transformer.data.tokens import object_store
from lit_transformer.data.tokens.cache import CacheEntry, cache_key, reopen_entry
from lit_transformer.data.tokens.pack import START_METHOD, LMBlocks
from lit_transformer.errors import DataError

STORE_VERSION = 1  # bump when the item layout changes
# litdata's recommended chunk size: large enough that a read is one sequential request on an object
# store, small enough that a rank's share is many chunks and the chunk order shuffles usefully
CHUNK_BYTES = 64 << 20
SPAN_BLOCKS = 4096  # blocks per optimize input: the unit a writer process takes at a time


def store_path(root: Path, entry: CacheEntry, chunk_bytes: int = CHUNK_BYTES) -> Path:
    """Where the shards of `entry`'s blocks live: keyed by the cache entry (corpus, options, tokenizer)."""
    return Path(root) / "litdata" / cache_key("litdata", STORE_VERSION, entry.path.name, chunk_bytes)


def _emit(cache_path: str, span: tuple[int, int]):
    """Blocks [start, stop) of the cache entry at `cache_path` as store items (in a writer process)."""
    blocks = LMBlocks(reopen_entry(cache_path))
    for i in range(*span):
        yield {
            "index": i,
            "tokens": np.asarray(blocks.tokens[i * blocks.stride : i * blocks.stride + blocks.block_len]),
        }


def write_store(
    root: Path, entry: CacheEntry, *, num_proc: int | None = None, chunk_bytes: int = CHUNK_BYTES, build: bool = True
) -> tuple[Path, float, bool]:
    """(path, seconds, written now) of the store of `entry`'s blocks; an existing store is reused,
    a missing one is written (`build=False`: an error). num_proc: writer processes (data.num_proc);
    None: one per core this process may run on. Not pack.py's cap of 8: a writer copies blocks and
    the parent only waits, so nothing here stops scaling with the cores."""
    path = store_path(root, entry, chunk_bytes)
    if (path / "index.json").is_file():
        return path, 0.0, False
    if not build:
        raise DataError(f"no litdata store at {path}; run prepare_data (lit-transformer prepare) first")
    t0 = time.perf_counter()
    n = entry.meta["blocks"]
    spans = [(s, min(s + SPAN_BLOCKS, n)) for s in range(0, n, SPAN_BLOCKS)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=path.parent))
    try:
        with _isolated():
            optimize(
                fn=functools.partial(_emit, str(entry.path)),
                inputs=spans,
                output_dir=str(tmp),
                chunk_bytes=chunk_bytes,
                num_workers=max(1, min(num_proc or _cores(), len(spans))),
                reorder_files=False,
                verbose=False,
                # pack.py's choice (fork on Linux: the writers need no imports); litdata's default,
                # spawn, would re-import the caller's __main__ in every writer
                start_method=START_METHOD,
            )
        os.rename(tmp, path)  # atomic; fails when another process of a shared filesystem got there first
    except OSError:
        if not (path / "index.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path, time.perf_counter() - t0, True


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@contextlib.contextmanager
def _isolated():
    """Undo what `litdata.optimize` changes in the calling process: the global random states (it
    draws from them, so a run that writes its store would initialise other weights than one that
    reuses it), the process-wide multiprocessing start method (DataLoader workers use it) and the
    DATA_OPTIMIZER_* environment variables it sets."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    start_method = multiprocessing.get_start_method(allow_none=True)
    env = {k: v for k, v in os.environ.items() if k.startswith("DATA_OPTIMIZER_")}
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        multiprocessing.set_start_method(start_method, force=True)
        for k in [k for k in os.environ if k.startswith("DATA_OPTIMIZER_")]:
            os.environ.pop(k)
        os.environ.update(env)


class _Collate:
    """A batch of store items -> the objective's collator, its generators keyed by (seed, epoch, block index)."""

    def __init__(self, collator: Callable, seed: int):
        self.collator, self.seed, self.epoch = collator, seed, 0

    def __call__(self, items: list[dict]):
        indices = [int(item["index"]) for item in items]
        examples = [np.asarray(item["tokens"], dtype=np.int64) for item in items]
        return self.collator(examples, example_generators(self.seed, self.epoch, indices))


class StoreLoader(StreamingDataLoader):
    """Training batches from a store: this rank's chunks, shuffled by (seed, epoch), full batches only.

    With an `owner` (the data module), each iteration starts where the owner says (its
    `_begin_train_epoch`, then `_epoch` and `_consumed`) and the state is the owner's, as for
    data/modules/text_module.py's EpochLoader; without one, call `start(epoch, batches_done)` before iterating."""

    def __init__(
        self,
        path: Path,
        *,
        collator: Callable,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        num_nodes: int = 1,
        num_workers: int = 0,
        pin_memory: bool = False,
        owner=None,
        cache_dir: str | None = None,
        max_cache_size: str | None = None,
    ):
        remote = {}
        if object_store.is_url(str(path)):  # a shared store's s3:// URL: chunks cached locally, bounded
            remote = dict(cache_dir=cache_dir, max_cache_size=max_cache_size, storage_options=_s3_options())
        dataset = StreamingDataset(str(path), shuffle=shuffle, drop_last=True, seed=seed, **remote)
        # the rank as the trainer knows it, not as litdata would detect it (no process group in tests)
        dataset.distributed_env = _DistributedEnv(world_size, rank, num_nodes)
        self._collate = _Collate(collator, seed)
        super().__init__(
            dataset,
            batch_size=batch_size,
            num_workers=num_workers,
            collate_fn=self._collate,
            drop_last=True,
            pin_memory=pin_memory,
        )
        self._owner = owner
        self._done = False  # the epoch to start was already used up when the state was saved

    @property
    def layout(self) -> tuple[int, int, int, int]:
        """(ranks, nodes, DataLoader workers, batch): what litdata cuts an epoch's order for."""
        env = self.dataset.distributed_env
        return env.world_size, env.num_nodes, max(self.num_workers, 1), self.batch_size

    def start(self, epoch: int, batches_done: int, origin: tuple | None = None) -> None:
        """Make the next iteration yield `epoch`'s batches after the first `batches_done`; `origin`:
        the layout (`layout`) the epoch's order was cut for, when not this loader's."""
        self._collate.epoch = epoch
        elastic = batches_done > 0 and origin is not None and tuple(origin) != self.layout
        self.restore, self._done = False, not elastic and batches_done >= len(self)
        self.dataset.reset_state_dict()
        if batches_done == 0 or self._done:
            self.current_epoch = epoch  # litdata adds one as iteration starts
            return
        samples = batches_done * self.batch_size  # per rank: what litdata's replay counts
        self.dataset.current_epoch = epoch + 1
        dataset_state = self.dataset.state_dict(samples, self.num_workers, self.batch_size)
        if elastic:  # the origin's order as one stream, its first batches_done global batches dropped
            ranks, nodes, workers, batch = origin
            dataset_state.update(
                initial_world_size=ranks,
                initial_num_nodes=nodes,
                initial_num_workers=workers,
                initial_batch_size=batch,
                sample_in_epoch=samples * self.layout[0],
                num_samples_yielded=0,
                resume_mode="elastic",
            )
        state = {
            "dataset": dataset_state,
            "current_epoch": epoch + 1,
            "num_samples_yielded": 0 if elastic else samples,
            "latest_worker_idx": (batches_done - 1) % max(self.num_workers, 1),  # workers take batches in turn
        }
        StreamingDataLoader.load_state_dict(self, state)

    def __iter__(self):
        if self._owner is not None:
            self._owner._begin_train_epoch()
            self.start(self._owner._epoch, self._owner._consumed, self._owner._store_origin)
        if self._done:
            return iter(())
        return super().__iter__()

    def state_dict(self) -> dict:
        return self._owner.state_dict() if self._owner is not None else super().state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self._owner is not None:
            self._owner.load_state_dict(state)
        else:
            super().load_state_dict(state)


def _s3_options() -> dict:
    """litdata's boto3 options for a shared store: object_store's bounded retries and timeouts in
    place of its own 1000 attempts. litdata 0.2.76 also fetches chunks with obstore, built without
    allow_http: on an http:// endpoint (a local S3-compatible server such as MinIO or moto) every
    chunk GET then fails with "builder error", so such an endpoint gets allow_http here."""
    import litdata.streaming.downloader as downloader

    if str(object_store.s3_client().meta.endpoint_url).startswith("http://"):
        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"
    return {"config": object_store.s3_config()}
