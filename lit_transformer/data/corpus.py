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
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lit_transformer.data import files as F
from lit_transformer.data import stdlib
from lit_transformer.data.errors import DataError
from lit_transformer.data.files import ReadStats
from lit_transformer.data.settings import LM_OBJECTIVES, DataConfig, check_objective


def objective_kind(objective: str) -> str:
    check_objective(objective)
    return "lm" if objective in LM_OBJECTIVES else objective


@dataclass
class SplitSource:
    split: str
    kind: str
    describe: str  # for messages and summaries: the files, or "embedded stdlib ..."
    _fingerprint: Callable[[], Any]
    _iterate: Callable[[ReadStats], Iterator]

    def fingerprint(self) -> str:
        if not hasattr(self, "_fp"):
            payload = json.dumps([self.split, self.kind, self._fingerprint()], sort_keys=True, default=str)
            self._fp = hashlib.sha256(payload.encode()).hexdigest()
        return self._fp

    def iterate(self, stats: ReadStats) -> Iterator:
        return self._iterate(stats)


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

            def iterate(stats, split=split):
                for _, path in stdlib.corpus_split(split, cfg.val_fraction or 0.02):
                    stats.files.append(str(path))
                    yield from F.iter_text_documents(path, "file", cfg.max_line_bytes, stats)

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

        def iterate(stats, split=split):
            for ex in examples()[split]:
                yield (ex["text"], None, ex["label"]) if kind == "classify" else (ex["source"], ex["target"])

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

    def iterate(stats: ReadStats):
        stats.files.extend(str(p) for p in paths)
        if fmt == "text":
            for path in paths:
                yield from F.iter_text_documents(path, cfg.text_format, cfg.max_line_bytes, stats)
            return
        table = F.load_table(paths, fmt, key, streaming=streaming, num_proc=cfg.num_proc, cache_dir=_hf_cache(cfg))
        yield from _table_rows(table, kind, columns, names, stats, cfg.task)

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

        def iterate(stats, src=src, tgt=tgt):
            for a, b in zip(src, tgt):
                stats.files.extend([str(a), str(b)])
                yield from F.aligned_lines(a, b, cfg.max_line_bytes, stats)

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

        def iterate(stats, load=load):
            stats.files.append(f"{cfg.hub_name}:{cfg.hub_config}")
            yield from _table_rows(load(), kind, columns, where, stats, cfg.task)

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
    from lit_transformer.data.cache import cache_root

    return str(cache_root(cfg.cache_dir) / "hf")


def _table_rows(table, kind, columns, where, stats: ReadStats, task: str) -> Iterator:
    cols = list(columns.values())
    checked = False
    for batch in table.iter(batch_size=1000):
        if not checked:
            F.require_columns(batch.keys(), columns, where)
            checked = True
        values = [batch[c] if c is not None else [None] * len(batch[cols[0]]) for c in cols]
        for row in zip(*values):
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
    def held(stats):
        for item in iterate(stats):
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

    def capped(stats: ReadStats):
        for item in iterate(stats):
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
                        yield cut
                return
            stats.documents += 1
            stats.bytes += size
            yield item
            if max_docs is not None and stats.documents >= max_docs:
                return

    return capped


def fingerprint_config(cfg: DataConfig) -> dict:
    """The data settings that decide what a split holds (for cache keys)."""
    keys = ("max_documents", "max_train_bytes", "max_val_bytes", "val_fraction", "task")
    d = asdict(cfg)
    return {k: d[k] for k in keys}
