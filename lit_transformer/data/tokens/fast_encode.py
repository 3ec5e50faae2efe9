"""Exact shortcut for packing with the trained byte-level BPE: split with `re`, encode each word once.

`encode_batch_fast` spends most of its time per word on pre-tokenizer and offset bookkeeping,
which caps its packing throughput (the figures: docs/defaults.md, "The byte-level BPE word-cache
shortcut"). For the tokenizer `train_tokenizer` builds with kind "bpe", a document's ids are the
concatenation of the ids of its words, the words being the matches of `BYTE_LEVEL_PATTERN`,
which Python's `re` finds exactly as the Oniguruma engine inside `tokenizers` does (tokenizer.py
explains the pattern).
So `WordEncoder` splits documents with `re.findall`, maps each word to a row of a word table
(a dict), has the tokenizer itself encode only the words it has not seen, and gathers the ids
from a flat token table with numpy, at a higher throughput (`python benchmarks/data_prep.py`
measures it; docs/defaults.md has the figures).

Exactness rests on these, none of them guessed:
- `WordEncoder.create` compares the serialised tokenizer with the expected shape (BPE without
  dropout, no normaliser, exactly `byte_level_pre_tokenizer()`, no post-processor, truncation or
  padding) and returns None for anything else, which keeps `encode_batch_fast`.
- Added tokens are cut out of the text before pre-tokenizing, so a document that contains one
  goes through `encode_batch_fast` whole. Special tokens are not cut out when
  `encode_special_tokens` is on (as on every tokenizer tokenizer.py builds or loads), so then
  only non-special added tokens are looked for: 4062 of WikiText-2's 5352 documents spell
  "<unk>" and stay on the shortcut. (The search is cheap next to encoding.)
- A word is encoded by the full pipeline, which splits it again: were `re` to split coarser
  than Oniguruma the ids would still be exact; only a finer split could differ, and
  tests/data/test_data_fast_encode.py checks every code point, and `tokenizer.encode` parity on
  real and random Unicode text.
"""

from __future__ import annotations

import functools
import itertools
import json
import re

import numpy as np
from tokenizers import Tokenizer, models

from lit_transformer.data.tokens.tokenizer import BYTE_LEVEL_PATTERN, byte_level_pre_tokenizer

# The word table is cleared past this many words, so memory stays flat on endless streams.
# Each word costs its str, its dict slot and row number, its ids, the arrays' doubling slack and
# batch buffers; the limit bounds that, beside the Rust BPE cache of pack.BPE_CACHE_WORDS (the
# measured worst case: docs/defaults.md, "The byte-level BPE word-cache shortcut"). Words are
# Zipf-distributed (WikiText-2: 18k distinct in 2.4 MB), so after a clear the frequent ones are
# back within a batch and the table rarely refills.
MAX_WORDS = 1 << 18
ENCODE_CHUNK = 1024  # new words per pre-tokenized sequence: several sequences keep all cores busy
SEPARATOR = ""  # a virtual word for the document separator: no match of the pattern is empty


@functools.lru_cache(maxsize=1)
def _expected_pre_tokenizer() -> dict:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = byte_level_pre_tokenizer()
    return json.loads(tok.to_str())["pre_tokenizer"]


def _grown(array: np.ndarray, size: int) -> np.ndarray:
    if size <= array.size:
        return array
    out = np.empty(max(size, 2 * array.size), dtype=array.dtype)
    out[: array.size] = array
    return out


