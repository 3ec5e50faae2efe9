"""prepare(): cache hits and misses, atomic writes, exact packing, file formats."""

import importlib
import json
import os

import numpy as np
import pytest

from lit_transformer.data.data_config import DataConfig, TokenizerConfig
from lit_transformer.data.sources.corpus import build_sources
from lit_transformer.data.sources.files import ReadStats
from lit_transformer.data.tokens import examples, pack
from lit_transformer.data.tokens.prepare import build, prepare

prep = importlib.import_module("lit_transformer.data.tokens.prepare")  # the package exports a function of that name


def small(tmp_path, **kw):
    kw.setdefault("max_train_bytes", 200_000)
    kw.setdefault("max_val_bytes", 40_000)
    kw.setdefault("block_size", 32)
    return DataConfig(cache_dir=str(tmp_path / "cache"), **kw)


TOK = TokenizerConfig(vocab_size=600, num_sentinels=20)


def forbid(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("tokenized or trained on a cache hit")

    monkeypatch.setattr(prep, "_write_split", boom)
    monkeypatch.setattr(prep, "train_tokenizer", boom)
    monkeypatch.setattr(pack, "encode_documents", boom)
    monkeypatch.setattr(pack, "fast_copy", boom)


def test_second_prepare_tokenizes_nothing(tmp_path, monkeypatch):
    cfg = small(tmp_path)
    first = prepare(cfg, TOK, "clm", tmp_path / "run1", print_fn=None)
    assert first["tokenizer_source"] == "trained"
    assert not any(s["cached"] for s in first["splits"].values())
    forbid(monkeypatch)
    lines = []
    second = prepare(cfg, TOK, "clm", tmp_path / "run2", print_fn=lines.append)
    assert second["tokenizer_source"] == "cached"
    assert all(s["cached"] for s in second["splits"].values())
    for split in ("train", "validation"):
        for key in ("documents", "tokens", "blocks"):
            assert first["splits"][split][key] == second["splits"][split][key]
    assert (tmp_path / "run2" / "tokenizer.json").read_text() == (tmp_path / "run1" / "tokenizer.json").read_text()
    assert len(lines) == 3 and "(cached)" in lines[1] and "MB/s" in lines[1]


def test_changing_tokenizer_or_block_size_misses(tmp_path, monkeypatch):
    cfg = small(tmp_path)
    prepare(cfg, TOK, "mlm", tmp_path / "run", print_fn=None)
    calls = []
    real = prep._write_split
    monkeypatch.setattr(prep, "_write_split", lambda *a, **k: calls.append(a[2].split) or real(*a, **k))
    prepare(DataConfig(**{**cfg.__dict__, "block_size": 48}), TOK, "mlm", tmp_path / "run", print_fn=None)
    assert calls == ["train", "validation"]
    calls.clear()
    prepare(cfg, TokenizerConfig(vocab_size=650, num_sentinels=20), "mlm", tmp_path / "run", print_fn=None)
    assert calls == ["train", "validation"]
    calls.clear()
    prepare(cfg, TOK, "mlm", tmp_path / "run", print_fn=None)  # the first settings: all cached again
    assert calls == []


def test_interrupted_prepare_leaves_no_entry(tmp_path, monkeypatch):
    cfg = small(tmp_path)
    real = pack.encode_documents

    def interrupted(*a, **k):
        gen = real(*a, **k)
        yield next(gen)
        raise KeyboardInterrupt

    monkeypatch.setattr(pack, "encode_documents", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg, TOK, "clm", tmp_path / "run", print_fn=None)
    root = tmp_path / "cache"
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]
    assert not [p for p in root.iterdir() if (p / "meta.json").exists()]
    monkeypatch.setattr(pack, "encode_documents", real)
    out = prepare(cfg, TOK, "clm", tmp_path / "run", print_fn=None)
    assert not out["splits"]["train"]["cached"]


