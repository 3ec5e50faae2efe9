"""pack.encode_documents with a process pool: the same arrays as one process, errors surface, nothing hangs."""

import contextlib
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

from lit_transformer.data.data_config import TokenizerConfig
from lit_transformer.data.sources import stdlib
from lit_transformer.data.tokens import pack
from lit_transformer.data.tokens.fast_encode import WordEncoder
from lit_transformer.data.tokens.tokenizer import tokenizer_from_str, train_tokenizer
from lit_transformer.errors import DataError

SEP = 5  # any id: the separator is appended, not looked up
MARK = "@@ marker document @@"
# The error tests monkeypatch pack.batch_encoder in this process; forked workers inherit it.
fork_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers see the patches through fork")


def _docs(n_chars):
    out, size = [], 0
    for _, path in stdlib.corpus_split("train"):
        for para in path.read_text("utf-8", "replace").split("\n\n"):
            if para.strip():
                out.append(para)
                size += len(para)
        if size > n_chars:
            return out
    return out


# Special tokens spelled in text stay text (encode_special_tokens), an added token is cut out
# (fast_encode.py's slow documents): workers must rebuild both behaviours, not just the JSON.
TRICKY = "spelled </s> <pad> [SEP] [MASK] <extra_id_1>, and an @added@ token"


@pytest.fixture(scope="module")
def docs():
    out = _docs(120_000)
    return [d for i, d in enumerate(out) for d in ((d, TRICKY) if i % 50 == 7 else (d,))]


@pytest.fixture(scope="module")
def tokenizers(docs):
    bpe = train_tokenizer(docs, TokenizerConfig(kind="bpe", vocab_size=777, num_sentinels=3))
    bpe.add_tokens(["@added@"])
    wordpiece = train_tokenizer(docs, TokenizerConfig(kind="wordpiece", vocab_size=555, num_sentinels=3))
    wordpiece.add_tokens(["@added@"])
    # reloaded from JSON, as prepare.py does (a freshly trained model can differ from its JSON copy)
    return {"bpe": tokenizer_from_str(bpe.to_str()), "wordpiece": tokenizer_from_str(wordpiece.to_str())}


@pytest.fixture
def small_batches(monkeypatch):
    monkeypatch.setattr(pack, "BATCH_BYTES", 3001)  # ~40 batches of the 120 kB sample


def _children() -> set[int]:
    """Processes (running or zombie) whose parent is this one."""
    me, out = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                out.add(int(entry))
    return out