class WordEncoder:
    """Packs documents like `pack.encode_documents`, with per-word ids cached between batches."""

    def __init__(
        self, encoder: Tokenizer, separator_id: int, guard: re.Pattern | None = None, max_words: int = MAX_WORDS
    ):
        self.encoder, self.separator_id, self.guard, self.max_words = encoder, separator_id, guard, max_words
        self.findall = re.compile(BYTE_LEVEL_PATTERN).findall
        self.slow_documents = 0  # documents that went through encode_batch_fast (they hold an added token)
        self._reset()

    @classmethod
    def create(cls, encoder: Tokenizer, separator_id: int) -> WordEncoder | None:
        """A WordEncoder when `encoder` is exactly the trained byte-level BPE shape, else None."""
        text = encoder.to_str()
        d = json.loads(text)
        model = d.get("model") or {}
        if (
            model.get("type") != "BPE"
            or model.get("dropout")
            or d.get("normalizer") is not None
            or d.get("post_processor") is not None
            or d.get("truncation") is not None
            or d.get("padding") is not None
            or d.get("pre_tokenizer") != _expected_pre_tokenizer()
        ):
            return None
        cut = [
            t["content"]
            for t in d.get("added_tokens", [])
            if t["content"] and not (t["special"] and encoder.encode_special_tokens)
        ]
        # longest first, so that an alternation never stops at a shorter token's prefix
        guard = re.compile("|".join(map(re.escape, sorted(set(cut), key=len, reverse=True)))) if cut else None
        # A copy with the library's default 10k-word BPE cache: the word table is the cache here,
        # and pack.fast_copy's 1M-word one would only double the memory (docs/defaults.md).
        own = Tokenizer.from_str(text)
        own.encode_special_tokens = encoder.encode_special_tokens
        return cls(own, separator_id, guard)

    def _reset(self) -> None:
        self.index = {SEPARATOR: 0}  # word -> row of the tables below
        self.starts = np.zeros(1 << 12, dtype=np.int64)  # row -> first position in `table`
        self.lens = np.ones(1 << 12, dtype=np.int32)  # row -> number of ids
        self.table = np.full(1 << 14, self.separator_id, dtype=np.int32)  # every row's ids, end to end
        self.used = 1  # positions of `table` in use

    def _add(self, words: list[str]) -> None:
        # The words go in as pre-tokenized sequences of ENCODE_CHUNK words: the tokenizer runs
        # its whole pipeline on each word alone, as it would on a document made of that word,
        # and `word_ids` tells which word each id comes from. Less CPU time than one
        # `encode_batch_fast` item per word, whose cost is mostly per item, not per id
        # (docs/defaults.md, "The byte-level BPE word-cache shortcut").
        chunks = [words[i : i + ENCODE_CHUNK] for i in range(0, len(words), ENCODE_CHUNK)]
        encodings = self.encoder.encode_batch(chunks, is_pretokenized=True, add_special_tokens=False)
        tokens = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=np.int64)
        word_of = np.fromiter(
            itertools.chain.from_iterable((w + k * ENCODE_CHUNK for w in e.word_ids) for k, e in enumerate(encodings)),
            dtype=np.int64,
        )
        lens = np.bincount(word_of, minlength=len(words))  # ids per word, in the order of `words`
        row, pos = len(self.index), self.used
        self.lens = _grown(self.lens, row + len(words))
        self.starts = _grown(self.starts, row + len(words))
        self.table = _grown(self.table, pos + tokens.size)
        self.lens[row : row + len(words)] = lens
        self.starts[row : row + len(words)] = pos + np.cumsum(lens, dtype=np.int64) - lens
        self.table[pos : pos + tokens.size] = tokens
        self.used = pos + tokens.size
        self.index.update(zip(words, range(row, row + len(words))))

    def encode(self, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, document lengths) of `docs`, each document followed by the separator."""
        if len(self.index) > self.max_words:
            self._reset()
        slow = [i for i, doc in enumerate(docs) if self.guard.search(doc)] if self.guard is not None else []
        words = list(map(self.findall, docs))
        for i in slow:
            words[i] = []
        for w in words:
            w.append(SEPARATOR)
        counts = np.fromiter(map(len, words), dtype=np.int64, count=len(words))  # words per document
        flat_words = list(itertools.chain.from_iterable(words))
        index = self.index
        new = set(itertools.filterfalse(index.__contains__, flat_words))
        if new:
            self._add(list(new))
        rows = np.fromiter(map(index.__getitem__, flat_words), dtype=np.int64, count=len(flat_words))
        lens = self.lens[rows].astype(np.int64)
        ends = np.cumsum(lens)  # end of each word in the output
        total = int(ends[-1]) if ends.size else 0
        # output position p of word w reads table[starts[w] + p - (ends[w] - lens[w])]
        flat = self.table[np.repeat(self.starts[rows] - (ends - lens), lens) + np.arange(total)].astype(np.int64)
        doc_ends = ends[np.cumsum(counts) - 1]
        lengths = np.diff(doc_ends, prepend=0)
        if slow:
            self.slow_documents += len(slow)
            ids = [e.ids for e in self.encoder.encode_batch_fast([docs[i] for i in slow], add_special_tokens=False)]
            n = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
            at = np.repeat((doc_ends - lengths)[slow], n)  # before the document's separator, in order
            flat = np.insert(
                flat, at, np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(n.sum()))
            )
            lengths[slow] += n
        return flat, lengths
