"""`prepare` into a shared store (data.store_dir: a shared directory or an s3:// URL), whole or in
parts, and the merge that makes it readable. store_manifest.py holds the layout, fingerprints and
the reading side.

Packing: each training file is packed on its own (pack.py's rule applied to that file's stream:
block k holds its tokens [k x stride, k x stride + block_len); the fewer than one block's tokens
left at the file's end are dropped and counted), so that a part can cut its blocks without knowing
what the files before it hold. Block keys (the collator's random draws, as block indices in the
node-local store) are file index x FILE_BLOCKS + block index in the file: any split into parts
gives every block the same key. Evaluation splits are token streams as the cache stores them:
each part writes its piece, and the merge concatenates the pieces in file order, which is the
stream one prepare writes (so the validation blocks are those of one prepare too).

Parts (`--part i/N`): the files of each split, sorted as listed, are cut into N contiguous runs of
about equal bytes; part i tokenizes run i into chunks named after the part, uploaded to
train/ as each fills (a node holds one chunk and one input file on its disk at a time), writes
its evaluation pieces, and last its record. Every part lists all the files (names and sizes
only), so all compute the same data fingerprint, which the merge checks.

The merge (module docstring of store_manifest.py for the layout) runs in the part that finds all N
records after writing its own, or alone with `--merge`. Why the last part and not a separate
step: a record is written after everything of its part, and S3 reads are strongly consistent
(AWS, December 2020): whichever part writes its record last sees every record, so a store is
complete without anyone waiting or polling. Two parts finishing together may both merge; the
merge is deterministic and each object is written whole, so either result is the same store.
On a filesystem that caches "no such file" answers (NFS), no part may see them all: run `--merge`.
The manifest is written last of all: a store without it is never read as complete.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from litdata.streaming.writer import BinaryWriter

from lit_transformer.data.data_config import DataConfig, TokenizerConfig, check_store_dir
from lit_transformer.data.sources import stdlib
from lit_transformer.data.sources.corpus import build_sources, objective_kind
from lit_transformer.data.sources.files import ReadStats
from lit_transformer.data.tokens import store_manifest as M
from lit_transformer.data.tokens.cache import CacheWriter
from lit_transformer.data.tokens.object_store import InputFile, Location, local_copy, open_location
from lit_transformer.data.tokens.pack import (
    BATCH_BYTES,
    _stats_dict,
    batch_encoder,
    encode_documents,
    fast_copy,
    num_blocks,
    token_dtype,
)
from lit_transformer.data.tokens.prepare import (
    Prepared,
    block_params,
    format_summary,
    require_litdata,
    tokenizer_for_data,
    write_run_files,
)
from lit_transformer.data.tokens.store import CHUNK_BYTES
from lit_transformer.data.tokens.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer
from lit_transformer.errors import DataError

FILE_BLOCKS = 1 << 32  # block keys: a file's blocks never reach 2**32 (5e11 tokens of 128)
SPLIT_KEYS = {"train": "data.train_files", "validation": "data.val_files", "test": "data.test_files"}


def parse_part(text: str) -> tuple[int, int]:
    """`--part I/N` -> (I, N), 0 <= I < N."""
    try:
        index, parts = (int(x) for x in str(text).split("/"))
    except ValueError:
        index, parts = -1, 0
    if not 0 <= index < parts:
        raise DataError(f"--part {text!r}: expected I/N with 0 <= I < N, e.g. 0/4 ... 3/4")
    return index, parts


def assign(items: list[InputFile], parts: int) -> list[int]:
    """The part of each file: contiguous runs of about equal bytes, by where each file's middle falls."""
    total, before, out = max(1, sum(f.size for f in items)), 0, []
    for f in items:
        out.append(min(parts - 1, (2 * before + f.size) * parts // (2 * total)))
        before += f.size
    return out


def file_documents(item: InputFile, cfg: DataConfig, objective: str, work: Path, key: str, stats: ReadStats):
    """The documents of one input file, read by the data pipeline's own readers (corpus.py: every
    format and bad-input rule), from a local copy when it is an object."""
    with local_copy(item, work, key) as path:
        one = dataclasses.replace(
            cfg, train_files=[str(path)], val_files=[], test_files=[], val_fraction=0.0, store_dir=None, store="cache"
        )
        try:
            yield from build_sources(one, objective, streaming=True)["train"].iterate(stats)
        except DataError as error:
            raise DataError(str(error).replace("data.train_files", key)) from None


def prepare_store(
    data_cfg: DataConfig,
    tok_cfg: TokenizerConfig,
    objective: str,
    run_dir,
    *,
    part: str | None = None,
    merge: int | None = None,
    model_vocab_size: int | None = None,
    print_fn: Callable[[str], None] | None = print,
    chunk_bytes: int | None = None,
) -> dict:
    """Write this process's part of the store at data.store_dir (all of it without `part`, "I/N"),
    merge when every part is there (`merge=N`: only merge N finished parts), and write
    run_dir/tokenizer.json. A store that holds this data already is reused; one that holds other
    data is refused before anything is written."""
    t0 = time.perf_counter()
    check_store_dir(data_cfg)
    if objective_kind(objective) != "lm":
        raise DataError(f"data.store_dir is for LM objectives (mlm, clm, span), not {objective!r}")
    require_litdata()
    if part is not None and merge is not None:
        raise DataError(f"--part {part} and --merge {merge} are two steps: give one")
    if merge is not None and merge < 1:
        raise DataError(f"--merge {merge}: the number of parts must be >= 1")
    index, parts = parse_part(part) if part is not None else (0, merge or 1)
    location = open_location(data_cfg.store_dir, "data.store_dir")  # probed: one line before anything is written
    inputs = M.split_inputs(data_cfg)
    given = _tokenizer_file(tok_cfg)
    keys = M.store_keys(data_cfg, tok_cfg, objective, inputs, M.file_hash(given) if given else None)
    manifest = M.read_json(location, M.MANIFEST)
    status, origin = "cached", "the store's"
    if manifest is not None:
        M.check_manifest(manifest, keys, location, files=True)
    elif merge is not None:
        manifest, status = M.merge_parts(location, keys, parts, data_cfg, objective, required=True), "merged"
    else:
        record = M.read_json(location, M.record_path(index, parts))
        if record is None or record["data"] != keys.data:  # else this part is there already: on to the merge
            tokenizer, origin, raw = _tokenizer(data_cfg, tok_cfg, objective, inputs["train"], given, parts)
            special = tokenizer_for_data(tokenizer, objective, model_vocab_size, data_cfg)
            location.write_bytes(M.TOKENIZER, raw)  # every part writes the same file
            chunks = chunk_bytes or CHUNK_BYTES
            write_part(location, keys, index, parts, inputs, data_cfg, objective, tokenizer, special, chunks)
        manifest = M.merge_parts(location, keys, parts, data_cfg, objective, required=False)
        status = "merged" if manifest is not None else "part"
    tokenizer, _ = _stored_tokenizer(location, data_cfg)
    prepared = Prepared(objective, tokenizer, tokenizer_for_data(tokenizer, objective, model_vocab_size, data_cfg), {})
    write_run_files(prepared, run_dir, data_cfg.task)
    seconds = time.perf_counter() - t0
    splits = {
        split: dict(v, split=split, cached=status == "cached", seconds=seconds, mb_per_s=v["bytes"] / 1e6 / seconds)
        for split, v in (manifest or {}).get("splits", {}).items()
    }
    summary = {
        "tokenizer": str(Path(run_dir) / "tokenizer.json"),
        "tokenizer_source": origin,
        "splits": splits,
        "label_names": None,
        "store": {
            "url": location.url(),
            "status": status,
            "part": f"{index}/{parts}",
            "complete": manifest is not None,
        },
        "seconds": round(seconds, 3),
    }
    if print_fn is not None:
        _report(print_fn, summary, tokenizer, run_dir)
    return summary


def _report(print_fn, summary: dict, tokenizer, run_dir) -> None:
    store = summary["store"]
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    print_fn(f"tokenizer  {vocab:,} tokens ({summary['tokenizer_source']}) -> {Path(run_dir) / 'tokenizer.json'}")
    for split in summary["splits"].values():
        print_fn(format_summary(split))
    what = {
        "cached": "holds this data already (cached)",
        "merged": "complete: manifest written",
        "part": f"part {store['part']} is written; the part that completes the set writes the manifest",
    }[store["status"]]
    print_fn(f"{'store':<10} {store['url']} {what} ({summary['seconds']:.2f} s)")


def _tokenizer_file(tok_cfg: TokenizerConfig) -> Path | None:
    if tok_cfg.path is None:
        return None
    path = Path(tok_cfg.path)
    return path / "tokenizer.json" if path.is_dir() else path


def _stored_tokenizer(location: Location, cfg: DataConfig):
    """The store's tokenizer.json, loaded."""
    raw = location.read_bytes(M.TOKENIZER)
    if raw is None:
        raise DataError(f"data.store_dir={location.url()} has no {M.TOKENIZER}: no part has been prepared yet")
    with tempfile.TemporaryDirectory(dir=M.work_root(cfg)) as work:
        (Path(work) / M.TOKENIZER).write_bytes(raw)
        return load_tokenizer(Path(work) / M.TOKENIZER), hashlib.sha256(raw).hexdigest()


def _tokenizer(cfg, tok_cfg, objective, train: list[InputFile], given: Path | None, parts: int):
    """(tokenizer, where it came from, its tokenizer.json) that every part packs with:
    tokenizer.path, or (one part) one trained on the training documents."""
    if given is not None:
        return load_tokenizer(given), str(given), given.read_bytes()
    if parts > 1:
        raise DataError(
            f"prepare --part i/{parts}: every part must tokenize with the same tokenizer, which a part does not "
            "train; set tokenizer.path (any tokenizer.json, e.g. the one a plain `prepare` of a sample writes)"
        )
    work = Path(tempfile.mkdtemp(prefix=".tmp-tokenizer-", dir=M.work_root(cfg)))
    try:
        texts = _training_texts(train, cfg, objective, work)
        trained = train_tokenizer(texts, tok_cfg, describe=f"train split of {', '.join(cfg.train_files)}")
        path = save_tokenizer(trained, work / "tokenizer.json")
        return load_tokenizer(path), "trained", path.read_bytes()  # reloaded: what the store's copy loads
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _training_texts(train: list[InputFile], cfg, objective, work: Path) -> Iterator[str]:
    fraction = M.holdout(cfg)
    for item in train:
        for doc in file_documents(item, cfg, objective, work, "data.train_files", ReadStats()):
            if fraction is None or stdlib.hash_fraction(doc) >= fraction:
                yield doc


# ----------------------------------------------------------------------------- one part


def write_part(location, keys, index, parts, inputs, cfg, objective, tokenizer, special, chunk_bytes) -> dict:
    """Part `index` of `parts`: its training chunks, its evaluation pieces, then its record."""
    name = M.part_name(index, parts)
    block_len, stride = block_params(objective, cfg)
    # an earlier attempt of this part may have left chunks and pieces: the names are this part's alone
    stale = [rel for rel in location.list("train") if Path(rel).name.startswith(name + "-")]
    location.delete(stale + list(location.list(f"parts/{name}")))
    encoder, dtype = fast_copy(tokenizer), token_dtype(tokenizer.get_vocab_size(with_added_tokens=True))
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=M.work_root(cfg)))
    try:
        mine = {}
        for split, items in inputs.items():
            owners = assign(items, parts)
            mine[split] = [(f, item) for f, item in enumerate(items) if owners[f] == index]
        record = {"version": M.SHARED_STORE_VERSION, "recipe": keys.recipe, "data": keys.data, "part": index}
        record.update(parts=parts, tokenizer=_stored_tokenizer(location, cfg)[1], splits={})
        heldout = _Piece(work, "heldout", encoder, special.separator_id, dtype) if M.holdout(cfg) else None
        chunks = _Chunks(location, name, work, chunk_bytes)
        packer = _Packer(block_len, stride, dtype, chunks)
        record["splits"]["train"] = _pack_train(mine["train"], cfg, objective, encoder, special, packer, heldout, work)
        record["splits"]["train"].update(chunks.finish())
        if heldout is not None:
            record["splits"]["validation"] = heldout.finish(location, f"parts/{name}/validation")
        for split in M.EVAL_SPLITS:
            if split in inputs and mine[split]:
                piece = _Piece(work, split, encoder, special.separator_id, dtype)
                stats = ReadStats()
                docs = (
                    doc
                    for _, item in mine[split]
                    for doc in file_documents(item, cfg, objective, work, SPLIT_KEYS[split], stats)
                )
                piece.extend(docs, cfg.num_proc, f"{split} split, {name}")
                record["splits"][split] = piece.finish(location, f"parts/{name}/{split}", stats)
        M.write_json(location, M.record_path(index, parts), record)  # last: the part is complete
        return record
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _pack_train(files, cfg, objective, encoder, special, packer, heldout, work) -> dict:
    """Pack this part's training files, each on its own (module docstring); held-out documents
    (data.val_fraction without data.val_files) go to `heldout` by the rule corpus.py applies."""
    fraction, stats, owners = M.holdout(cfg), ReadStats(), collections.deque()
    counts = {"documents": 0, "bytes": 0}

    def documents():
        for f, item in files:
            for doc in file_documents(item, cfg, objective, work, "data.train_files", stats):
                size = len(doc.encode("utf-8", "surrogatepass"))
                if fraction is not None and stdlib.hash_fraction(doc) < fraction:
                    heldout.add(doc, size)
                    continue
                counts["documents"] += 1
                counts["bytes"] += size
                owners.append(f)
                yield doc

    describe = f"train split of {', '.join(cfg.train_files)}"
    for flat, lengths in encode_documents(
        encoder, documents(), special.separator_id, num_proc=cfg.num_proc, describe=describe
    ):
        ends = np.cumsum(lengths)
        who = [owners.popleft() for _ in range(len(lengths))]
        first = 0
        for d in range(1, len(who) + 1):  # runs of documents of one file
            if d == len(who) or who[d] != who[first]:
                packer.feed(who[first], flat[ends[first] - lengths[first] : ends[d - 1]])
                first = d
        if heldout is not None:
            heldout.flush(whole_batches=True)
    packer.close()
    return {**counts, **packer.counts(), "files": [item.name for _, item in files], "read": _stats_dict(stats)}


