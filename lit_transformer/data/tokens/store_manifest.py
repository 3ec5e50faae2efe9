"""A shared store's layout, fingerprints and manifest, and opening it to train or evaluate.

Under data.store_dir (a directory or an s3:// URL; remote_store.py writes it):

    manifest.json                          written last, by the merge: a store without it is never read
    tokenizer.json
    train/index.json                       litdata's index of every part's chunks, in part order
    train/part-00000-of-00002-0.bin ...    the chunks, named by their part: parts never write one name twice
    validation/  test/                     token cache entries (cache.py's layout: meta.json, arrays)
    parts/part-00000-of-00002.json         a part's record, the last thing the part writes
    parts/part-00000-of-00002/validation/  the part's piece of an evaluation split's token stream

Fingerprints. `recipe` hashes what a recipe says about its data: the files as written, format and
columns, block shape, tokenizer settings but tokenizer.path (the store holds its tokenizer: a
training node need not name the file, and an evaluation names the run's copy): a training node
computes it without the files and refuses a store whose manifest holds another. `data` adds what
prepare reads: each input file's name, size and ETag (object_store.InputFile) and a given
tokenizer file's hash: a second prepare reuses a store whose manifest holds the same, and refuses
one that holds other data. Where a node has the recipe's tokenizer.path, the file must be the
store's tokenizer.

Opening for training (`open_store`) reads the manifest (none: one line saying prepare has not
finished), the tokenizer and the evaluation splits; an object store's are copied into
<cache_dir>/stores/<data fingerprint>/, the training chunks never are (store.StoreLoader streams them).
The merge (`merge_parts`, run by remote_store.py) writes the index, the evaluation splits and the
manifest from the parts' records.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from lit_transformer.data.data_config import DataConfig, TokenizerConfig, check_store_dir
from lit_transformer.data.sources.corpus import objective_kind
from lit_transformer.data.tokens.cache import CacheEntry, CacheWriter, cache_key, cache_lock, cache_root, open_cache
from lit_transformer.data.tokens.object_store import InputFile, LocalLocation, Location, open_location, resolve_inputs
from lit_transformer.data.tokens.pack import num_blocks
from lit_transformer.data.tokens.prepare import Prepared, block_params, tokenizer_for_data
from lit_transformer.data.tokens.tokenizer import BYTE_LEVEL_PATTERN, load_tokenizer
from lit_transformer.errors import DataError

SHARED_STORE_VERSION = 1  # bump when the layout or the packing rules change
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
TRAIN_INDEX = "train/index.json"
EVAL_SPLITS = ("validation", "test")
ENTRY_FILES = ("tokens.bin", "doc_starts.bin", "meta.json")  # an evaluation split's entry, meta.json last


@dataclasses.dataclass(frozen=True)
class StoreKeys:
    recipe: str  # what the recipe says about its data
    data: str  # and what prepare reads: the files and the given tokenizer


def part_name(part: int, parts: int) -> str:
    return f"part-{part:05d}-of-{parts:05d}"


def record_path(part: int, parts: int) -> str:
    return f"parts/{part_name(part, parts)}.json"


def holdout(cfg: DataConfig) -> float | None:
    """The fraction of training documents held out for validation (no data.val_files), else None."""
    return cfg.val_fraction if not cfg.val_files and cfg.val_fraction > 0 else None


def recipe_key(data_cfg: DataConfig, tok_cfg: TokenizerConfig, objective: str) -> str:
    keys = ("train_files", "val_files", "test_files", "format", "text_format", "text_column", "max_line_bytes")
    data = {k: getattr(data_cfg, k) for k in keys}
    data["val_fraction"] = holdout(data_cfg)
    tokenizer = {k: v for k, v in dataclasses.asdict(tok_cfg).items() if k != "path"}
    pattern = BYTE_LEVEL_PATTERN if tok_cfg.kind == "bpe" and tok_cfg.path is None else None
    block = block_params(objective, data_cfg)
    return cache_key("shared-store", SHARED_STORE_VERSION, objective_kind(objective), block, data, tokenizer, pattern)


def split_inputs(cfg: DataConfig) -> dict[str, list[InputFile]]:
    """Each split's input files, listed (stat or object listing only, nothing read)."""
    out = {"train": resolve_inputs(cfg.train_files, "data.train_files", cfg.format)}
    for split, key in (("validation", "val_files"), ("test", "test_files")):
        if getattr(cfg, key):
            out[split] = resolve_inputs(getattr(cfg, key), f"data.{key}", cfg.format)
    return out


