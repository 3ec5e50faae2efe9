"""Supervised examples in the token cache (seq2seq pairs, classification rows): their labels, their
segment ids, the ragged arrays that store them, and the dataset that reads them back. Packed LM
blocks are pack.py's.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from tokenizers import Tokenizer

from lit_transformer.data.tokens.cache import CacheEntry, CacheWriter, reopen_entry
from lit_transformer.data.tokens.pack import fast_copy
from lit_transformer.data.tokens.tokenizer import SpecialTokens
from lit_transformer.errors import DataError


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
        raise DataError(
            f"{describe}: labels {shown}{' ...' if len(unknown) > 5 else ''} do not occur in the "
            f"training data (training labels: {[str(n) for n in names][:10]})"
        )
    return out


def segment_ids(tokenizer: Tokenizer, special: SpecialTokens, texts: list, pairs: list | None, max_length: int):
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
            a = a[: max(room, 0)]
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
    return ids[: max_length - 1] + [end]


class RaggedExamples(torch.utils.data.Dataset):
    """Classification ({'ids', 'type_ids', 'label'}) or seq2seq ((source, target)) examples."""

    def __init__(self, entry: CacheEntry):
        self.entry = entry
        self.kind = entry.meta["kind"]
        self.n = entry.meta["examples"]

    def __getstate__(self):
        return {"path": str(self.entry.path)}

    def __setstate__(self, state):
        self.__init__(reopen_entry(state["path"]))

    def __len__(self) -> int:
        return self.n

    def lengths(self) -> np.ndarray:
        """Tokens in each example (seq2seq: the longer of source and target), for token batching."""
        if self.kind == "seq2seq":
            return np.maximum(np.diff(self.entry["source_offsets"]), np.diff(self.entry["target_offsets"]))
        return np.diff(self.entry["ids_offsets"])

    def _row(self, name: str, i: int) -> np.ndarray:
        off = self.entry[f"{name}_offsets"]
        return np.asarray(self.entry[name][off[i] : off[i + 1]], dtype=np.int64)

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        if self.kind == "seq2seq":
            return self._row("source", i), self._row("target", i)
        return {
            "ids": self._row("ids", i),
            "type_ids": self._row("type_ids", i),
            "label": np.asarray(self.entry["labels"][i]),
        }