class _Packer:
    """Each file's token stream cut into blocks as pack.py cuts one stream; the tail of a file
    shorter than a block is dropped (and counted)."""

    def __init__(self, block_len: int, stride: int, dtype, chunks: _Chunks):
        self.block_len, self.stride, self.dtype, self.chunks = block_len, stride, dtype, chunks
        self.file, self.buf, self.blocks_in_file, self.file_tokens = None, np.empty(0, dtype), 0, 0
        self.tokens = self.blocks = self.dropped = 0

    def feed(self, f: int, tokens: np.ndarray) -> None:
        if f != self.file:
            self._end_file()
            self.file = f
        buf = np.concatenate([self.buf, tokens.astype(self.dtype)])
        self.file_tokens += len(tokens)
        n = num_blocks(len(buf), self.block_len, self.stride)
        for b in range(n):
            block = buf[b * self.stride : b * self.stride + self.block_len]
            self.chunks.add(f * FILE_BLOCKS + self.blocks_in_file + b, block)
        self.blocks_in_file += n
        self.buf = buf[n * self.stride :]

    def _end_file(self) -> None:
        if self.file is not None:
            k = self.blocks_in_file
            self.dropped += self.file_tokens - ((k - 1) * self.stride + self.block_len if k else 0)
            self.tokens += self.file_tokens
            self.blocks += k
        self.file, self.buf, self.blocks_in_file, self.file_tokens = None, np.empty(0, self.dtype), 0, 0

    def close(self) -> None:
        self._end_file()

    def counts(self) -> dict:
        return {"tokens": self.tokens, "blocks": self.blocks, "dropped_tokens": self.dropped}


