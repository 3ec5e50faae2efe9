"""Tokenize and store: packed token streams for LM objectives, ragged examples otherwise.

LM packing: documents are tokenized without special tokens and concatenated, each followed by
the separator (eos, else sep). The stream is stored whole (uint16 when the vocabulary fits,
else uint32) with `doc_starts` (the position where each document begins), so a later feature
can rebuild document ids and mask cross-document attention. Blocks are windows of the stream:

    mlm   T tokens, stride T             blocks = N // T
    clm   T + 1 tokens, stride T         blocks = (N - 1) // T  (every token but the first is a label once)
    span  raw_length tokens (span.py)    blocks = N // raw_length

The only text dropped is the final partial block (< one stride), reported as `dropped_tokens`.

Tokenization works on batches of about 1 MB of text. The byte-level BPE that tokenizer.py
trains takes fast_encode.py's word-cache shortcut (the same ids, split by Python's `re`, each
distinct word encoded once), at a higher throughput than `encode_batch_fast`. Every other
tokenizer uses `encode_batch_fast`, which runs the batch on all cores and skips offset
computation, faster than `datasets.map(batched=True)` (Arrow round trips and pickling cost more
than a second process brings). BPE models get a 1M-word cache there: the library default of
10k words thrashes on real corpora. `python benchmarks/data_prep.py` measures the throughput;
benchmarks/README.md records the figures.

Processes (data.num_proc; `encode_documents`): batches go to a pool of worker processes, each
with its own encoder built once, and come back in order, identical to one process's. num_proc=None
packs the first SWITCH_CHARS (16 MB) here, then starts min(available cores, 8) workers. The
pool's fixed price is forking the parent and each worker's cold word cache, so a small corpus
gains nothing from a second process: SWITCH_CHARS is about 4x the break-even that
`python benchmarks/data_prep.py --num-proc N [--repeat-corpus 8]` measured (benchmarks/README.md),
so that small corpora (tests, tiny recipes, WikiText-2) never fork and a large one pays about a
second for its serial prefix. The parent's own share (read, batch, pickle, write) caps the
speed-up, hence MAX_AUTO_PROC.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import json
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import torch
from tokenizers import Tokenizer, models

from lit_transformer.data.sources.files import ReadStats
from lit_transformer.data.tokens.cache import CacheEntry, CacheWriter, reopen_entry
from lit_transformer.data.tokens.fast_encode import WordEncoder
from lit_transformer.data.tokens.tokenizer import SpecialTokens, tokenizer_from_str
from lit_transformer.errors import DataError

BATCH_BYTES = 1 << 20
BATCH_DOCS = 4096
BPE_CACHE_WORDS = 1 << 20
# num_proc=None packs this much text (characters, as BATCH_BYTES counts) in this process before
# starting the pool: 4x the measured break-even (module docstring), decided without reading ahead.
SWITCH_CHARS = 16 << 20
MAX_AUTO_PROC = 8  # past this, the parent's own share is the limit (docs/defaults.md, "Packing in processes")
IN_FLIGHT_PER_WORKER = 2  # batches submitted and not yet written, per worker: keeps each busy, memory flat
# "fork" on Linux: children start quickly sharing the parent's pages and import nothing (they use
# only tokenizers and numpy, never torch). "spawn" elsewhere: macOS forks unsafely once threads
# exist; a spawned child imports the package (torch included, seconds) before its first batch.
START_METHOD = "fork" if sys.platform.startswith("linux") else "spawn"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < 65536 else np.dtype(np.uint32)


def fast_copy(tokenizer: Tokenizer) -> Tokenizer:
    """A copy for bulk encoding; a BPE model gets a larger word cache (same ids, faster)."""
    return _with_bpe_cache(tokenizer_from_str(tokenizer.to_str()))


def _with_bpe_cache(copy: Tokenizer) -> Tokenizer:
    d = json.loads(copy.to_str())["model"]
    if d.get("type") != "BPE" or d.get("dropout"):
        return copy
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in d["merges"]]
    kwargs = {
        k: d[k]
        for k in (
            "unk_token",
            "continuing_subword_prefix",
            "end_of_word_suffix",
            "fuse_unk",
            "byte_fallback",
            "ignore_merges",
        )
        if d.get(k) is not None
    }
    copy.model = models.BPE(vocab=d["vocab"], merges=merges, cache_capacity=BPE_CACHE_WORDS, **kwargs)
    return copy


def text_batches(texts: Iterable[str]) -> Iterator[list[str]]:
    batch, size = [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= BATCH_BYTES or len(batch) >= BATCH_DOCS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def batch_encoder(
    encoder: Tokenizer, separator_id: int, *, own_copy: bool = False
) -> Callable[[list[str]], tuple[np.ndarray, np.ndarray]]:
    """The function that packs one text batch: fast_encode.py's exact shortcut for the trained
    byte-level BPE (same ids, faster), else `encode_batch_fast`. `own_copy`: `encoder` is a fresh
    copy, which gets `fast_copy`'s large BPE cache here, only when it is used (building it costs)."""
    words = WordEncoder.create(encoder, separator_id)
    if words is not None:
        return words.encode
    if own_copy:
        encoder = _with_bpe_cache(encoder)
    sep = (separator_id,)

    def encode(batch: list[str]) -> tuple[np.ndarray, np.ndarray]:
        ids = [e.ids for e in encoder.encode_batch_fast(batch, add_special_tokens=False)]
        lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(
            itertools.chain.from_iterable(itertools.chain(x, sep) for x in ids),
            dtype=np.int64,
            count=int(lengths.sum()),
        )
        return flat, lengths

    return encode


