"""Which examples each split holds, for each objective, and a cheap fingerprint of them.

`build_sources(cfg, objective)` returns {'train' | 'validation' | 'test': SplitSource}. A
source reads nothing until iterated; its fingerprint only stats the files (or hashes the
embedded corpus), so a cache hit costs no tokenization and almost no reading.

Iterating a source yields, by kind:
- 'lm' (mlm / clm / span): documents (str);
- 'classify': (text, text_pair or None, raw label);
- 'seq2seq': (source, target).

Without `val_files`, validation is held out of the training files by a stable hash of each
example's text (`data.val_fraction`), so the same text never lands in both splits. Caps
(`max_documents`, `max_train_bytes`, `max_val_bytes`) keep documents in order until the byte
cap; the document that crosses it is cut at a line boundary.

Positions (streaming resume): `SplitSource.position(stats)` is a small dict saying where the
next item starts; `iterate(stats, start=position)` resumes there without reading what came
before: text and jsonl files by seeking to (file, byte offset), parquet files at (file, row
group, row), csv/tsv/json files and hub streams through `datasets`' IterableDataset state
(earlier files and shards are not read; `datasets` reads the current one up to the position).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lit_transformer.data.data_config import LM_OBJECTIVES, DataConfig, check_objective
from lit_transformer.data.sources import files as F
from lit_transformer.data.sources import stdlib
from lit_transformer.data.sources.files import ReadStats
from lit_transformer.errors import DataError


def objective_kind(objective: str) -> str:
    check_objective(objective)
    return "lm" if objective in LM_OBJECTIVES else objective


@dataclass
class SplitSource:
    split: str
    kind: str
    describe: str  # for messages and summaries: the files, or "embedded stdlib ..."
    _fingerprint: Callable[[], Any]
    _iterate: Callable[[ReadStats, dict | None], Iterator]

    def fingerprint(self) -> str:
        if not hasattr(self, "_fp"):
            payload = json.dumps([self.split, self.kind, self._fingerprint()], sort_keys=True, default=str)
            self._fp = hashlib.sha256(payload.encode()).hexdigest()
        return self._fp

    def iterate(self, stats: ReadStats, start: dict | None = None) -> Iterator:
        """The split's items, from `start` (a `position` of an earlier iteration) when given."""
        if start is not None:
            stats.documents, stats.bytes = start["documents"], start["bytes"]  # the caps go on counting
            stats.cursor = {k: v for k, v in start.items() if k not in ("documents", "bytes")}
        return self._iterate(stats, start)

    @staticmethod
    def position(stats: ReadStats) -> dict:
        """Where the item after the last one yielded starts (small: JSON-able numbers and dicts)."""
        return {**stats.cursor, "documents": stats.documents, "bytes": stats.bytes}


def build_sources(cfg: DataConfig, objective: str, *, streaming: bool | None = None) -> dict[str, SplitSource]:
    kind = objective_kind(objective)
    streaming = cfg.streaming if streaming is None else streaming
    aligned = kind == "seq2seq" and (cfg.source_files or cfg.val_source_files)
    if cfg.test_files and (cfg.hub_name or aligned or not cfg.train_files):
        other = "data.hub_name" if cfg.hub_name else "data.source_files" if aligned else "the embedded corpus"
        raise DataError(
            f"data.test_files={cfg.test_files}: a test split is read beside data.train_files, not with {other}"
        )
    if cfg.hub_name:
        return _hub_sources(cfg, kind, streaming)
    if aligned:
        return _aligned_sources(cfg)
    if not cfg.train_files:
        return _embedded_sources(cfg, kind)
    return _file_sources(cfg, kind, streaming)


# ----------------------------------------------------------------------------- embedded


def _embedded_sources(cfg: DataConfig, kind: str) -> dict[str, SplitSource]:
    out = {}
    if kind == "lm":
        for split in ("train", "validation"):

            def iterate(stats, start=None, split=split):
                paths = [path for _, path in stdlib.corpus_split(split, cfg.val_fraction or 0.02)]
                stats.files.extend(str(p) for p in paths)
                yield from _text_files(paths, "file", cfg.max_line_bytes, stats, start)

            out[split] = SplitSource(
                split,
                kind,
                f"embedded stdlib corpus ({split})",
                lambda: ["stdlib", stdlib.corpus_fingerprint(cfg.val_fraction or 0.02), cfg.max_line_bytes],
                _capped(iterate, cfg, split),
            )
        return out
    examples = stdlib.classification_examples if kind == "classify" else stdlib.seq2seq_examples
    for split in ("train", "validation", "test"):

        def iterate(stats, start=None, split=split):
            items = examples()[split]
            rows = (
                (ex["text"], None, ex["label"]) if kind == "classify" else (ex["source"], ex["target"]) for ex in items
            )
            yield from _counted(rows, stats, start)

        out[split] = SplitSource(
            split,
            kind,
            f"embedded stdlib {kind} task ({split})",
            lambda: stdlib.task_fingerprint(kind),
            _capped(iterate, cfg, split),
        )
    return out


