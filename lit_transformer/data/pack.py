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
distinct word encoded once). `python benchmarks/data_prep.py` on WikiText-2 (2.4 MB, 8k BPE, 2
shared cores; whole first run: read, tokenize, pack, write) measures 6.9-7.5 MB per CPU-second
(7.0-7.6 with RAYON_NUM_THREADS=1), against 3.3-3.6 when the same text goes through
`encode_batch_fast`. Every other tokenizer uses `encode_batch_fast`, which runs the batch on
all cores and skips offset computation: 2.2 MB/s wall-clock on the same corpus with the earlier
GPT-2 pre-tokenizer, against 1.6-1.8 MB/s for `datasets.map(batched=True)` with one process and
1.2-1.5 MB/s with `num_proc=2` (Arrow round trips and pickling cost more than the second
process brings). BPE models get a 1M-word cache there: the library default of 10k words
thrashes on real corpora.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np
import torch
from tokenizers import Tokenizer, models

from lit_transformer.data.cache import CacheEntry, CacheWriter, open_cache
from lit_transformer.data.errors import DataError
from lit_transformer.data.fast_encode import WordEncoder
from lit_transformer.data.files import ReadStats
from lit_transformer.data.tokenizer import SpecialTokens, tokenizer_from_str

BATCH_BYTES = 1 << 20
BATCH_DOCS = 4096
BPE_CACHE_WORDS = 1 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < 65536 else np.dtype(np.uint32)


def fast_copy(tokenizer: Tokenizer) -> Tokenizer:
    """A copy for bulk encoding; a BPE model gets a larger word cache (same ids, faster)."""
    copy = tokenizer_from_str(tokenizer.to_str())
    d = json.loads(copy.to_str())["model"]
    if d.get("type") != "BPE" or d.get("dropout"):
        return copy
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in d["merges"]]
    kwargs = {k: d[k] for k in ("unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk",
                                "byte_fallback", "ignore_merges") if d.get(k) is not None}
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