def encode_documents(
    encoder: Tokenizer, docs: Iterable[str], separator_id: int, *, num_proc: int | None = 1, describe: str = "packing"
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(tokens, document lengths) per batch of about BATCH_BYTES; each document ends with the
    separator. num_proc 1: this process; N > 1: a pool of N processes (`pooled_batches`); None: this
    process for the first SWITCH_CHARS of text, then `auto_num_proc()` processes. The arrays
    are the same whatever num_proc, batch for batch; `describe` names the split in errors."""
    if num_proc is not None and num_proc < 1:
        raise DataError(f"{describe}: num_proc={num_proc} must be a positive integer")
    procs = auto_num_proc() if num_proc is None else num_proc
    batches = text_batches(docs)
    if num_proc is None and procs > 1:
        encode, seen = batch_encoder(encoder, separator_id), 0
        for batch in batches:
            seen += sum(map(len, batch))
            yield encode(batch)
            if seen > SWITCH_CHARS:
                break
        else:
            return
        del encode  # its word table is not needed in this process any more
    if procs == 1:
        yield from map(batch_encoder(encoder, separator_id), batches)
        return
    yield from pooled_batches(encoder, separator_id, batches, procs, describe)


def write_lm(
    docs: Iterable[str],
    tokenizer: Tokenizer,
    special: SpecialTokens,
    writer: CacheWriter,
    stats: ReadStats,
    *,
    block_len: int,
    stride: int,
    describe: str,
    num_proc: int | None = None,
) -> CacheEntry:
    """Pack `docs` into `writer`; num_proc as in `encode_documents`, None (automatic) by default."""
    if special.separator_id is None:
        raise DataError("the tokenizer has no eos/sep token to separate packed documents")
    encoder = fast_copy(tokenizer)
    dtype = token_dtype(tokenizer.get_vocab_size(with_added_tokens=True))
    tokens = writer.array("tokens", dtype)
    starts = writer.array("doc_starts", np.int64)
    total = 0
    for flat, lengths in encode_documents(encoder, docs, special.separator_id, num_proc=num_proc, describe=describe):
        tokens.append(flat)
        starts.append(total + np.concatenate([[0], np.cumsum(lengths)[:-1]]))
        total += int(flat.size)
    blocks = num_blocks(total, block_len, stride)
    if stats.documents == 0 or blocks == 0:
        raise DataError(
            f"{describe}: {stats.documents} documents, {total} tokens: not enough for one block of "
            f"{block_len} tokens (add text or lower data.block_size)"
        )
    used = (blocks - 1) * stride + block_len
    return writer.commit(
        {
            "kind": "lm",
            "documents": stats.documents,
            "bytes": stats.bytes,
            "tokens": total,
            "blocks": blocks,
            "block_len": block_len,
            "stride": stride,
            "dropped_tokens": total - used,
            "bytes_per_token": stats.bytes / total,
            "read": _stats_dict(stats),
        }
    )


def num_blocks(total: int, block_len: int, stride: int) -> int:
    return max(0, (total - block_len) // stride + 1) if total >= block_len else 0


def _stats_dict(stats: ReadStats) -> dict:
    return {
        "replaced_chars": stats.replaced_chars,
        "long_lines_skipped": stats.long_lines_skipped,
        "skipped_examples": stats.skipped_examples,
    }


class LMBlocks(torch.utils.data.Dataset):
    """Fixed windows of a packed token stream; item i is an int64 array of `block_len` tokens."""

    def __init__(self, entry: CacheEntry):
        self.entry = entry
        self.tokens = entry["tokens"]
        self.doc_starts = entry["doc_starts"]
        self.block_len = entry.meta["block_len"]
        self.stride = entry.meta["stride"]
        self.n = entry.meta["blocks"]

    def __getstate__(self):
        return {"path": str(self.entry.path)}  # workers reopen the memmap instead of copying it

    def __setstate__(self, state):
        self.__init__(reopen_entry(state["path"]))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.n:
            raise IndexError(i)
        start = i * self.stride
        return np.asarray(self.tokens[start : start + self.block_len], dtype=np.int64)

    def document_ids(self, i: int) -> np.ndarray:
        """(block_len,) index of the document each token of block i belongs to."""
        positions = np.arange(i * self.stride, i * self.stride + self.block_len)
        return np.searchsorted(self.doc_starts, positions, side="right") - 1


# ----------------------------------------------------------------------------- process pool


def auto_num_proc() -> int:
    """Processes that num_proc=None packs with: the cores this process may run on, at most MAX_AUTO_PROC."""
    if multiprocessing.current_process().daemon:  # e.g. a DataLoader worker: it may not have children
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_AUTO_PROC))


_worker_encode: Callable | None = None  # set in each pool process by `_init_worker`


def _init_worker(tokenizer_json: str, encode_special_tokens: bool, separator_id: int) -> None:
    # One Rust thread per process: N processes of N threads each would oversubscribe the cores.
    # Read by tokenizers at each call, so setting them here is early enough (also after a fork).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it terminates the pool
    encoder = Tokenizer.from_str(tokenizer_json)  # padding and truncation are in the JSON ...
    encoder.encode_special_tokens = encode_special_tokens  # ... this flag is not
    global _worker_encode
    _worker_encode = batch_encoder(encoder, separator_id, own_copy=True)


def _encode_in_worker(batch: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _worker_encode(batch)


@contextlib.contextmanager
def _forking():
    """Around the fork: TOKENIZERS_PARALLELISM / RAYON_NUM_THREADS set, so that tokenizers' fork
    handler sees them configured in the children, and the parent's objects frozen out of the
    garbage collector (the `gc.freeze` docs): a child's collections then skip the inherited heap
    (torch, lightning: ~400 MB) instead of touching, and so copying, its pages, which saves the
    workers CPU time (docs/defaults.md, "Packing in processes"). Restored afterwards."""
    saved = {k: os.environ.get(k) for k in ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS")}
    os.environ.update(TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1")
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def pooled_batches(
    encoder: Tokenizer, separator_id: int, batches: Iterator[list[str]], procs: int, describe: str
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`batch_encoder(encoder, separator_id)` mapped over `batches` by `procs` processes, in order.

    Each process builds its encoder once from `encoder`'s JSON (the same ids: `fast_copy` makes
    the same copy). At most IN_FLIGHT_PER_WORKER * procs batches are read ahead. ProcessPoolExecutor,
    not multiprocessing.Pool: a worker that dies (OOM killer, os._exit) breaks the executor
    (BrokenProcessPool) where Pool would wait for its result forever. START_METHOD says how
    processes start."""
    ctx = multiprocessing.get_context(START_METHOD)
    pool = ProcessPoolExecutor(
        procs,
        mp_context=ctx,
        initializer=_init_worker,
        initargs=(encoder.to_str(), encoder.encode_special_tokens, separator_id),
    )
    window: collections.deque = collections.deque()
    done = False
    try:
        with _forking():  # under "fork" every process starts at the first submit (spawn: on demand)
            for batch in itertools.islice(batches, 1):
                window.append(pool.submit(_encode_in_worker, batch))
        for batch in itertools.islice(batches, IN_FLIGHT_PER_WORKER * procs - 1):
            window.append(pool.submit(_encode_in_worker, batch))
        while window:
            result = window.popleft().result()  # a worker's exception is raised here, type and message kept
            for batch in itertools.islice(batches, 1):
                window.append(pool.submit(_encode_in_worker, batch))
            yield result
        done = True
    except BrokenProcessPool as exc:
        raise DataError(
            f"{describe}: a tokenizer process of the {procs} packing processes died (killed, out of "
            "memory?); set data.num_proc=1 to pack in one process"
        ) from exc
    finally:
        _close(pool, done)


def _close(pool: ProcessPoolExecutor, done: bool) -> None:
    """Shut the pool down: cleanly after the last batch, else (error, interrupt, the consumer
    stopped early) terminate every process and reap it, so that none is left running or a zombie."""
    if done:
        pool.shutdown(wait=True)
        return
    processes = list((getattr(pool, "_processes", None) or {}).values())  # no public handle before 3.14
    manager = getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)
    for p in processes:
        p.terminate()
    for p in processes:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
    if manager is not None:
        manager.join(10)  # it notices the dead processes, fails what was pending, and exits