class _NamedWriter(BinaryWriter):
    """litdata's chunk writer, its chunks named after the part (its own names are per process rank)."""

    def __init__(self, cache_dir: str, chunk_bytes: int, prefix: str):
        super().__init__(cache_dir, chunk_bytes=chunk_bytes)
        self.prefix = prefix

    def get_chunk_filename(self, file_compression: bool | None = None) -> str:
        return f"{self.prefix}-{self._chunk_index}.bin"


class _Chunks:
    """Training blocks as litdata items {"index": key, "tokens": block}, uploaded chunk by chunk."""

    def __init__(self, location: Location, name: str, work: Path, chunk_bytes: int):
        self.location, self.dir, self.count = location, work / "chunks", 0
        self.writer = _NamedWriter(str(self.dir), chunk_bytes, name)

    def add(self, key: int, tokens: np.ndarray) -> None:
        written = self.writer.add_item(self.count, {"index": key, "tokens": tokens})
        self.count += 1
        if written:
            self._upload(written)

    def _upload(self, path: str) -> None:
        self.location.upload(Path(path), f"train/{Path(path).name}")
        os.unlink(path)

    def finish(self) -> dict:
        if self.count == 0:
            return {"chunks": [], "config": None}
        for path in self.writer.done():
            self._upload(path)
        index = json.loads(next(self.dir.glob("*.index.json")).read_text())
        return {"chunks": index["chunks"], "config": index["config"]}


