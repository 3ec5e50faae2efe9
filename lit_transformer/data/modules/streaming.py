"""Streaming mode (`data.streaming: true`): read, tokenize, pack and collate on the fly.

For corpora too large to preprocess. Memory stays flat: files are read lazily (1 MiB chunks,
one document at a time), tokenized in ~1 MB text batches, packed through a buffer of at most one
text batch of tokens plus one block, and shuffled within windows of `data.shuffle_buffer` blocks.

Sharding: document i goes to shard i mod (world_size * num_workers), so ranks and dataloader
workers tokenize disjoint documents. A DataLoader interleaves its workers' batches round-robin,
so worker w numbers its batches w, w + num_workers, ...: the collator seed uses that global
batch index. Ranks can end an epoch a batch apart; with DDP, bound training by `max_steps` (or
`limit_train_batches`).

Shuffling: a worker cuts its blocks into windows of `shuffle_buffer` blocks and emits each
window permuted by rng(seed, epoch, shard, window index).

Resuming without re-reading: a worker's position after a batch is small: the index of its
window, the checkpoint of the window's first block (the source position before the text batch
that holds it, `SplitSource.position`; the packer's leftover tokens before that batch, fewer
than one block; the block's index in it), how many of the window's blocks are in batches, and
the worker's batch count. Training batches carry it under `STATE_KEY`; the data module pops it
before the batch reaches the model (`note`), and `state()` goes into checkpoints (every rank's,
gathered). `set_epoch(..., resume=state)` restarts each worker at its window: the source seeks
there and the worker re-reads at most one text batch and one window, however far the run had
gone. A checkpoint without a stream state (older runs) resumes by dropping the batches before
the position (`skip_batches`), in time proportional to it.

Roles: after a resume the DataLoader starts again at worker 0, while the next batch of the
uninterrupted run came from the worker after the last one used. So worker w plays role
(w + rotation) mod num_workers, where rotation is that next worker: roles, not worker ids,
decide shards, seeds and positions, and the batches come in the uninterrupted order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from lit_transformer.data.batches.collate import batch_generator
from lit_transformer.data.sources.corpus import SplitSource
from lit_transformer.data.sources.files import ReadStats
from lit_transformer.data.tokens.pack import BATCH_BYTES, BATCH_DOCS, batch_encoder, encode_documents, fast_copy
from lit_transformer.data.tokens.tokenizer import tokenizer_from_str
from lit_transformer.errors import DataError

STATE_KEY = "stream_state"  # the batch entry that carries its worker's position (never reaches the model)


def block_count(n_tokens: int, block_len: int, stride: int) -> int:
    """Full windows (block_len, stride) in n_tokens tokens."""
    return (n_tokens - block_len) // stride + 1 if n_tokens >= block_len else 0


def pack_stream(chunks: Iterable[tuple[np.ndarray, np.ndarray]], block_len: int, stride: int) -> Iterator[np.ndarray]:
    """Fixed windows (block_len, stride) of a token stream arriving in chunks."""
    buf = np.empty(0, dtype=np.int64)
    for flat, _ in chunks:
        buf = np.concatenate([buf, flat])
        n = block_count(len(buf), block_len, stride)
        for i in range(n):
            yield buf[i * stride : i * stride + block_len].copy()
        buf = buf[n * stride :]


class StreamingBlocks(torch.utils.data.IterableDataset):
    """Collated batches of packed blocks from a lazily read split."""

    def __init__(
        self,
        source: SplitSource,
        tokenizer_json: str,
        separator_id: int,
        *,
        block_len: int,
        stride: int,
        batch_size: int,
        collator: Callable,
        seed: int,
        rank: int,
        world_size: int,
        shuffle: bool,
        shuffle_buffer: int,
        drop_last: bool,
        num_workers: int = 0,
        carry_state: bool = False,
    ):
        super().__init__()
        self.source, self.tokenizer_json, self.separator_id = source, tokenizer_json, separator_id
        self.block_len, self.stride, self.batch_size = block_len, stride, batch_size
        self.collator, self.seed, self.rank, self.world_size = collator, seed, rank, world_size
        self.shuffle, self.shuffle_buffer, self.drop_last = shuffle, max(shuffle_buffer, 1), drop_last
        self.roles = max(num_workers, 1)  # the DataLoader's workers (0: the main process, one role)
        self.carry_state = carry_state  # training: batches carry their worker's position
        self.set_epoch(0)

    # ------------------------------------------------------------------ main process: positions

    def set_epoch(self, epoch: int, skip_batches: int = 0, resume: dict | None = None) -> None:
        """Start `epoch` at its beginning, after `skip_batches` batches (dropped: time grows with
        them), or where `resume` (a `state()` of this epoch) says, without re-reading."""
        self.epoch, self.skip_batches = epoch, skip_batches
        self._latest: list = [None] * self.roles  # per role: its position after the last batch used
        self._next = 0  # the role whose batch the DataLoader yields next
        mine = self._resume_state(resume) if resume is not None else None
        if mine is not None and mine["epoch"] == epoch:
            self._latest, self._next, self.skip_batches = list(mine["roles"]), mine["next"], 0
        self._start, self._rotation = list(self._latest), self._next  # what this epoch's workers start from

    def note(self, state: dict) -> None:
        """A training batch with this position was used."""
        self._latest[state["role"]] = state
        self._next = (state["role"] + 1) % self.roles

    def state(self) -> dict:
        """Every worker's position after the batches used (every rank's: a collective under DDP)."""
        mine = {"epoch": self.epoch, "next": self._next, "roles": list(self._latest)}
        ranks = [mine]
        dist = torch.distributed
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        return {"world_size": self.world_size, "workers": self.roles, "ranks": ranks}

    def _resume_state(self, resume: dict) -> dict:
        if (resume["world_size"], resume["workers"]) != (self.world_size, self.roles):
            raise DataError(
                f"data.streaming: the checkpoint's stream positions are for {resume['world_size']} process(es) "
                f"x {resume['workers']} worker(s), this run has {self.world_size} x {self.roles}; resume with "
                "the same world size and data.num_workers"
            )
        return resume["ranks"][self.rank]

    # ------------------------------------------------------------------ workers: batches

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        role = (worker + self._rotation) % workers
        start = self._start[role] if role < len(self._start) else None
        shard, shards = self.rank * workers + role, self.world_size * workers
        blocks = self._blocks(shard, shards, start["window_start"] if start else None)
        window, taken, local = (start["window"], start["taken"], start["local"]) if start else (0, 0, 0)
        batch: list = []
        while pairs := list(itertools.islice(blocks, self.shuffle_buffer)):
            rng = np.random.default_rng([self.seed, self.epoch, shard, window])
            order = rng.permutation(len(pairs)) if self.shuffle else range(len(pairs))
            checkpoint, first = pairs[0][1]
            for j in range(taken, len(pairs)):
                batch.append(pairs[order[j]][0])
                if len(batch) == self.batch_size:
                    state = {
                        "role": role,
                        "local": local + 1,
                        "window": window,
                        "taken": j + 1,
                        "window_start": {**checkpoint, "skip": first},
                    }
                    yield from self._emit(batch, local, role, workers, state)
                    local += 1
                    batch = []
            window, taken = window + 1, 0
        if batch and not self.drop_last:
            yield from self._emit(batch, local, role, workers, None)

    def _blocks(self, shard: int, shards: int, start: dict | None) -> Iterator[tuple[np.ndarray, tuple]]:
        """This shard's blocks, each with (checkpoint, i): `_blocks(checkpoint + {"skip": i})`
        yields that block first. A checkpoint is the source position before a text batch and
        the packer's leftover tokens before it."""
        stats = ReadStats()
        src = start["source"] if start else None
        docs = self.source.iterate(stats, src)
        index = src["index"] if src else 0  # documents the source has yielded, every shard's
        carry = np.asarray(start["carry"] if start else [], dtype=np.int64)
        skip = start["skip"] if start else 0
        encode = batch_encoder(fast_copy(tokenizer_from_str(self.tokenizer_json)), self.separator_id)
        length, stride = self.block_len, self.stride
        while True:
            checkpoint = {"source": {**SplitSource.position(stats), "index": index}, "carry": carry.tolist()}
            group, size = [], 0  # one text batch, cut as `text_batches` cuts them
            for doc in docs:
                index += 1
                if (index - 1) % shards != shard:
                    continue
                group.append(doc)
                size += len(doc)
                if size >= BATCH_BYTES or len(group) >= BATCH_DOCS:
                    break
            if not group:
                return
            buf = np.concatenate([carry, encode(group)[0]])
            n = block_count(len(buf), length, stride)
            for i in range(skip, n):
                yield buf[i * stride : i * stride + length].copy(), (checkpoint, i)
            carry, skip = buf[n * stride :], 0

    def _emit(self, batch: list, local: int, role: int, workers: int, state: dict | None) -> Iterator[dict]:
        index = local * workers + role  # the DataLoader's position of this batch
        if index < self.skip_batches:
            return
        out = self.collator(batch, batch_generator(self.seed, self.epoch, self.rank, index))
        if self.carry_state and state is not None:
            out[STATE_KEY] = state
        yield out


def estimate_bytes_per_token(source: SplitSource, tokenizer, separator_id: int, max_bytes: int = 1 << 20) -> float:
    """UTF-8 bytes per token (separators included) over the first `max_bytes` of a split."""
    stats = ReadStats()
    docs = []
    for doc in source.iterate(stats):
        docs.append(doc)
        if stats.bytes >= max_bytes:
            break
    tokens = sum(int(flat.size) for flat, _ in encode_documents(fast_copy(tokenizer), docs, separator_id))
    return sum(len(d.encode("utf-8", "surrogatepass")) for d in docs) / max(tokens, 1)
