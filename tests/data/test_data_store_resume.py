"""data.store=litdata resumed on another layout (store.py, "Resuming on another layout"): the
saved epoch's order, as one stream of global batches, continues on the new ranks, DataLoader
workers or batch, every block once; the new layout's optimizer steps hold the blocks the old
layout's would have held. Checked on a node-local store whose block i starts with token i x STRIDE."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import optional

from lit_transformer.data.data_config import DataConfig, TokenizerConfig
from lit_transformer.data.modules.text_module import TextDataModule
from lit_transformer.data.tokens.cache import CacheWriter
from lit_transformer.errors import DataError

optional("litdata", "store")
from lit_transformer.data.tokens import store as S  # noqa: E402  (needs litdata)

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCKS, STRIDE, BATCH = 601, 8, 5
CHUNK_BYTES = 1000


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume-store")
    with CacheWriter(root, "counting") as writer:
        writer.array("tokens", np.uint32).append(np.arange(BLOCKS * STRIDE + 1))
        writer.array("doc_starts", np.int64).append([0])
        entry = writer.commit({"kind": "lm", "blocks": BLOCKS, "block_len": STRIDE + 1, "stride": STRIDE})
    return S.write_store(root, entry, num_proc=1, chunk_bytes=CHUNK_BYTES)[0]


def batches(path, *, rank=0, world=1, workers=0, batch=BATCH, skip=0, origin=None, epoch=0):
    """(each batch's block indices, the loader's layout) after the first `skip` batches."""
    loader = S.StoreLoader(
        path,
        collator=lambda examples, generators: [int(x[0]) // STRIDE for x in examples],
        batch_size=batch,
        seed=11,
        rank=rank,
        world_size=world,
        num_workers=workers,
    )
    loader.start(epoch, skip, origin)
    return list(loader), loader.layout


def global_batches(path, world, **kw) -> list[set]:
    """The epoch's global batches of `world` ranks, each as a set of blocks."""
    ranks = [batches(path, rank=r, world=world, **kw)[0] for r in range(world)]
    return [set().union(*(ranks[r][j] for r in range(world))) for j in range(len(ranks[0]))]


@pytest.mark.parametrize("epoch", [0, 1])
def test_one_rank_resumes_two_ranks_position_with_the_same_global_batches(store, epoch):
    two, layout = batches(store, world=2, epoch=epoch)
    expected = global_batches(store, 2, epoch=epoch)
    k = 9  # global batches trained on 2 ranks
    rest, _ = batches(store, skip=2 * k, origin=layout, epoch=epoch)  # 2 x 5 blocks a micro-batch, as 2 ranks of 5
    steps = [set(rest[2 * j]) | set(rest[2 * j + 1]) for j in range(len(rest) // 2)]
    assert steps == expected[k:]
    trained = [i for g in expected[:k] for i in g] + [i for b in rest for i in b]
    assert len(trained) == len(set(trained)) == BLOCKS - BLOCKS % (2 * BATCH)  # every block once


def test_two_ranks_resume_one_ranks_position_and_a_second_resume_goes_on_from_there(store):
    one, layout = batches(store)
    k = 12  # one rank's micro-batches: 6 global batches of the two ranks
    ranks = [batches(store, rank=r, world=2, skip=k // 2, origin=layout)[0] for r in (0, 1)]
    for j in range(len(ranks[0])):
        assert set(ranks[0][j]) | set(ranks[1][j]) == set(one[k + 2 * j]) | set(one[k + 2 * j + 1])
    # saved again after 4 more steps on two ranks (the data module keeps the origin for the epoch)
    again = [batches(store, rank=r, world=2, skip=k // 2 + 4, origin=layout)[0] for r in (0, 1)]
    assert again == [ranks[0][4:], ranks[1][4:]]


def test_another_number_of_workers_continues_the_same_order(store):
    with_workers, layout = batches(store, workers=2)
    assert layout == (1, 1, 2, BATCH)
    rest, _ = batches(store, skip=7, origin=layout)
    assert rest == with_workers[7:]
    same, _ = batches(store, workers=2, skip=7, origin=layout)  # the saved layout itself: litdata's replay
    assert same == with_workers[7:]


def test_the_data_module_carries_a_store_position_in_whole_global_micro_batches(tmp_path):
    def module(batch_size):
        data = DataConfig(store="litdata", batch_size=batch_size, cache_dir=str(tmp_path))
        dm = TextDataModule(data, TokenizerConfig(), "clm", rank=0, world_size=1)
        dm._saved_layout = {"world_size": 2, "batch_size": 3, "batch_tokens": None, "accumulate": 1}
        return dm

    assert module(3)._carry(5, 0) == 10  # 5 batches on 2 ranks of 3: 30 blocks, 10 batches of 3 here
    assert module(6)._carry(5, 0) == 5
    with pytest.raises(DataError, match=r"30 blocks, not a whole number of global micro-batches of 4 blocks"):
        module(4)._carry(5, 0)
