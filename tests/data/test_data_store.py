"""data.store=litdata: the training blocks as litdata shards. Ranks read disjoint shards, an epoch
reads every block once, a resume reads only the blocks still to come, a run trains and resumes
exactly, and without litdata the recipe fails in one line naming the extra."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from helpers import RECIPES, TINY_RUN, assert_resume_matches, optional

from lit_transformer.data.data_config import DataConfig, TokenizerConfig
from lit_transformer.data.tokens.cache import CacheWriter
from lit_transformer.data.tokens.prepare import build
from lit_transformer.errors import DataError

litdata = optional("litdata", "store")
from lit_transformer.data.tokens.store import StoreLoader, write_store  # noqa: E402  (needs litdata)

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH = 5
BLOCKS, STRIDE = 1003, 8  # clm-like blocks: STRIDE + 1 tokens each, the next one starting STRIDE later
CHUNK_BYTES = 1000  # a few dozen blocks a chunk: many chunks, so that each rank gets several


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A store of BLOCKS blocks whose token stream counts 0, 1, 2, ...: block i starts with i * STRIDE."""
    root = tmp_path_factory.mktemp("store-cache")
    with CacheWriter(root, "counting") as writer:
        writer.array("tokens", np.uint32).append(np.arange(BLOCKS * STRIDE + 1))
        writer.array("doc_starts", np.int64).append([0])
        entry = writer.commit({"kind": "lm", "blocks": BLOCKS, "block_len": STRIDE + 1, "stride": STRIDE})
    path, _, written = write_store(root, entry, num_proc=2, chunk_bytes=CHUNK_BYTES)
    assert written and len(list(path.glob("*.bin"))) > 8
    assert write_store(root, entry, num_proc=2, chunk_bytes=CHUNK_BYTES) == (path, 0.0, False)  # reused
    return path


def first_tokens(examples, generators):
    return [int(x[0]) for x in examples]


def epoch_indices(path, *, epoch=0, skip=0, rank=0, world_size=1, num_workers=0) -> list[list[int]]:
    """The block indices of each batch of `epoch` after the first `skip` batches."""
    loader = StoreLoader(
        path,
        collator=first_tokens,
        batch_size=BATCH,
        seed=7,
        rank=rank,
        world_size=world_size,
        num_workers=num_workers,
    )
    loader.start(epoch, skip)
    return [[t // STRIDE for t in batch] for batch in loader]


def flat(batches) -> list[int]:
    return [i for b in batches for i in b]


def test_ranks_read_disjoint_shards_and_every_block_once(store):
    path = store
    n = BLOCKS
    ranks = [epoch_indices(path, rank=r, world_size=2) for r in range(2)]
    a, b = flat(ranks[0]), flat(ranks[1])
    assert len(ranks[0]) == len(ranks[1]) > 0  # the same number of full batches: DDP ranks never wait
    assert not set(a) & set(b)
    seen = a + b
    assert len(seen) == len(set(seen))  # no block twice in the epoch
    assert len(seen) == n - n % (2 * BATCH)  # all but the remainder that equal full batches drop
    # one process reads all of them (but the last partial batch), in another order each epoch
    one = flat(epoch_indices(path))
    assert len(one) == len(set(one)) == n - n % BATCH
    assert flat(epoch_indices(path, epoch=1)) != one
    assert flat(epoch_indices(path)) == one  # deterministic by (seed, epoch)


@pytest.mark.parametrize("epoch", [0, 2])
def test_resume_reads_only_the_remaining_blocks(store, monkeypatch, epoch):
    path = store
    full = epoch_indices(path, epoch=epoch, rank=1, world_size=2)
    reads = []
    getitem = litdata.StreamingDataset.__getitem__

    def counted(self, i):
        reads.append(i)
        return getitem(self, i)

    monkeypatch.setattr(litdata.StreamingDataset, "__getitem__", counted)
    for k in (1, len(full) // 2, len(full) - 1, len(full)):
        reads.clear()
        rest = epoch_indices(path, epoch=epoch, skip=k, rank=1, world_size=2)
        assert rest == full[k:], k
        assert len(reads) == (len(full) - k) * BATCH, k  # the skipped blocks are never read


def test_resume_with_workers_continues_in_order(store):
    path = store
    full = epoch_indices(path, num_workers=2)
    assert sorted(flat(full)) == sorted(flat(epoch_indices(path)))
    for k in (1, 2, 7):
        assert epoch_indices(path, skip=k, num_workers=2) == full[k:], k


@pytest.mark.slow
def test_a_store_run_trains_and_resumes_exactly(tmp_path, private_cache, monkeypatch):
    from lit_transformer.recipe.load import load_recipe

    common = [*TINY_RUN, "data.store=litdata", "trainer.max_steps=6", "trainer.checkpoint_every_n_steps=3"]

    def config(run_dir, *extra):
        return load_recipe(RECIPES / "tiny-clm.yaml", [*common, f"run.dir={run_dir}", *extra])

    stores = private_cache / "litdata"
    before = set(stores.glob("*/index.json"))  # the session's cache may hold other tests' stores
    whole, _ = assert_resume_matches(config, tmp_path, stop=3, steps=6)
    # the first run wrote the store; the stopped and the resumed run reused it
    assert len(set(stores.glob("*/index.json")) - before) == 1
    # evaluation reads the validation split from the cache: no litdata, no shards written
    from lit_transformer.commands.evaluate import evaluate_suite

    monkeypatch.setitem(sys.modules, "litdata", None)
    metrics = evaluate_suite(str(whole), split="validation", max_batches=2)
    assert metrics["eval/validation/loss"] > 0


def test_without_litdata_the_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "litdata", None)  # import litdata now raises ImportError
    cfg = DataConfig(max_train_bytes=20_000, cache_dir=str(tmp_path), store="litdata")
    with pytest.raises(DataError, match=r"data.store=litdata needs the litdata package .*`store` extra") as err:
        build(cfg, TokenizerConfig(vocab_size=300, num_sentinels=0), "clm")
    assert "\n" not in str(err.value)
    assert not any(tmp_path.iterdir())  # refused before tokenizing anything


def test_store_refuses_streaming_and_non_lm_objectives(tmp_path):
    with pytest.raises(DataError, match="data.store='litdata' needs data.streaming=false"):
        DataConfig(streaming=True, store="litdata")
    with pytest.raises(DataError, match="data.store='sharded' is not one of"):
        DataConfig(store="sharded")
    with pytest.raises(DataError, match="data.store=litdata is for LM objectives .* not 'classify'"):
        build(DataConfig(cache_dir=str(tmp_path), store="litdata"), TokenizerConfig(), "classify")


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        ("tiny-classify", "data.store=litdata is for LM objectives .* not 'classify'"),
        ("tiny-ul2", "data.store=litdata is not offered in a mixture"),
    ],
)
def test_recipes_that_cannot_use_the_store_are_refused_at_load(recipe, message):
    from lit_transformer.errors import RecipeError
    from lit_transformer.recipe.load import load_recipe

    with pytest.raises(RecipeError, match=message):
        load_recipe(RECIPES / f"{recipe}.yaml", ["data.store=litdata"])
