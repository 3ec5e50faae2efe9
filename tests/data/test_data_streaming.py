"""Streaming mode: same batches as the cached path's kinds, flat memory, sharded, resumable without
re-reading (exact batches, reads bounded by one window), and the source positions under it."""

import random
import tracemalloc

import pytest
import torch

from lit_transformer.data.data_config import DataConfig, TokenizerConfig
from lit_transformer.data.modules.streaming import pack_stream
from lit_transformer.data.modules.text_module import TextDataModule
from lit_transformer.data.sources.corpus import SplitSource, build_sources
from lit_transformer.data.sources.files import ReadStats
from lit_transformer.errors import DataError

TOK = TokenizerConfig(vocab_size=500, num_sentinels=20, max_train_bytes=100_000)
WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
    "tau upsilon phi chi psi omega stream token block batch memory corpus"
).split()


def write_corpus(path, n_bytes, seed=0):
    rng = random.Random(seed)
    size = 0
    with open(path, "w", encoding="utf-8") as f:
        while size < n_bytes:
            line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) + "\n"
            f.write(line)
            size += len(line)
    return path


def stream_cfg(tmp_path, files, **kw):
    base = dict(
        train_files=[str(f) for f in files],
        text_format="lines",
        cache_dir=str(tmp_path / "cache"),
        block_size=32,
        batch_size=8,
        streaming=True,
        shuffle_buffer=64,
        val_fraction=0.01,
    )
    return DataConfig(**{**base, **kw})


@pytest.mark.parametrize("objective", ["mlm", "clm", "span"])
def test_streaming_batches_match_the_cached_kinds(tmp_path, objective):
    corpus = write_corpus(tmp_path / "c.txt", 200_000)
    streamed = TextDataModule(stream_cfg(tmp_path, [corpus]), TOK, objective)
    streamed.prepare_data()
    streamed.setup()
    cached = TextDataModule(stream_cfg(tmp_path, [corpus], streaming=False), TOK, objective)
    cached.prepare_data()
    cached.setup()
    a, b = next(iter(streamed.train_dataloader())), next(iter(cached.train_dataloader()))
    a = streamed.on_before_batch_transfer(a, 0)  # pops the stream position, as under a Trainer
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype, key
    assert next(iter(streamed.val_dataloader()))["input_ids"].shape[1] == 32
    assert streamed.bytes_per_token == pytest.approx(cached.bytes_per_token)
    assert not list((tmp_path / "cache").glob("*/tokens.bin")) or not streamed._prepared.entries


def _peak_bytes(dm):
    tracemalloc.start()
    n = 0
    for batch in dm.train_dataloader():
        n += batch["input_ids"].shape[0]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak, n


def test_streaming_memory_is_flat(tmp_path):
    small = write_corpus(tmp_path / "small.txt", 1_000_000, seed=1)
    large = write_corpus(tmp_path / "large.txt", 4_000_000, seed=2)
    peaks = {}
    for name, path in (("small", small), ("large", large)):
        dm = TextDataModule(stream_cfg(tmp_path, [path], val_fraction=0.0), TOK, "clm")
        dm.prepare_data()
        dm.setup()
        peaks[name] = _peak_bytes(dm)
    (p_small, n_small), (p_large, n_large) = peaks["small"], peaks["large"]
    assert n_large > 3.5 * n_small  # four times the text, four times the blocks ...
    assert p_large < 1.5 * p_small + 2_000_000  # ... in about the same memory
    assert p_large < 16_000_000  # far below the 4 MB corpus as Python token ids (~80 MB)


def test_streaming_resume_and_shards(tmp_path):
    corpus = write_corpus(tmp_path / "c.txt", 150_000)
    cfg = stream_cfg(tmp_path, [corpus])
    ref = TextDataModule(cfg, TOK, "mlm", seed=4)
    ref.prepare_data()
    ref.setup()
    full = list(ref.train_dataloader())
    first = TextDataModule(cfg, TOK, "mlm", seed=4)
    first.setup()
    it = iter(first.train_dataloader())
    for _ in range(3):
        first.on_before_batch_transfer(next(it), 0)
    resumed = TextDataModule(cfg, TOK, "mlm", seed=4)
    resumed.load_state_dict(first.state_dict())
    resumed.setup()
    rest = list(resumed.train_dataloader())
    assert len(rest) == len(full) - 3
    assert all(
        torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])
        for x, y in zip(rest, full[3:])
    )

    rows = []
    for rank in range(2):
        dm = TextDataModule(DataConfig(**{**cfg.__dict__, "shuffle": False}), TOK, "clm", rank=rank, world_size=2)
        dm.setup()
        rows.append({tuple(r.tolist()) for b in dm.train_dataloader() for r in b["input_ids"]})
    assert rows[0] and rows[1] and not rows[0] & rows[1]


