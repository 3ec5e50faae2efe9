"""Streaming mode (`data.streaming: true`): read, tokenize, pack and collate on the fly.

For corpora too large to preprocess. Memory stays flat: files are read lazily (1 MiB chunks,
one document at a time), tokenized in ~1 MB batches, packed through a buffer of at most one
batch of tokens plus one block, and shuffled within `data.shuffle_buffer` blocks.

Sharding: document i goes to shard i mod (world_size * num_workers), so ranks and dataloader
workers tokenize disjoint documents. A DataLoader interleaves its workers' batches round-robin,
so worker w numbers its batches w, w + num_workers, ...: the collator seed and the resume skip
use that global batch index. Ranks can end an epoch a batch apart; with DDP, bound training by
`max_steps` (or `limit_train_batches`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from lit_transformer.data.collate import batch_generator
from lit_transformer.data.corpus import SplitSource
from lit_transformer.data.files import ReadStats
from lit_transformer.data.pack import encode_documents, fast_copy
from lit_transformer.data.tokenizer import tokenizer_from_str


def pack_stream(chunks: Iterable[tuple[np.ndarray, np.ndarray]], block_len: int, stride: int) -> Iterator[np.ndarray]:
    """Fixed windows (block_len, stride) of a token stream arriving in chunks."""
    buf = np.empty(0, dtype=np.int64)
    for flat, _ in chunks:
        buf = np.concatenate([buf, flat])
        n = (len(buf) - block_len) // stride + 1 if len(buf) >= block_len else 0
        for i in range(n):
            yield buf[i * stride : i * stride + block_len].copy()
        buf = buf[n * stride :]


def shuffled(items: Iterable, size: int, rng: np.random.Generator) -> Iterator:
    """Reservoir-style shuffle buffer: hold `size` items, emit a random one per new item."""
    buf: list = []
    for item in items:
        if len(buf) < size:
            buf.append(item)
            continue
        j = int(rng.integers(size))
        yield buf[j]
        buf[j] = item
    rng.shuffle(buf)
    yield from buf


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
    ):
        super().__init__()
        self.source, self.tokenizer_json, self.separator_id = source, tokenizer_json, separator_id
        self.block_len, self.stride, self.batch_size = block_len, stride, batch_size
        self.collator, self.seed, self.rank, self.world_size = collator, seed, rank, world_size
        self.shuffle, self.shuffle_buffer, self.drop_last = shuffle, shuffle_buffer, drop_last
        self.epoch = 0
        self.skip_batches = 0  # batches of this epoch already consumed before a resume

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.epoch, self.skip_batches = epoch, skip_batches

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        shard, shards = self.rank * workers + worker, self.world_size * workers
        docs = (d for i, d in enumerate(self.source.iterate(ReadStats())) if i % shards == shard)
        encoder = fast_copy(tokenizer_from_str(self.tokenizer_json))
        blocks: Iterable = pack_stream(encode_documents(encoder, docs, self.separator_id), self.block_len, self.stride)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch, shard])
            blocks = shuffled(blocks, self.shuffle_buffer, rng)
        local = 0
        batch: list = []
        for block in blocks:
            batch.append(block)
            if len(batch) == self.batch_size:
                yield from self._emit(batch, local, worker, workers)
                local += 1
                batch = []
        if batch and not self.drop_last:
            yield from self._emit(batch, local, worker, workers)

    def _emit(self, batch: list, local: int, worker: int, workers: int) -> Iterator[dict]:
        index = local * workers + worker  # the DataLoader's position of this batch
        if index < self.skip_batches:
            return
        yield self.collator(batch, batch_generator(self.seed, self.epoch, self.rank, index))


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