def test_packing_keeps_every_token_and_marks_documents(tmp_path):
    docs = [f"document {i}: " + "word " * (i % 7) + "é😀\n  indented\r\n" for i in range(300)]
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs), encoding="utf-8")
    cfg = DataConfig(
        train_files=[str(tmp_path / "corpus.txt")], val_fraction=0.0, block_size=16, cache_dir=str(tmp_path / "cache")
    )
    p = build(cfg, TokenizerConfig(vocab_size=400, num_sentinels=0, min_frequency=1), "clm")
    entry = p.entries["train"]
    tokens = np.asarray(entry["tokens"])
    assert tokens.dtype == np.uint16
    sep = p.special.separator_id
    text = p.tokenizer.decode(tokens.tolist(), skip_special_tokens=False)
    expected = [d.replace("\r\n", "\n").strip("\n") for d in docs]  # paragraphs: '\r' dropped, blank lines split
    assert text == "".join(d + "</s>" for d in expected)
    starts = np.asarray(entry["doc_starts"])
    assert len(starts) == 300 and starts[0] == 0 and (tokens[starts[1:] - 1] == sep).all()
    meta = entry.meta
    assert meta["blocks"] == (meta["tokens"] - 1) // 16 and meta["dropped_tokens"] < 16
    blocks = pack.LMBlocks(entry)
    assert np.array_equal(blocks[1][:1], blocks[0][-1:])  # clm windows overlap by the one shifted token
    assert blocks.document_ids(0)[0] == 0
    assert meta["bytes_per_token"] == pytest.approx(sum(len(d.encode()) for d in expected) / meta["tokens"])


def test_text_formats_and_paths(tmp_path):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("line one\nline two\n\npara two\n", encoding="utf-8")
    (d / "sub" / "b.txt").write_text("only line", encoding="utf-8")
    counts = {}
    for fmt in ("lines", "paragraphs", "file"):
        for spec in ([str(d)], [str(d / "**" / "*.txt")], [str(d / "a.txt"), str(d / "sub" / "b.txt")]):
            cfg = DataConfig(train_files=spec, text_format=fmt, val_fraction=0.0)
            stats = ReadStats()
            counts[fmt] = list(build_sources(cfg, "clm")["train"].iterate(stats))
            assert stats.documents == len(counts[fmt])
    assert counts["lines"] == ["line one", "line two", "para two", "only line"]
    assert counts["paragraphs"] == ["line one\nline two", "para two", "only line"]
    assert counts["file"] == ["line one\nline two\n\npara two\n", "only line"]


def _write_tables(tmp_path, rows):
    import pandas as pd

    df = pd.DataFrame(rows)
    paths = {
        "jsonl": tmp_path / "d.jsonl",
        "csv": tmp_path / "d.csv",
        "tsv": tmp_path / "d.tsv",
        "parquet": tmp_path / "d.parquet",
        "json": tmp_path / "d.json",
    }
    df.to_json(paths["jsonl"], orient="records", lines=True)
    df.to_csv(paths["csv"], index=False)
    df.to_csv(paths["tsv"], index=False, sep="\t")
    df.to_parquet(paths["parquet"])
    paths["json"].write_text(json.dumps(rows))
    return paths


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "tsv", "parquet"])
def test_table_formats_for_each_kind(tmp_path, fmt):
    rows = [
        {
            "text": f"sentence number {i}",
            "other": f"pair {i}",
            "label": ["neg", "pos"][i % 2],
            "source": f"source {i}",
            "target": f"target {i}",
        }
        for i in range(40)
    ]
    path = _write_tables(tmp_path, rows)[fmt]
    lm = list(build_sources(DataConfig(train_files=[str(path)], val_fraction=0), "mlm")["train"].iterate(ReadStats()))
    assert lm == [r["text"] for r in rows]
    cl = list(
        build_sources(DataConfig(train_files=[str(path)], val_fraction=0, text_pair_column="other"), "classify")[
            "train"
        ].iterate(ReadStats())
    )
    assert cl[3] == ("sentence number 3", "pair 3", "pos")
    s2s = list(
        build_sources(DataConfig(train_files=[str(path)], val_fraction=0), "seq2seq")["train"].iterate(ReadStats())
    )
    assert s2s[5] == ("source 5", "target 5")


def test_holdout_split_is_disjoint_and_stable(tmp_path):
    (tmp_path / "c.txt").write_text("\n".join(f"line {i}" for i in range(2000)), encoding="utf-8")
    cfg = DataConfig(train_files=[str(tmp_path / "c.txt")], text_format="lines", val_fraction=0.05)
    src = build_sources(cfg, "clm")
    train = list(src["train"].iterate(ReadStats()))
    val = list(src["validation"].iterate(ReadStats()))
    assert len(train) + len(val) == 2000 and not set(train) & set(val)
    assert 50 <= len(val) <= 150
    assert val == list(build_sources(cfg, "clm")["validation"].iterate(ReadStats()))


