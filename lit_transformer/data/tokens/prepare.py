"""Prepare a run's data: train or load the tokenizer, tokenize each split once into the cache.

`prepare(...)` is what `lit-transformer prepare RECIPE` runs; the data module's
`prepare_data` / `setup` share `build`. Cache keys (cache.py) make a second call, and every
DDP rank, open the stored arrays without tokenizing: a trained tokenizer is itself cached,
keyed by the training split's fingerprint and the tokenizer settings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from lit_transformer.data.batches.span_sizes import span_lengths
from lit_transformer.data.data_config import DataConfig, TokenizerConfig, check_objective
from lit_transformer.data.sources.corpus import SplitSource, build_sources, fingerprint_config, objective_kind
from lit_transformer.data.sources.files import ReadStats
from lit_transformer.data.tokens import examples, pack
from lit_transformer.data.tokens.cache import CacheEntry, CacheWriter, cache_key, cache_root, open_cache
from lit_transformer.data.tokens.tokenizer import (
    BYTE_LEVEL_PATTERN,
    SpecialTokens,
    check_tokenizer,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)
from lit_transformer.errors import DataError

STREAMING_TOKENIZER_BYTES = 256 << 20  # streaming corpora: train the tokenizer on the first 256 MB


@dataclass
class Prepared:
    objective: str
    tokenizer: Tokenizer
    special: SpecialTokens
    sources: dict[str, SplitSource]
    entries: dict[str, CacheEntry] = field(default_factory=dict)  # empty when streaming
    label_names: list | None = None
    summaries: dict[str, dict] = field(default_factory=dict)
    tokenizer_source: str = ""  # "trained", "cached" or the loaded path
    store: Path | str | None = None  # data.store=litdata: the train split's shards (store.py), or a shared store's URL
    store_key: str | None = None  # a shared store's data fingerprint (store_manifest.py)


def tokenizer_for_data(tokenizer, objective: str, model_vocab_size: int | None, cfg: DataConfig):
    """check_tokenizer with the data section's block and span settings: the special tokens, or a
    one-line DataError where the tokenizer cannot feed this objective and model."""
    return check_tokenizer(
        tokenizer,
        objective,
        model_vocab_size,
        block_size=cfg.block_size,
        noise_density=cfg.noise_density,
        mean_span_length=cfg.mean_span_length,
    )


def block_params(objective: str, cfg: DataConfig) -> tuple[int, int]:
    """(tokens per stored example, stride) of packed LM blocks (pack.py)."""
    if objective == "clm":
        return cfg.block_size + 1, cfg.block_size
    if objective == "span":
        raw = span_lengths(cfg.block_size, cfg.noise_density, cfg.mean_span_length).raw_length
        return raw, raw
    return cfg.block_size, cfg.block_size


def _training_texts(source: SplitSource, stats: ReadStats):
    for item in source.iterate(stats):
        if isinstance(item, str):
            yield item
        else:
            yield from (t for t in item[:2] if isinstance(t, str))


def resolve_tokenizer(
    data_cfg: DataConfig, tok_cfg: TokenizerConfig, sources: dict[str, SplitSource], *, build: bool
) -> tuple[Tokenizer, str, str]:
    """(tokenizer, where it came from, the sha256 of its tokenizer.json file: the token caches'
    key; hashing the file is cheaper than serialising the loaded tokenizer again: docs/defaults.md)."""
    if tok_cfg.path:
        path = Path(tok_cfg.path)
        return load_tokenizer(path), str(path), _file_hash(path / "tokenizer.json" if path.is_dir() else path)
    train = sources["train"]
    # the pattern is part of what training builds: a tokenizer trained with an earlier one is not reused
    key = cache_key(
        "tokenizer",
        train.fingerprint(),
        fingerprint_config(data_cfg),
        dataclasses.asdict(tok_cfg),
        BYTE_LEVEL_PATTERN if tok_cfg.kind == "bpe" else None,
    )
    path = cache_root(data_cfg.cache_dir) / "tokenizers" / f"{key}.json"
    if path.is_file():
        return load_tokenizer(path), "cached", _file_hash(path)
    if not build:
        raise DataError(f"no trained tokenizer at {path}; run prepare_data (lit-transformer prepare) first")
    cfg = tok_cfg
    if data_cfg.streaming and cfg.max_train_bytes is None:
        cfg = dataclasses.replace(cfg, max_train_bytes=STREAMING_TOKENIZER_BYTES)
    tok = train_tokenizer(_training_texts(train, ReadStats()), cfg, describe=f"train split of {train.describe}")
    save_tokenizer(tok, path)
    return load_tokenizer(path), "trained", _file_hash(path)  # reloaded: what a later cache hit loads


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(
    data_cfg: DataConfig,
    tok_cfg: TokenizerConfig,
    objective: str,
    *,
    build: bool = True,
    model_vocab_size: int | None = None,
) -> Prepared:
    """Tokenizer plus one cache entry per split; `build=False` only opens what exists."""
    check_objective(objective)
    kind = objective_kind(objective)
    if data_cfg.streaming and kind != "lm":
        raise DataError(f"data.streaming=true is for LM objectives (mlm, clm, span), not {objective!r}")
    if data_cfg.store != "cache":  # before any tokenizing: a missing extra is the first thing said
        if kind != "lm":
            raise DataError(f"data.store={data_cfg.store} is for LM objectives (mlm, clm, span), not {objective!r}")
        require_litdata()
    sources = build_sources(data_cfg, objective)
    tokenizer, origin, tok_hash = resolve_tokenizer(data_cfg, tok_cfg, sources, build=build)
    special = tokenizer_for_data(tokenizer, objective, model_vocab_size, data_cfg)
    out = Prepared(objective, tokenizer, special, sources, tokenizer_source=origin)
    if data_cfg.streaming:
        return out
    root = cache_root(data_cfg.cache_dir)
    for split in ("train", "validation", "test"):
        if split not in sources:
            continue
        t0 = time.perf_counter()
        entry, cached = split_entry(sources[split], objective, data_cfg, out, tok_hash, build=build)
        if kind == "classify" and split == "train":
            out.label_names = entry.meta["label_names"]
        out.entries[split] = entry
        out.summaries[split] = _summary(split, entry, cached, time.perf_counter() - t0)
    if "train" not in out.entries:
        raise DataError("no training split: set data.train_files (or leave it empty for the embedded corpus)")
    if data_cfg.store == "litdata":
        from lit_transformer.data.tokens import store  # imports litdata: an optional extra, checked above

        out.store, seconds, written = store.write_store(
            root, out.entries["train"], num_proc=data_cfg.num_proc, build=build
        )
        out.summaries["train"]["store"] = {"path": str(out.store), "seconds": round(seconds, 3), "cached": not written}
    return out


def split_entry(
    source: SplitSource, objective: str, data_cfg: DataConfig, out: Prepared, tok_hash: str, *, build: bool
) -> tuple[CacheEntry, bool]:
    """(the token cache entry of one split, whether it was there already): opened, or written
    when `build`. A classification split other than train is numbered by out.label_names (the
    training split's labels), which are part of its key."""
    kind = objective_kind(objective)
    if kind == "lm":
        options = ["lm", *block_params(objective, data_cfg)]
    elif kind == "classify":
        labels = out.label_names if source.split != "train" else None
        options = ["classify", data_cfg.max_length, data_cfg.task, data_cfg.text_pair_column, labels]
    else:
        options = ["seq2seq", data_cfg.max_length, data_cfg.max_target_length]
    root = cache_root(data_cfg.cache_dir)
    key = cache_key(source.fingerprint(), fingerprint_config(data_cfg), tok_hash, options)
    entry = open_cache(root, key)
    if entry is not None:
        return entry, True
    if not build:
        raise DataError(
            f"{source.split} split of {source.describe}: no token cache at {root / key}; "
            "run prepare_data (lit-transformer prepare) first"
        )
    entry = _write_split(root, key, source, kind, objective, data_cfg, out.tokenizer, out.special, out.label_names)
    return entry, False


def require_litdata() -> None:
    """data.store=litdata's package, or a one-line error naming the extra that installs it."""
    try:
        import litdata  # noqa: F401
    except ImportError as exc:
        raise DataError(
            f"data.store=litdata needs the litdata package ({exc}): install the `store` extra "
            "(scripts/install.sh does; by hand: pip install -e '.[store]' && pip install --no-deps "
            "litdata==0.2.76, docs/data.md) or set data.store=cache"
        ) from exc


def _write_split(root, key, source: SplitSource, kind, objective, cfg: DataConfig, tokenizer, special, label_names):
    stats = ReadStats()
    with CacheWriter(root, key) as writer:
        if kind == "lm":
            block_len, stride = block_params(objective, cfg)
            # cfg.num_proc only changes how fast: it is not in the cache key (fingerprint_config)
            return pack.write_lm(
                source.iterate(stats),
                tokenizer,
                special,
                writer,
                stats,
                block_len=block_len,
                stride=stride,
                describe=f"{source.split} split of {source.describe}",
                num_proc=cfg.num_proc,
            )
        items = list(source.iterate(stats))
        if not items:
            raise DataError(
                f"{source.split} split of {source.describe}: no examples ({stats.skipped_examples} blank ones skipped)"
            )
        meta = {
            "kind": kind,
            "examples": len(items),
            "documents": len(items),
            "bytes": stats.bytes,
            "read": pack._stats_dict(stats),
        }
        if kind == "classify":
            texts = [it[0] for it in items]
            pairs = [it[1] for it in items] if cfg.text_pair_column else None
            raw = [it[2] for it in items]
            if label_names is None:
                label_names = examples.label_names_for(cfg.task, raw, source.describe)
            labels = examples.encode_labels(cfg.task, raw, label_names, f"{source.split} split of {source.describe}")
            ids, types = examples.segment_ids(tokenizer, special, texts, pairs, cfg.max_length)
            examples.write_ragged(
                writer, "ids", ids, pack.token_dtype(tokenizer.get_vocab_size(with_added_tokens=True))
            )
            examples.write_ragged(writer, "type_ids", types, np.uint8)
            writer.array("labels", labels.dtype, labels.shape[1:]).append(labels)
            meta.update(label_names=label_names, task=cfg.task, tokens=int(sum(map(len, ids))))
        else:
            end = special.eos_id if special.eos_id is not None else special.sep_id
            encoder = pack.fast_copy(tokenizer)
            src = [
                examples.truncate_with_end(e.ids, cfg.max_length, end)
                for e in encoder.encode_batch_fast([it[0] for it in items], add_special_tokens=False)
            ]
            tgt = [
                examples.truncate_with_end(e.ids, cfg.max_target_length, end)
                for e in encoder.encode_batch_fast([it[1] for it in items], add_special_tokens=False)
            ]
            dtype = pack.token_dtype(tokenizer.get_vocab_size(with_added_tokens=True))
            examples.write_ragged(writer, "source", src, dtype)
            examples.write_ragged(writer, "target", tgt, dtype)
            meta.update(tokens=int(sum(map(len, src)) + sum(map(len, tgt))))
        return writer.commit(meta)


def _summary(split: str, entry: CacheEntry, cached: bool, seconds: float) -> dict:
    m = entry.meta
    return {
        "split": split,
        "documents": m["documents"],
        "tokens": m["tokens"],
        "blocks": m.get("blocks", m.get("examples")),
        "seconds": round(seconds, 3),
        "mb_per_s": round(m["bytes"] / 1e6 / max(seconds, 1e-9), 2),
        "cached": cached,
        "bytes_per_token": round(m["bytes"] / max(m["tokens"], 1), 4),
        "read": m.get("read", {}),
        "path": str(entry.path),
    }


def format_summary(s: dict) -> str:
    unit = "blocks" if "lm" in s.get("kind", "lm") else "examples"
    notes = "; ".join(f"{k}={v}" for k, v in s.get("read", {}).items() if v)
    return (
        f"{s['split']:<10} {s['documents']:>9,} documents {s['tokens']:>12,} tokens {s['blocks']:>9,} {unit} "
        f"{s['seconds']:>8.2f} s {s['mb_per_s']:>8.2f} MB/s{'  (cached)' if s['cached'] else ''}"
        + (f"  [{notes}]" if notes else "")
    )


def write_run_files(prepared: Prepared, run_dir, task: str) -> None:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_tokenizer(prepared.tokenizer, run_dir / "tokenizer.json")
    if prepared.objective == "classify":
        with open(run_dir / "labels.json", "w") as f:
            json.dump({"task": task, "labels": prepared.label_names or []}, f, indent=1)


def prepare(
    data_cfg: DataConfig,
    tokenizer_cfg: TokenizerConfig,
    objective: str,
    run_dir,
    seed: int = 0,
    *,
    model_vocab_size: int | None = None,
    print_fn: Callable[[str], None] | None = print,
) -> dict:
    """Train or load the tokenizer, write run_dir/tokenizer.json (and labels.json), fill the cache.

    Returns {'tokenizer': path, 'tokenizer_source', 'splits': {split: summary}, 'label_names'};
    prints one line per split. `seed` does not change the cache: shuffling happens at load time.
    """
    t0 = time.perf_counter()
    prepared = build(data_cfg, tokenizer_cfg, objective, build=True, model_vocab_size=model_vocab_size)
    write_run_files(prepared, run_dir, data_cfg.task)
    if print_fn is not None:
        print_fn(
            f"tokenizer  {prepared.tokenizer.get_vocab_size(with_added_tokens=True):,} tokens "
            f"({prepared.tokenizer_source}) -> {Path(run_dir) / 'tokenizer.json'}"
        )
        for s in prepared.summaries.values():
            print_fn(format_summary(dict(s, kind="lm" if objective_kind(objective) == "lm" else "examples")))
            if "store" in s:
                st = s["store"]
                print_fn(
                    f"{'store':<10} litdata shards of the {s['split']} blocks {st['seconds']:>8.2f} s -> {st['path']}"
                    + ("  (cached)" if st["cached"] else "")
                )
        if data_cfg.streaming:
            print_fn("streaming  documents are tokenized on the fly during training (no token cache)")
    return {
        "tokenizer": str(Path(run_dir) / "tokenizer.json"),
        "tokenizer_source": prepared.tokenizer_source,
        "splits": prepared.summaries,
        "label_names": prepared.label_names,
        "seed": seed,
        "seconds": round(time.perf_counter() - t0, 3),
    }