def test_pack_stream_windows():
    import numpy as np

    chunks = [(np.arange(0, 7), None), (np.arange(7, 20), None), (np.arange(20, 23), None)]
    blocks = list(pack_stream(chunks, 5, 4))  # clm-style: T + 1 = 5 tokens, stride T = 4
    assert [b.tolist() for b in blocks][:2] == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8]]
    assert len(blocks) == (23 - 1) // 4


# ----------------------------------------------------------------------------- resuming without re-reading


def _module(cfg, **kw):
    dm = TextDataModule(cfg, TOK, "mlm", seed=4, **kw)
    dm.setup()
    return dm


def _take(dm, it, n):
    """n training batches, used as a Trainer uses them (the position popped and noted)."""
    return [dm.on_before_batch_transfer(next(it), 0) for _ in range(n)]


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _resume_cfg(tmp_path, **kw):
    corpus = write_corpus(tmp_path / "c.txt", 60_000)
    # a window of 6 blocks: batches of 4 straddle windows, and the run crosses many of them
    return stream_cfg(tmp_path, [corpus], batch_size=4, shuffle_buffer=6, **kw)


@pytest.mark.parametrize("workers", [0, 2])
def test_streaming_resume_equals_the_uninterrupted_stream(tmp_path, workers, monkeypatch):
    # text batches of 2,000 characters, not 1 MB: the positions are seeks into the file
    monkeypatch.setattr("lit_transformer.data.modules.streaming.BATCH_BYTES", 2_000)  # forked workers too
    cfg = _resume_cfg(tmp_path, num_workers=workers)
    ref = TextDataModule(cfg, TOK, "mlm", seed=4)
    ref.prepare_data()
    ref.setup()
    epoch0, epoch1 = list(ref.train_dataloader()), list(ref.train_dataloader())
    epoch0 = [ref.on_before_batch_transfer(b, 0) for b in epoch0]
    epoch1 = [ref.on_before_batch_transfer(b, 0) for b in epoch1]
    assert len(epoch0) > 20 and not all(_same(a, b) for a, b in zip(epoch0, epoch1))
    for k in (3, len(epoch0) - 4):  # odd k: with 2 workers the next batch is worker 1's
        first = _module(cfg)
        _take(first, iter(first.train_dataloader()), k)
        resumed = _module(cfg)
        resumed.load_state_dict(first.state_dict())
        loader = resumed.train_dataloader()
        rest = _take(resumed, iter(loader), len(epoch0) - k)
        assert all(_same(a, b) for a, b in zip(rest, epoch0[k:])), k
        assert all(_same(a, b) for a, b in zip(_take(resumed, iter(loader), len(epoch1)), epoch1))
    # resumed in the second epoch, from a state saved there
    first = _module(cfg)
    loader = first.train_dataloader()
    _take(first, iter(loader), len(epoch0))
    _take(first, iter(loader), 5)
    resumed = _module(cfg)
    resumed.load_state_dict(first.state_dict())
    rest = _take(resumed, iter(resumed.train_dataloader()), len(epoch1) - 5)
    assert all(_same(a, b) for a, b in zip(rest, epoch1[5:]))


def _reads_to_resume(cfg, k, monkeypatch, *, stream_state=True):
    """Documents the resumed stream reads before its first batch, after k batches were used."""
    first = _module(cfg)
    _take(first, iter(first.train_dataloader()), k)
    state = first.state_dict()
    if not stream_state:
        state.pop("stream")  # a checkpoint written before stream positions were saved
    resumed = _module(cfg)
    resumed.load_state_dict(state)
    source = resumed._prepared.sources["train"]
    reads = []
    inner = source._iterate

    def counted(stats, start=None):
        for doc in inner(stats, start):
            reads.append(len(doc))
            yield doc

    monkeypatch.setattr(source, "_iterate", counted)
    next(iter(resumed.train_dataloader()))
    return len(reads)


def test_streaming_resume_reads_at_most_one_window(tmp_path, monkeypatch):
    import lit_transformer.data.modules.streaming as streaming

    monkeypatch.setattr(streaming, "BATCH_BYTES", 2_000)  # text batches far smaller than the corpus
    cfg = _resume_cfg(tmp_path)
    n = len(list(_module(cfg).train_dataloader()))
    fresh = _reads_to_resume(cfg, 0, monkeypatch)  # one window and the text batches under it
    early, late = _reads_to_resume(cfg, 3, monkeypatch), _reads_to_resume(cfg, n - 2, monkeypatch)
    assert early <= 2 * fresh and late <= 2 * fresh  # bounded by a window, not by the position
    skipped = _reads_to_resume(cfg, n - 2, monkeypatch, stream_state=False)
    assert skipped > 10 * late  # the old way (and older checkpoints) re-read everything before it