class _Piece:
    """One part's piece of an evaluation split's token stream (tokens and doc_starts, cache.py's arrays)."""

    def __init__(self, work: Path, split: str, encoder, separator_id: int, dtype):
        self.writer = CacheWriter(work / "pieces", split)
        self.tokens, self.starts = self.writer.array("tokens", dtype), self.writer.array("doc_starts", np.int64)
        self.encoder, self.separator_id = encoder, separator_id
        self.encode = batch_encoder(encoder, separator_id)
        self.total = self.documents = self.bytes = 0
        self.pending: list[str] = []
        self.pending_chars = 0

    def add(self, doc: str, size: int) -> None:
        self.pending.append(doc)
        self.pending_chars += len(doc)
        self.documents += 1
        self.bytes += size

    def flush(self, whole_batches: bool = False) -> None:
        if self.pending and (not whole_batches or self.pending_chars >= BATCH_BYTES):
            self._append(*self.encode(self.pending))
            self.pending, self.pending_chars = [], 0

    def extend(self, docs, num_proc, describe: str) -> None:
        for flat, lengths in encode_documents(
            self.encoder, docs, self.separator_id, num_proc=num_proc, describe=describe
        ):
            self._append(flat, lengths)

    def _append(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        self.tokens.append(flat)
        self.starts.append(self.total + np.concatenate([[0], np.cumsum(lengths)[:-1]]))
        self.total += int(flat.size)

    def finish(self, location: Location, rel: str, stats: ReadStats | None = None) -> dict:
        self.flush()
        if stats is not None:
            self.documents, self.bytes = stats.documents, stats.bytes
        entry = self.writer.commit({"kind": "piece", "tokens": self.total})
        for name in ("tokens.bin", "doc_starts.bin"):
            location.upload(entry.path / name, f"{rel}/{name}")
        read = _stats_dict(stats) if stats is not None else {}
        return {
            "documents": self.documents,
            "bytes": self.bytes,
            "tokens": self.total,
            "arrays": entry.meta["arrays"],
            "read": read,
        }