def encode_documents(encoder: Tokenizer, docs: Iterable[str], separator_id: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(tokens, document lengths) per batch; each document ends with the separator. The
    trained byte-level BPE takes fast_encode.py's exact shortcut (same ids, about 2x faster)."""
    words = WordEncoder.create(encoder, separator_id)
    for batch in text_batches(docs):
        if words is not None:
            yield words.encode(batch)
            continue
        ids = [e.ids for e in encoder.encode_batch_fast(batch, add_special_tokens=False)]
        lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
        sep = (separator_id,)
        flat = np.fromiter(itertools.chain.from_iterable(itertools.chain(x, sep) for x in ids),
                           dtype=np.int64, count=int(lengths.sum()))
        yield flat, lengths


def write_lm(docs: Iterable[str], tokenizer: Tokenizer, special: SpecialTokens, writer: CacheWriter,
             stats: ReadStats, *, block_len: int, stride: int, describe: str) -> CacheEntry:
    if special.separator_id is None:
        raise DataError("the tokenizer has no eos/sep token to separate packed documents")
    encoder = fast_copy(tokenizer)
    dtype = token_dtype(tokenizer.get_vocab_size(with_added_tokens=True))
    tokens = writer.array("tokens", dtype)
    starts = writer.array("doc_starts", np.int64)
    total = 0
    for flat, lengths in encode_documents(encoder, docs, special.separator_id):
        tokens.append(flat)
        starts.append(total + np.concatenate([[0], np.cumsum(lengths)[:-1]]))
        total += int(flat.size)
    blocks = num_blocks(total, block_len, stride)
    if stats.documents == 0 or blocks == 0:
        raise DataError(f"{describe}: {stats.documents} documents, {total} tokens: not enough for one block of "
                        f"{block_len} tokens (add text or lower data.block_size)")
    used = (blocks - 1) * stride + block_len
    return writer.commit({
        "kind": "lm", "documents": stats.documents, "bytes": stats.bytes, "tokens": total, "blocks": blocks,
        "block_len": block_len, "stride": stride, "dropped_tokens": total - used,
        "bytes_per_token": stats.bytes / total, "read": _stats_dict(stats),
    })


def _reopen(path: str) -> CacheEntry:
    entry = open_cache(Path(path).parent, Path(path).name)
    if entry is None:
        raise DataError(f"token cache {path} disappeared while in use")
    return entry


def num_blocks(total: int, block_len: int, stride: int) -> int:
    return max(0, (total - block_len) // stride + 1) if total >= block_len else 0


def _stats_dict(stats: ReadStats) -> dict:
    return {"replaced_chars": stats.replaced_chars, "long_lines_skipped": stats.long_lines_skipped,
            "skipped_examples": stats.skipped_examples}


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
        self.__init__(_reopen(state["path"]))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.n:
            raise IndexError(i)
        start = i * self.stride
        return np.asarray(self.tokens[start:start + self.block_len], dtype=np.int64)

    def document_ids(self, i: int) -> np.ndarray:
        """(block_len,) index of the document each token of block i belongs to."""
        positions = np.arange(i * self.stride, i * self.stride + self.block_len)
        return np.searchsorted(self.doc_starts, positions, side="right") - 1


# ----------------------------------------------------------------------------- supervised


def label_names_for(task: str, raw_labels: list, describe: str) -> list:
    if task == "regression":
        return []
    values = set()
    for label in raw_labels:
        values.update(_label_list(label) if task == "multi_label" else [_scalar_label(label, describe)])
    if all(isinstance(v, int) for v in values):
        return sorted(values)
    return sorted(str(v) for v in values)


def _scalar_label(label, describe):
    if isinstance(label, (list, tuple, dict)):
        raise DataError(f"{describe}: label {label!r} is a list; set data.task=multi_label for multi-label data")
    if isinstance(label, float) and label.is_integer():
        return int(label)
    return label if isinstance(label, (int, str)) else str(label)


def _label_list(label) -> list:
    if isinstance(label, str):  # "a,b" in csv files
        return [s.strip() for s in label.split(",") if s.strip()]
    return [_scalar_label(v, "multi-label") for v in label]


def encode_labels(task: str, raw_labels: list, names: list, describe: str) -> np.ndarray:
    if task == "regression":
        try:
            return np.asarray([float(x) for x in raw_labels], dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise DataError(f"{describe}: data.task=regression needs numeric labels ({exc})") from exc
    index = {str(n): i for i, n in enumerate(names)}
    unknown = set()
    if task == "multi_label":
        out = np.zeros((len(raw_labels), len(names)), dtype=np.float32)
        for row, label in enumerate(raw_labels):
            for v in _label_list(label):
                if str(v) in index:
                    out[row, index[str(v)]] = 1.0
                else:
                    unknown.add(str(v))
    else:
        out = np.zeros(len(raw_labels), dtype=np.int64)
        for row, label in enumerate(raw_labels):
            key = str(_scalar_label(label, describe))
            if key in index:
                out[row] = index[key]
            else:
                unknown.add(key)
    if unknown:
        shown = sorted(unknown)[:5]
        raise DataError(f"{describe}: labels {shown}{' ...' if len(unknown) > 5 else ''} do not occur in the "
                        f"training data (training labels: {[str(n) for n in names][:10]})")
    return out


def segment_ids(tokenizer: Tokenizer, special: SpecialTokens, texts: list, pairs: Optional[list], max_length: int):
    """(ids, type_ids) per example: the tokenizer's own post-processor when it has one, else
    `[CLS] a [SEP] b [SEP]` from the special tokens (cls omitted, and eos for sep, when absent)."""
    encoder = fast_copy(tokenizer)
    inputs = list(zip(texts, pairs)) if pairs is not None else texts
    if tokenizer.post_processor is not None:
        encoder.enable_truncation(max_length)
        encs = encoder.encode_batch_fast(inputs, add_special_tokens=True)
        return [e.ids for e in encs], [e.type_ids for e in encs]
    head = [special.cls_id] if special.cls_id is not None else []
    sep = [special.sep_id if special.sep_id is not None else special.eos_id]
    sep = [s for s in sep if s is not None]
    a_ids = [e.ids for e in encoder.encode_batch_fast(texts, add_special_tokens=False)]
    b_ids = [e.ids for e in encoder.encode_batch_fast(pairs, add_special_tokens=False)] if pairs is not None else None
    out_ids, out_types = [], []
    for i, a in enumerate(a_ids):
        b = b_ids[i] if b_ids is not None else None
        room = max_length - len(head) - len(sep) * (2 if b is not None else 1)
        if b is None:
            a = a[:max(room, 0)]
            ids = head + a + sep
            types = [0] * len(ids)
        else:
            while len(a) + len(b) > room and (a or b):  # longest first, like tokenizers' truncation
                if len(a) >= len(b):
                    a = a[:-1]
                else:
                    b = b[:-1]
            ids = head + a + sep + b + sep
            types = [0] * (len(head) + len(a) + len(sep)) + [1] * (len(b) + len(sep))
        out_ids.append(ids)
        out_types.append(types)
    return out_ids, out_types


def write_ragged(writer: CacheWriter, name: str, seqs: list, dtype) -> None:
    arr = writer.array(name, dtype)
    offsets = writer.array(f"{name}_offsets", np.int64)
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    offsets.append(np.concatenate([[0], np.cumsum(lengths)]))
    arr.append(np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum())))


def truncate_with_end(ids: list, max_length: int, end: int) -> list:
    return ids[:max_length - 1] + [end]


class RaggedExamples(torch.utils.data.Dataset):
    """Classification ({'ids', 'type_ids', 'label'}) or seq2seq ((source, target)) examples."""

    def __init__(self, entry: CacheEntry):
        self.entry = entry
        self.kind = entry.meta["kind"]
        self.n = entry.meta["examples"]

    def __getstate__(self):
        return {"path": str(self.entry.path)}

    def __setstate__(self, state):
        self.__init__(_reopen(state["path"]))

    def __len__(self) -> int:
        return self.n

    def _row(self, name: str, i: int) -> np.ndarray:
        off = self.entry[f"{name}_offsets"]
        return np.asarray(self.entry[name][off[i]:off[i + 1]], dtype=np.int64)

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        if self.kind == "seq2seq":
            return self._row("source", i), self._row("target", i)
        return {"ids": self._row("ids", i), "type_ids": self._row("type_ids", i),
                "label": np.asarray(self.entry["labels"][i])}