# ----------------------------------------------------------------------------- local files


def _file_sources(cfg: DataConfig, kind: str, streaming: bool) -> dict[str, SplitSource]:
    train = F.resolve_files(cfg.train_files, "data.train_files", cfg.format)
    out = {}
    holdout = cfg.val_fraction if not cfg.val_files and cfg.val_fraction > 0 else None
    out["train"] = _files_source(
        "train", kind, train, cfg, streaming, "data.train_files", holdout=(holdout, False) if holdout else None
    )
    if cfg.val_files:
        val = F.resolve_files(cfg.val_files, "data.val_files", cfg.format)
        out["validation"] = _files_source("validation", kind, val, cfg, streaming, "data.val_files")
    elif holdout:
        out["validation"] = _files_source(
            "validation", kind, train, cfg, streaming, "data.train_files", holdout=(holdout, True)
        )
    if cfg.test_files:
        test = F.resolve_files(cfg.test_files, "data.test_files", cfg.format)
        out["test"] = _files_source("test", kind, test, cfg, streaming, "data.test_files")
    return out


def _files_source(
    split, kind, paths: list[Path], cfg: DataConfig, streaming: bool, key: str, holdout=None
) -> SplitSource:
    fmt = F.split_format(paths, cfg.format, key)
    names = ", ".join(str(p) for p in paths[:3]) + (f" (+{len(paths) - 3} more)" if len(paths) > 3 else "")
    if fmt == "text" and kind != "lm":
        raise DataError(
            f"{key}: {names} are plain text; {kind} data needs jsonl/json/csv/tsv/parquet with "
            + (
                "data.text_column and data.label_column"
                if kind == "classify"
                else "data.source_column and data.target_column (or data.source_files/target_files)"
            )
        )
    columns = _columns(cfg, kind)

    def iterate(stats: ReadStats, start: dict | None = None):
        stats.files.extend(str(p) for p in paths)
        if fmt == "text":
            yield from _text_files(paths, cfg.text_format, cfg.max_line_bytes, stats, start)
            return
        if streaming and fmt in ("jsonl", "parquet"):  # read here, not by `datasets`: a position is a seek
            yield from _rows(_file_rows(paths, fmt, columns, names, stats, start), kind, columns, stats)
            return
        table = F.load_table(paths, fmt, key, streaming=streaming, num_proc=cfg.num_proc, cache_dir=_hf_cache(cfg))
        yield from _table_rows(table, kind, columns, names, stats, cfg.task, start)

    def fingerprint():
        return ["files", F.files_fingerprint(paths), fmt, cfg.text_format, cfg.max_line_bytes, columns, holdout]

    it = _held_out(iterate, kind, *holdout) if holdout else iterate
    return SplitSource(split, kind, names, fingerprint, _capped(it, cfg, split))


def _aligned_sources(cfg: DataConfig) -> dict[str, SplitSource]:
    out = {}
    for split, src_key, tgt_key in (
        ("train", "source_files", "target_files"),
        ("validation", "val_source_files", "val_target_files"),
    ):
        if not getattr(cfg, src_key):
            continue
        src = F.resolve_files(getattr(cfg, src_key), f"data.{src_key}")
        tgt = F.resolve_files(getattr(cfg, tgt_key), f"data.{tgt_key}")
        if len(src) != len(tgt):
            raise DataError(f"data.{src_key} matches {len(src)} files but data.{tgt_key} matches {len(tgt)}")

        def iterate(stats, start=None, src=src, tgt=tgt):
            def pairs():
                for a, b in zip(src, tgt):
                    stats.files.extend([str(a), str(b)])
                    yield from F.aligned_lines(a, b, cfg.max_line_bytes, stats)

            yield from _counted(pairs(), stats, start)  # seq2seq does not stream: resumed by counting

        names = ", ".join(f"{a} ~ {b}" for a, b in zip(src, tgt))
        out[split] = SplitSource(
            split,
            "seq2seq",
            names,
            lambda src=src, tgt=tgt: ["aligned", F.files_fingerprint(src + tgt), cfg.max_line_bytes],
            _capped(iterate, cfg, split),
        )
    if "validation" not in out and cfg.val_fraction > 0:
        train = out["train"]
        out["validation"] = SplitSource(
            "validation",
            "seq2seq",
            train.describe,
            lambda: ["holdout", train.fingerprint(), cfg.val_fraction],
            _held_out(train._iterate, "seq2seq", cfg.val_fraction, True),
        )
        out["train"] = SplitSource(
            "train",
            "seq2seq",
            train.describe,
            lambda: ["holdout-train", train.fingerprint(), cfg.val_fraction],
            _held_out(train._iterate, "seq2seq", cfg.val_fraction, False),
        )
    return out