def test_classification_labels_json_and_pairs_use_post_processor(tmp_path):
    rows = [{"a": f"first {i}", "b": f"second {i}", "label": i % 3} for i in range(60)]
    path = _write_tables(tmp_path, rows)["jsonl"]
    cfg = DataConfig(
        train_files=[str(path)],
        val_files=[str(path)],
        text_column="a",
        text_pair_column="b",
        cache_dir=str(tmp_path / "cache"),
        max_length=12,
    )
    out = prepare(
        cfg,
        TokenizerConfig(kind="wordpiece", vocab_size=200, num_sentinels=0, min_frequency=1),
        "classify",
        tmp_path / "run",
        print_fn=None,
    )
    assert json.loads((tmp_path / "run" / "labels.json").read_text()) == {"task": "single_label", "labels": [0, 1, 2]}
    assert out["label_names"] == [0, 1, 2]
    p = build(cfg, TokenizerConfig(kind="wordpiece", vocab_size=200, num_sentinels=0, min_frequency=1), "classify")
    ex = examples.RaggedExamples(p.entries["train"])[4]
    toks = [p.tokenizer.id_to_token(i) for i in ex["ids"]]
    assert toks[0] == "[CLS]" and toks.count("[SEP]") == 2 and ex["type_ids"][-1] == 1 and int(ex["label"]) == 1
    assert len(ex["ids"]) <= 12


def test_multi_label_and_regression(tmp_path):
    rows = [
        {"text": f"example {i}", "tags": [["a"], ["b", "c"], ["a", "c"]][i % 3], "score": i / 10} for i in range(30)
    ]
    path = _write_tables(tmp_path, rows)["jsonl"]
    tok = TokenizerConfig(vocab_size=400, num_sentinels=0, min_frequency=1)
    cfg = DataConfig(
        train_files=[str(path)],
        label_column="tags",
        task="multi_label",
        val_fraction=0,
        cache_dir=str(tmp_path / "cache"),
    )
    p = build(cfg, tok, "classify")
    assert p.label_names == ["a", "b", "c"]
    assert examples.RaggedExamples(p.entries["train"])[1]["label"].tolist() == [0.0, 1.0, 1.0]
    cfg = DataConfig(
        train_files=[str(path)],
        label_column="score",
        task="regression",
        val_fraction=0,
        cache_dir=str(tmp_path / "cache"),
    )
    p = build(cfg, tok, "classify")
    assert float(examples.RaggedExamples(p.entries["train"])[7]["label"]) == pytest.approx(0.7)


def test_aligned_seq2seq_files(tmp_path):
    (tmp_path / "train.en").write_text("".join(f"hello {i}\n" for i in range(50)), encoding="utf-8")
    (tmp_path / "train.de").write_text("".join(f"hallo {i}\n" for i in range(50)), encoding="utf-8")
    cfg = DataConfig(
        source_files=[str(tmp_path / "train.en")],
        target_files=[str(tmp_path / "train.de")],
        val_fraction=0.1,
        cache_dir=str(tmp_path / "cache"),
        max_length=4,
    )
    p = build(cfg, TokenizerConfig(kind="unigram", vocab_size=120, num_sentinels=0), "seq2seq")
    n = len(p.entries["train"]["source_offsets"]) - 1 + len(p.entries["validation"]["source_offsets"]) - 1
    assert n == 50
    src, tgt = examples.RaggedExamples(p.entries["train"])[0]
    assert src[-1] == p.special.eos_id and tgt[-1] == p.special.eos_id and len(src) <= 4
    assert p.tokenizer.decode(tgt.tolist()).startswith("hallo")


def test_embedded_corpus_split_is_fixed():
    from lit_transformer.data.sources import stdlib

    train, val = stdlib.corpus_split("train"), stdlib.corpus_split("validation")
    assert len(val) >= stdlib.MIN_VAL_FILES and not {r for r, _ in train} & {r for r, _ in val}
    assert len(train) + len(val) == len(stdlib.stdlib_files()) > 300
    assert not any("site-packages" in r or "/test/" in f"/{r}" for r, _ in train + val)
    assert stdlib.corpus_split("validation") == val
    assert os.path.getsize(val[0][1]) > 0


def test_span_store_blocks_have_the_raw_length(tmp_path):
    cfg = small(tmp_path, block_size=64)
    p = build(cfg, TOK, "span")
    raw = prep.block_params("span", cfg)[0]
    assert pack.LMBlocks(p.entries["train"])[0].shape == (raw,) and raw > 64
    assert p.entries["train"].meta["blocks"] == p.entries["train"].meta["tokens"] // raw