@contextlib.contextmanager
def deadline(seconds):
    def expire(*_):
        raise TimeoutError(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _spy(monkeypatch, log, on_batch=None):
    """Every batch appends the pid that encodes it to `log`; `on_batch(batch)` runs first."""
    real = pack.batch_encoder

    def wrapped(encoder, separator_id, **kw):
        encode = real(encoder, separator_id, **kw)

        def spied(batch):
            if on_batch is not None:
                on_batch(batch)
            with open(log, "a") as f:
                f.write(f"{os.getpid()}\n")
            return encode(batch)

        return spied

    monkeypatch.setattr(pack, "batch_encoder", wrapped)


def _pids(log) -> list[int]:
    return [int(x) for x in open(log).read().split()]


def _run(tok, docs, num_proc):
    return list(pack.encode_documents(pack.fast_copy(tok), iter(docs), SEP, num_proc=num_proc))


@pytest.mark.parametrize("name", ["bpe", "wordpiece"])
def test_pool_gives_the_same_arrays_as_one_process(name, tokenizers, docs, small_batches, monkeypatch, tmp_path):
    tok = tokenizers[name]
    assert (WordEncoder.create(pack.fast_copy(tok), SEP) is not None) == (name == "bpe")  # both paths covered
    serial = _run(tok, docs, 1)
    assert len(serial) > 30
    want = np.concatenate([f for f, _ in serial])
    assert want.size > 10_000 and (want != SEP).sum() == want.size - len(docs)
    assert tok.token_to_id("@added@") in want
    assert tok.token_to_id("[SEP]" if name == "wordpiece" else "</s>") not in want  # spelled, so text
    for num_proc in (2, 3):
        log = tmp_path / f"pids{num_proc}"
        _spy(monkeypatch, log)
        got = _run(tok, docs, num_proc)
        assert len(got) == len(serial), num_proc
        for i, ((f1, n1), (f2, n2)) in enumerate(zip(serial, got)):
            assert f2.dtype == f1.dtype and n2.dtype == n1.dtype
            np.testing.assert_array_equal(f2, f1, err_msg=f"num_proc={num_proc} batch {i}")
            np.testing.assert_array_equal(n2, n1, err_msg=f"num_proc={num_proc} batch {i}")
        pids = _pids(log)
        assert len(pids) == len(serial) and os.getpid() not in pids
        assert len(set(pids)) == num_proc  # the batches really crossed the pool, to every worker


@pytest.mark.slow
def test_spawned_workers_give_the_same_arrays(tokenizers, docs, monkeypatch):
    # the start method off Linux: workers import the package and get everything by pickling
    monkeypatch.setattr(pack, "BATCH_BYTES", 20_011)
    monkeypatch.setattr(pack, "START_METHOD", "spawn")
    tok = tokenizers["bpe"]
    serial = _run(tok, docs[:600], 1)
    with deadline(120):
        got = _run(tok, docs[:600], 2)
    assert len(serial) == len(got) > 3
    for (f1, n1), (f2, n2) in zip(serial, got):
        np.testing.assert_array_equal(f2, f1)
        np.testing.assert_array_equal(n2, n1)


def test_write_lm_doc_starts_match(tokenizers, docs, small_batches, tmp_path):
    from lit_transformer.data.sources.files import ReadStats
    from lit_transformer.data.tokens.cache import CacheWriter
    from lit_transformer.data.tokens.tokenizer import SpecialTokens

    tok = tokenizers["bpe"]
    special = SpecialTokens.from_tokenizer(tok)
    entries = []
    for num_proc in (1, 3):
        with CacheWriter(tmp_path, f"k{num_proc}") as writer:
            entries.append(
                pack.write_lm(
                    iter(docs),
                    tok,
                    special,
                    writer,
                    ReadStats(documents=len(docs)),
                    block_len=31,
                    stride=31,
                    describe="train split",
                    num_proc=num_proc,
                )
            )
    one, three = entries
    for name in ("tokens", "doc_starts"):
        np.testing.assert_array_equal(np.asarray(three[name]), np.asarray(one[name]), err_msg=name)
    assert len(one["doc_starts"]) == len(docs) and one.meta["tokens"] == three.meta["tokens"]


def test_auto_is_serial_for_a_small_corpus_then_switches(tokenizers, docs, small_batches, monkeypatch, tmp_path):
    tok = tokenizers["bpe"]
    serial = _run(tok, docs, 1)
    monkeypatch.setattr(pack, "auto_num_proc", lambda: 2)  # as on any machine with 2 cores or more

    def no_pool(*a, **k):
        raise AssertionError("the pool started for a small corpus")

    monkeypatch.setattr(pack, "pooled_batches", no_pool)
    assert sum(map(len, docs)) < pack.SWITCH_CHARS
    got = _run(tok, docs, None)
    assert all((a == b).all() for (a, _), (b, _) in zip(got, serial)) and len(got) == len(serial)
    monkeypatch.undo()

    # past the switch point the rest goes to the pool, still batch for batch the same
    monkeypatch.setattr(pack, "BATCH_BYTES", 3001)
    monkeypatch.setattr(pack, "auto_num_proc", lambda: 2)
    monkeypatch.setattr(pack, "SWITCH_CHARS", 40_000)
    log = tmp_path / "pids"
    _spy(monkeypatch, log)
    got = _run(tok, docs, None)
    assert len(got) == len(serial)
    for (f1, n1), (f2, n2) in zip(serial, got):
        np.testing.assert_array_equal(f2, f1)
        np.testing.assert_array_equal(n2, n1)
    pids = _pids(log)
    first = 1 + max(i for i, p in enumerate(pids) if p == os.getpid())  # batches packed here
    assert 10 <= first < len(pids) and os.getpid() not in pids[first:] and len(set(pids[first:])) == 2


def test_the_parent_reads_ahead_only_a_few_batches(tokenizers, monkeypatch):
    monkeypatch.setattr(pack, "BATCH_DOCS", 3)
    read = []

    def endless():
        while True:
            read.append(1)
            yield "one more document, always the same"

    before = _children()
    gen = pack.encode_documents(pack.fast_copy(tokenizers["bpe"]), endless(), SEP, num_proc=2)
    with deadline(30):
        next(gen)
        gen.close()  # the consumer stops early: the pool goes away
    assert len(read) <= 3 * (pack.IN_FLIGHT_PER_WORKER * 2 + 1)
    assert _children() <= before


@fork_only
def test_a_worker_error_keeps_its_type_and_message(tokenizers, docs, small_batches, monkeypatch, tmp_path):
    def fail(batch):
        if MARK in batch:
            raise DataError(f"bad document in a batch of {len(batch)}")

    _spy(monkeypatch, tmp_path / "pids", fail)
    bad = docs[:200] + [MARK] + docs[200:]
    size = next(len(b) for b in pack.text_batches(bad) if MARK in b)
    before = _children()
    with deadline(60), pytest.raises(DataError) as info:
        _run(tokenizers["wordpiece"], bad, 2)
    assert str(info.value) == f"bad document in a batch of {size}" and type(info.value) is DataError
    assert _children() <= before


@fork_only
def test_a_dead_worker_is_a_data_error_not_a_hang(tokenizers, docs, small_batches, monkeypatch, tmp_path):
    def die(batch):
        if MARK in batch:
            os._exit(3)  # as the OOM killer would: no exception, no result

    _spy(monkeypatch, tmp_path / "pids", die)
    before = _children()
    with deadline(60), pytest.raises(DataError, match="train split: a tokenizer process .* died"):
        list(
            pack.encode_documents(
                pack.fast_copy(tokenizers["bpe"]),
                iter(docs[:100] + [MARK] + docs[100:]),
                SEP,
                num_proc=2,
                describe="train split",
            )
        )
    assert _children() <= before


@fork_only
def test_ctrl_c_leaves_no_process_behind(tokenizers, docs, small_batches, monkeypatch, tmp_path):
    def stuck(batch):
        if MARK in batch:
            time.sleep(600)  # a worker busy with a huge batch: Ctrl-C must not wait for it

    _spy(monkeypatch, tmp_path / "pids", stuck)
    before = _children()
    gen = pack.encode_documents(
        pack.fast_copy(tokenizers["bpe"]), iter(docs[:300] + [MARK] + docs[300:]), SEP, num_proc=3
    )
    # Ctrl-C reaches this process's main thread. os.kill's process-wide signal may land on another
    # thread (the timer's, the pool's), which leaves the main thread blocked on its wait.
    main = threading.main_thread().ident
    ctrl_c = threading.Timer(1.0, signal.pthread_kill, (main, signal.SIGINT))
    # Python's own Ctrl-C handler, whatever an earlier test of this process left installed
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    t0 = time.perf_counter()
    try:
        with deadline(60), pytest.raises(KeyboardInterrupt):
            for i, _ in enumerate(gen):
                assert len(_children() - before) == 3  # the pool is up while batches come back
                if i == 0:
                    ctrl_c.start()
    finally:
        ctrl_c.cancel()  # never a stray Ctrl-C in a later test
        signal.signal(signal.SIGINT, previous)
    assert _children() <= before and time.perf_counter() - t0 < 4  # terminated, not waited for (join(5), kill)


@fork_only
def test_an_error_while_reading_stops_the_pool(tokenizers, docs, small_batches):
    def unreadable():
        yield from docs[:300]
        raise DataError("corpus.txt: not UTF-8")  # files.py's errors come from the parent's reading

    before = _children()
    with deadline(60), pytest.raises(DataError, match="corpus.txt: not UTF-8"):
        list(pack.encode_documents(pack.fast_copy(tokenizers["bpe"]), unreadable(), SEP, num_proc=2))
    assert _children() <= before


def test_num_proc_is_not_in_the_cache_key_and_prepare_passes_it(tmp_path, small_batches, monkeypatch):
    from lit_transformer.data.data_config import DataConfig
    from lit_transformer.data.tokens.prepare import build

    tok_cfg = TokenizerConfig(vocab_size=333, num_sentinels=3)
    small = dict(max_train_bytes=60_000, max_val_bytes=20_000, block_size=17)
    one = build(DataConfig(cache_dir=str(tmp_path / "a"), num_proc=1, **small), tok_cfg, "clm")
    # same settings but num_proc: a cache hit, nothing tokenized (build=False raises on a miss)
    again = build(DataConfig(cache_dir=str(tmp_path / "a"), num_proc=2, **small), tok_cfg, "clm", build=False)
    assert {s: e.path for s, e in again.entries.items()} == {s: e.path for s, e in one.entries.items()}

    calls = []
    real = pack.pooled_batches
    monkeypatch.setattr(pack, "pooled_batches", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    two = build(DataConfig(cache_dir=str(tmp_path / "b"), num_proc=2, **small), tok_cfg, "clm")
    assert calls == [2, 2]  # train and validation went through a pool of data.num_proc processes
    for split in ("train", "validation"):
        assert two.entries[split].path.name == one.entries[split].path.name
        for name in ("tokens", "doc_starts"):
            np.testing.assert_array_equal(np.asarray(two.entries[split][name]), np.asarray(one.entries[split][name]))