# ----------------------------------------------------------------------------- hub


def _hub_sources(cfg: DataConfig, kind: str, streaming: bool) -> dict[str, SplitSource]:
    F.hub_available(cfg.hub_name)
    columns = _columns(cfg, kind)
    where = f"data.hub_name={cfg.hub_name!r}"
    out = {}
    splits = [("train", cfg.hub_train_split)]
    if cfg.hub_val_split:
        splits.append(("validation", cfg.hub_val_split))
    for split, hub_split in splits:

        def load(hub_split=hub_split):
            return F.load_hub(cfg.hub_name, cfg.hub_config, hub_split, streaming=streaming, cache_dir=_hf_cache(cfg))

        def iterate(stats, start=None, load=load):
            stats.files.append(f"{cfg.hub_name}:{cfg.hub_config}")
            yield from _table_rows(load(), kind, columns, where, stats, cfg.task, start)

        def fingerprint(load=load, hub_split=hub_split):
            ds = load()
            return ["hub", cfg.hub_name, cfg.hub_config, hub_split, getattr(ds, "_fingerprint", None), columns]

        out[split] = SplitSource(
            split, kind, f"{cfg.hub_name} ({hub_split})", fingerprint, _capped(iterate, cfg, split)
        )
    return out


# ----------------------------------------------------------------------------- helpers


def _columns(cfg: DataConfig, kind: str) -> dict[str, str | None]:
    if kind == "lm":
        return {"data.text_column": cfg.text_column}
    if kind == "classify":
        return {
            "data.text_column": cfg.text_column,
            "data.text_pair_column": cfg.text_pair_column,
            "data.label_column": cfg.label_column,
        }
    return {"data.source_column": cfg.source_column, "data.target_column": cfg.target_column}


def _hf_cache(cfg: DataConfig) -> str:
    from lit_transformer.data.tokens.cache import cache_root

    return str(cache_root(cfg.cache_dir) / "hf")


def _text_files(paths: list[Path], text_format: str, max_line_bytes: int, stats: ReadStats, start) -> Iterator[str]:
    """The documents of text files; position: (file index, byte offset of the next document)."""
    first, offset = (start["file"], start["offset"]) if start and "file" in start else (0, 0)
    for i in range(first, len(paths)):
        for doc in F.iter_text_documents(paths[i], text_format, max_line_bytes, stats, offset if i == first else 0):
            stats.cursor = {"file": i, "offset": stats.offset}
            yield doc


def _counted(items: Iterator, stats: ReadStats, start) -> Iterator:
    """Items with their count as position; resuming skips that many (for sources that do not stream)."""
    skip = start["row"] if start and "row" in start else 0
    for i, item in enumerate(items):
        if i >= skip:
            stats.cursor = {"row": i + 1}
            yield item


def _table_rows(table, kind, columns, where, stats: ReadStats, task: str, start=None) -> Iterator:
    """Rows of a `datasets` table. Position: the IterableDataset's `state_dict()` before the batch
    of 1000 rows that holds the next row, and the row's index in it; a map-style Dataset (the
    cached path) has no state: its position counts rows from the start."""
    cols = list(columns.values())
    checked = False
    resumable = hasattr(table, "state_dict") and hasattr(table, "load_state_dict")
    skip = start["row"] if start and "row" in start else 0
    if resumable and start and start.get("table") is not None:
        table.load_state_dict(start["table"])
    state = table.state_dict() if resumable else None
    base = 0  # index of the batch's first row: in the batch (resumable), else from the start
    for batch in table.iter(batch_size=1000):
        if not checked:
            F.require_columns(batch.keys(), columns, where)
            checked = True
        values = [batch[c] if c is not None else [None] * len(batch[cols[0]]) for c in cols]
        rows = enumerate(zip(*values), base)
        yield from _rows(((row, {"table": state, "row": r + 1}) for r, row in rows if r >= skip), kind, columns, stats)
        if resumable:
            state, skip = table.state_dict(), 0
        else:
            base += len(values[0])