def store_keys(
    data_cfg: DataConfig, tok_cfg: TokenizerConfig, objective: str, inputs: dict[str, list[InputFile]], tok_hash
) -> StoreKeys:
    recipe = recipe_key(data_cfg, tok_cfg, objective)
    files = {split: [f.fingerprint() for f in items] for split, items in sorted(inputs.items())}
    return StoreKeys(recipe, cache_key(recipe, tok_hash, files))


def file_hash(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def read_json(location: Location, rel: str) -> dict | None:
    raw = location.read_bytes(rel)
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as error:
        raise DataError(f"data.store_dir: {location.url(rel)} is not valid JSON ({error})") from None


def write_json(location: Location, rel: str, value: dict) -> None:
    location.write_bytes(rel, json.dumps(value, indent=1, sort_keys=True).encode())


def check_manifest(manifest: dict, keys: StoreKeys, location: Location, *, files: bool) -> None:
    """Refuse a store that holds other data (files=True: prepare, which compares what it read too)."""
    where = f"data.store_dir={location.url()}"
    if manifest.get("version") != SHARED_STORE_VERSION:
        raise DataError(
            f"{where} was written by store version {manifest.get('version')}, this is {SHARED_STORE_VERSION}; "
            "prepare it again into an empty data.store_dir"
        )
    if manifest["recipe"] != keys.recipe:
        raise DataError(
            f"{where} holds another recipe's data (store {manifest['recipe'][:12]}, prepared from "
            f"{manifest.get('describe', '?')}; this recipe's is {keys.recipe[:12]}): point data.store_dir "
            "elsewhere, or delete the store and prepare it again"
        )
    if files and manifest["data"] != keys.data:
        raise DataError(
            f"{where} was prepared from other contents of this recipe's files (or another tokenizer.path): "
            "the files changed since; delete the store and prepare it again, or point data.store_dir elsewhere"
        )


def missing_manifest(location: Location) -> DataError:
    return DataError(
        f"data.store_dir={location.url()} has no {MANIFEST}: its prepare has not finished (or never ran); run "
        "`lit-transformer prepare RECIPE` with this data.store_dir (every --part i/N, then --merge if no part merged)"
    )


def open_store(
    data_cfg: DataConfig, tok_cfg: TokenizerConfig, objective: str, *, model_vocab_size: int | None = None
) -> Prepared:
    """What training reads of a shared store: tokenizer, evaluation entries, the train shards' URL."""
    check_store_dir(data_cfg)
    location = open_location(data_cfg.store_dir, "data.store_dir")
    manifest = read_json(location, MANIFEST)
    if manifest is None:
        raise missing_manifest(location)
    check_manifest(manifest, StoreKeys(recipe_key(data_cfg, tok_cfg, objective), ""), location, files=False)
    local = _local_dir(location, manifest, data_cfg)
    tokenizer_path = _tokenizer_file(location, local)
    _check_tokenizer_file(tokenizer_path, manifest, tok_cfg.path)
    tokenizer = load_tokenizer(tokenizer_path)
    special = tokenizer_for_data(tokenizer, objective, model_vocab_size, data_cfg)
    entries = {
        split: eval_entry(location, manifest, split, local) for split in EVAL_SPLITS if split in manifest["splits"]
    }
    summaries = {split: dict(manifest["splits"][split], split=split, cached=True) for split in manifest["splits"]}
    return Prepared(
        objective,
        tokenizer,
        special,
        {},
        entries,
        summaries=summaries,
        tokenizer_source=location.url(TOKENIZER),
        store=location.url("train"),
        store_key=manifest["data"],
    )


def open_split(data_cfg: DataConfig, split: str, tokenizer_path) -> CacheEntry | None:
    """`split` of a shared store for an evaluation (None when the store has none), after checking
    that the store's tokenizer is the one at `tokenizer_path` (the run's)."""
    location = open_location(data_cfg.store_dir, "data.store_dir")
    manifest = read_json(location, MANIFEST)
    if manifest is None:
        raise missing_manifest(location)
    path = Path(tokenizer_path)
    _check_tokenizer_file(path / TOKENIZER if path.is_dir() else path, manifest, None)
    if split not in manifest["splits"]:
        return None
    return eval_entry(location, manifest, split, _local_dir(location, manifest, data_cfg))


def eval_entry(location: Location, manifest: dict, split: str, local: Path) -> CacheEntry:
    """An evaluation split's token cache entry: in place in a directory store, else copied."""
    if isinstance(location, LocalLocation):
        entry = open_cache(location.root, split)
    else:
        entry = open_cache(_copied(location, [f"{split}/{name}" for name in ENTRY_FILES], local / split).parent, split)
    if entry is None:
        raise DataError(f"data.store_dir={location.url()}: its {split} split ({location.url(split)}) is missing")
    return entry


def work_root(cfg: DataConfig) -> Path:
    """Temporary files of prepare and merge: under the cache directory, on its disk."""
    root = cache_root(cfg.cache_dir) / "tmp"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _local_dir(location: Location, manifest: dict, data_cfg: DataConfig) -> Path:
    """Where an object store's tokenizer and evaluation splits are copied on this node."""
    if isinstance(location, LocalLocation):
        return location.root
    return cache_root(data_cfg.cache_dir) / "stores" / manifest["data"][:32]


def _tokenizer_file(location: Location, local: Path) -> Path:
    if isinstance(location, LocalLocation):
        return location.root / TOKENIZER
    return _copied(location, [TOKENIZER], local / "tokenizer") / TOKENIZER


def _copied(location: Location, rels: list[str], target: Path) -> Path:
    """The folder `target` holding `rels`, copied once per node: under the cache's lock, into a
    temporary folder renamed into place (a copy interrupted halfway is never opened)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with cache_lock(target.parent):
        if not target.exists():
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
            try:
                for rel in rels:
                    location.download(rel, tmp / Path(rel).name)
                tmp.rename(target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _check_tokenizer_file(path, manifest: dict, given: str | None) -> None:
    """The store's tokenizer is the one its manifest names, and the recipe's tokenizer.path (where
    this node has it) or the run's tokenizer.json is that same file."""
    if file_hash(path) != manifest["tokenizer"]:
        raise DataError(f"{path}: not the tokenizer the store was prepared with (its manifest names another)")
    if given is not None and Path(given).is_file() and file_hash(given) != manifest["tokenizer"]:
        raise DataError(
            f"tokenizer.path={given} is not the tokenizer data.store_dir was prepared with; prepare the store "
            "again with it, or leave tokenizer.path to the store's"
        )


# ----------------------------------------------------------------------------- the merge


def merge_parts(
    location: Location, keys, parts: int, cfg: DataConfig, objective: str, *, required: bool
) -> dict | None:
    """Write the merged index, the evaluation splits and the manifest (last) once every part's
    record is there; None when some are missing (`required`: a one-line error naming them)."""
    records = [read_json(location, record_path(i, parts)) for i in range(parts)]
    missing = [i for i, r in enumerate(records) if r is None]
    if missing:
        if not required:
            return None
        raise DataError(
            f"data.store_dir={location.url()}: part(s) {', '.join(map(str, missing))} of {parts} have not finished "
            f"(no {record_path(missing[0], parts)}); run `prepare --part i/{parts}` for each"
        )
    for i, record in enumerate(records):
        if record["data"] != keys.data:
            raise DataError(
                f"data.store_dir={location.url()}: part {i}/{parts} was prepared from other data (another recipe, "
                "other files or another tokenizer.path); prepare it again with this recipe"
            )
    raw = location.read_bytes(TOKENIZER)
    tok = hashlib.sha256(raw).hexdigest() if raw is not None else None
    if {r["tokenizer"] for r in records} != {tok}:
        raise DataError(f"data.store_dir={location.url()}: the parts were tokenized with different tokenizers")
    block_len, stride = block_params(objective, cfg)
    trains = [r["splits"]["train"] for r in records]
    configs = [t["config"] for t in trains if t["config"] is not None]
    if not configs:
        raise DataError(
            f"train split of {', '.join(cfg.train_files)}: no file holds {block_len} tokens, one block "
            "(each file is packed on its own with data.store_dir: add text or lower data.block_size)"
        )
    index = {"chunks": [c for t in trains for c in t["chunks"]], "config": configs[0], "updated_at": str(time.time())}
    write_json(location, TRAIN_INDEX, index)
    splits = {"train": _summed(trains, ("documents", "bytes", "tokens", "blocks", "dropped_tokens"))}
    splits["train"]["files"] = sum(len(t["files"]) for t in trains)
    work = Path(tempfile.mkdtemp(prefix=".tmp-merge-", dir=work_root(cfg)))
    try:
        for split in EVAL_SPLITS:
            pieces = [(i, r["splits"][split]) for i, r in enumerate(records) if split in r["splits"]]
            if pieces:
                splits[split] = _merge_stream(location, split, pieces, parts, block_len, stride, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    manifest = {
        "version": SHARED_STORE_VERSION,
        "recipe": keys.recipe,
        "data": keys.data,
        "tokenizer": tok,
        "parts": parts,
        "block_len": block_len,
        "stride": stride,
        "describe": ", ".join(cfg.train_files),
        "splits": splits,
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_json(location, MANIFEST, manifest)  # last: now the store is complete
    return manifest


def _summed(items: list[dict], keys) -> dict:
    out = {k: sum(int(x[k]) for x in items) for k in keys}
    read = collections.Counter()
    for x in items:
        read.update(x.get("read", {}))
    out["read"] = dict(read)
    return out


def _merge_stream(location: Location, split: str, pieces, parts: int, block_len: int, stride: int, work: Path) -> dict:
    """The parts' pieces of `split`, concatenated in part (= file) order into one cache entry."""
    dtype = pieces[0][1]["arrays"]["tokens"]["dtype"]
    writer = CacheWriter(work, split)
    tokens, starts = writer.array("tokens", dtype), writer.array("doc_starts", np.int64)
    total = 0
    for i, _ in pieces:
        rel = f"parts/{part_name(i, parts)}/{split}"
        for name in ("tokens.bin", "doc_starts.bin"):
            location.download(f"{rel}/{name}", work / f"{i}-{name}")
        piece = np.fromfile(work / f"{i}-tokens.bin", dtype=dtype)
        tokens.append(piece)
        starts.append(np.fromfile(work / f"{i}-doc_starts.bin", dtype=np.int64) + total)
        total += int(piece.size)
    summed = _summed([p for _, p in pieces], ("documents", "bytes", "tokens"))
    blocks = num_blocks(total, block_len, stride)
    if blocks == 0:
        raise DataError(
            f"{split} split: {summed['documents']} documents, {total} tokens: not enough for one block of "
            f"{block_len} tokens (add text or lower data.block_size)"
        )
    meta = dict(summed, kind="lm", blocks=blocks, block_len=block_len, stride=stride)
    meta.update(dropped_tokens=total - ((blocks - 1) * stride + block_len), bytes_per_token=summed["bytes"] / total)
    entry = writer.commit(meta)
    for name in ENTRY_FILES:  # meta.json last
        location.upload(entry.path / name, f"{split}/{name}")
    return {k: meta[k] for k in ("documents", "bytes", "tokens", "blocks", "dropped_tokens", "read")}