def test_streaming_resume_refuses_another_worker_count(tmp_path):
    cfg = _resume_cfg(tmp_path)
    first = _module(cfg)
    _take(first, iter(first.train_dataloader()), 2)
    resumed = _module(DataConfig(**{**cfg.__dict__, "num_workers": 2}))
    resumed.load_state_dict(first.state_dict())
    with pytest.raises(DataError, match=r"1 process\(es\) x 1 worker\(s\), this run has 1 x 2") as err:
        next(iter(resumed.train_dataloader()))
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- source positions


def _positions(source):
    """Every item with the position after it, and the items resumed from each position."""
    stats = ReadStats()
    items = []
    for item in source.iterate(stats):
        items.append((item, SplitSource.position(stats)))
    return items


def _check_resumes(source, where=None):
    items = _positions(source)
    docs = [d for d, _ in items]
    assert len(docs) > 3
    for i in where if where is not None else range(len(items)):
        assert list(source.iterate(ReadStats(), items[i][1])) == docs[i + 1 :], i
    return docs


@pytest.mark.parametrize("text_format", ["lines", "paragraphs", "file"])
def test_text_sources_resume_at_every_position(tmp_path, text_format):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(b"\xef\xbb\xbfone two\r\nthree\n\n\nfour five\nsix\n\nseven")  # BOM, CRLF, no final newline
    b.write_text("eight\n\nnine ten\neleven\n" + "x" * 50 + "\ntwelve\n")  # a line over max_line_bytes
    cfg = DataConfig(train_files=[str(a), str(b), str(a)], text_format=text_format, max_line_bytes=40, val_fraction=0)
    source = build_sources(cfg, "clm", streaming=True)["train"]
    docs = _check_resumes(source) if text_format != "file" else [d for d, _ in _positions(source)]
    assert docs == [d for d, _ in _positions(source)]
    if text_format == "file":
        assert len(docs) == 3 and list(source.iterate(ReadStats(), _positions(source)[0][1])) == docs[1:]
    # the caps count on from the position: a cut last document, or max_documents, ends there too
    for cap in (dict(max_train_bytes=30), dict(max_documents=3)):
        capped = build_sources(DataConfig(**{**cfg.__dict__, **cap}), "clm", streaming=True)["train"]
        items = _positions(capped)
        assert items and list(capped.iterate(ReadStats(), items[-1][1])) == []
        if len(items) > 1:
            assert list(capped.iterate(ReadStats(), items[0][1])) == [d for d, _ in items[1:]]


def _rows_file(tmp_path, fmt, f):
    import json

    rows = [{"text": f"doc {f} {i}" if i % 7 else " ", "n": i} for i in range(1500)]  # every 7th blank
    rows[3]["text"], rows[5]["text"] = None, "a long line " * 200_000  # a null; a row over max_line_bytes
    path = tmp_path / f"{f}.{fmt}"
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=400)
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    else:
        path.write_text("text,n\n" + "".join(f"{r['text'] or ''},{r['n']}\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv"])
def test_table_sources_resume_and_read_what_the_cached_path_reads(tmp_path, fmt):
    """jsonl and parquet streams are read without `datasets` (positions are seeks), csv through
    `datasets`' IterableDataset state; each gives the rows `prepare` reads through `datasets`."""
    cfg = DataConfig(train_files=[_rows_file(tmp_path, fmt, f) for f in range(2)], val_fraction=0)
    source = build_sources(cfg, "clm", streaming=True)["train"]
    items = _positions(source)
    cached = list(build_sources(cfg, "clm", streaming=False)["train"].iterate(ReadStats()))
    assert [d for d, _ in items] == cached and len(cached) == 2 * (1500 - 215 - 1)
    _check_resumes(source, where=[0, 398, 399, 1000, 1282, len(items) - 2])
    key = {"jsonl": "offset", "parquet": "group", "csv": "table"}[fmt]
    assert key in items[0][1]


def test_a_jsonl_stream_names_a_missing_column_and_a_bad_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"body": "x"}\n' * 3)
    source = build_sources(DataConfig(train_files=[str(path)], val_fraction=0), "clm", streaming=True)["train"]
    with pytest.raises(DataError, match=r"no column 'text' \(data.text_column\); available columns: \['body'\]"):
        list(source.iterate(ReadStats()))
    path.write_text('{"text": "x"}\n{"text": \n')
    with pytest.raises(DataError, match=r"a.jsonl: the line ending at byte 24 is not JSON"):
        list(source.iterate(ReadStats()))