def _file_rows(paths: list[Path], fmt: str, columns, where, stats: ReadStats, start) -> Iterator[tuple[tuple, dict]]:
    """(row, position after it) of jsonl (file, byte offset) or parquet (file, row group, row) files."""
    cols = list(columns.values())
    resumed = start is not None and "file" in start  # a position after a row: columns checked then
    first = start["file"] if resumed else 0
    for i in range(first, len(paths)):
        at = start if resumed and i == first else None
        if fmt == "jsonl":
            rows = F.iter_jsonl(
                paths[i], stats, at["offset"] if at else 0, columns=None if at else columns, where=where
            )
            for row in rows:
                yield tuple(row.get(c) if c is not None else None for c in cols), {"file": i, "offset": stats.offset}
        else:
            for group, r, row in F.iter_parquet(paths[i], columns, where, (at["group"], at["row"]) if at else (0, 0)):
                yield row, {"file": i, "group": group, "row": r + 1}


def _rows(rows: Iterator[tuple[tuple, dict]], kind, columns, stats: ReadStats) -> Iterator:
    """The items of (row, position after it) pairs; blank or incomplete examples are dropped."""
    for row, cursor in rows:
        stats.cursor = cursor
        if kind == "lm":
            if isinstance(row[0], str) and row[0].strip():
                yield row[0]
            continue
        if kind == "classify":
            text, pair, label = row
            bad = (
                not _nonblank(text)
                or label is None
                or (columns["data.text_pair_column"] is not None and not _nonblank(pair))
            )
        else:
            bad = not _nonblank(row[0]) or not _nonblank(row[1])
        if bad:
            stats.skipped_examples += 1
            continue
        yield tuple(row)


def _nonblank(value) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _text_of(item, kind) -> str:
    if kind == "lm":
        return item
    return item[0] if kind == "seq2seq" else "\x1f".join(t for t in item[:2] if t is not None)


def _held_out(iterate, kind, fraction: float, keep_val: bool):
    def held(stats, start=None):
        for item in iterate(stats, start):
            if (stdlib.hash_fraction(_text_of(item, kind)) < fraction) == keep_val:
                yield item

    return held


def _size(item, kind) -> int:
    if kind == "lm":
        return len(item.encode("utf-8", "surrogatepass"))
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in item[:2] if isinstance(t, str))


def _capped(iterate, cfg: DataConfig, split: str):
    max_docs = cfg.max_documents if split == "train" else None
    max_bytes = cfg.max_train_bytes if split == "train" else cfg.max_val_bytes if split == "validation" else None

    def capped(stats: ReadStats, start: dict | None = None):
        if start is not None and start.get("ended"):
            return
        for item in iterate(stats, start):
            kind = "lm" if isinstance(item, str) else ("seq2seq" if len(item) == 2 else "classify")
            size = _size(item, kind)
            if max_bytes is not None and stats.bytes + size > max_bytes:
                if kind == "lm":  # cut the crossing document at a line boundary
                    room = max_bytes - stats.bytes
                    cut = item.encode("utf-8", "surrogatepass")[:room].decode("utf-8", "ignore")
                    cut = cut[: cut.rfind("\n") + 1] if "\n" in cut else ""
                    if cut.strip():
                        stats.documents += 1
                        stats.bytes += len(cut.encode("utf-8", "surrogatepass"))
                        stats.cursor = {**stats.cursor, "ended": True}  # a resumed read stops here too
                        yield cut
                return
            stats.documents += 1
            stats.bytes += size
            if max_docs is not None and stats.documents >= max_docs:
                stats.cursor = {**stats.cursor, "ended": True}
                yield item
                return
            yield item

    return capped


def fingerprint_config(cfg: DataConfig) -> dict:
    """The data settings that decide what a split holds (for cache keys)."""
    keys = ("max_documents", "max_train_bytes", "max_val_bytes", "val_fraction", "task")
    d = asdict(cfg)
    return {k: d[k] for k in keys}
