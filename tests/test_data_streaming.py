"""Streaming mode: same batches as the cached path's kinds, flat memory, resumable, sharded."""

import random
import tracemalloc

import pytest
import torch

from lit_transformer.data.module import TextDataModule
from lit_transformer.data.settings import DataConfig, TokenizerConfig
from lit_transformer.data.streaming import pack_stream

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
