"""Per-row mixing's data (data/batches/row_mixing.py): how the rows of each batch are shared
among the tasks, which rows each task's sampler gives, and the stacked batches of a decoder's
mixture (each row with its task's attention mode and targets)."""

import collections

import pytest
import torch

from lit_transformer.data.batches.collate import IGNORE_INDEX
from lit_transformer.data.batches.progress import ScheduleProgress
from lit_transformer.data.batches.row_mixing import RowMixtureBatchSampler, rows_in_batch, rows_through, stack_rows
from lit_transformer.data.batches.sampler import ResumableBatchSampler
from lit_transformer.data.data_config import DataConfig, TokenizerConfig
from lit_transformer.data.modules.mixture_module import MixtureDataModule, MixtureTask
from lit_transformer.errors import DataError


@pytest.mark.parametrize("rates", [[1 / 16, 15 / 16], [0.2, 0.3, 0.5], [0.1, 0.0, 0.45, 0.45], [1 / 3, 2 / 3]])
@pytest.mark.parametrize("batch", [1, 3, 4, 16])
def test_rows_follow_the_rates_within_one_row_at_every_point(rates, batch):
    per_batch = [rows_in_batch(m, batch, rates) for m in range(64)]
    assert all(sum(rows) == batch and min(rows) >= 0 for rows in per_batch)
    total = [0] * len(rates)
    for m, rows in enumerate(per_batch):
        total = [a + b for a, b in zip(total, rows)]
        assert total == rows_through((m + 1) * batch, rates)
        assert all(abs(t - r * (m + 1) * batch) <= 1 for t, r in zip(total, rates)), (m, total)
    assert all(rows[t] == 0 for rows in per_batch for t, r in enumerate(rates) if r == 0)


def test_a_whole_share_gives_every_batch_the_same_rows():
    """GPT-BERT's 1 causal to 15 masked: 16 rows hold exactly 1 and 15, whatever the step."""
    assert {tuple(rows_in_batch(m, 16, [1 / 16, 15 / 16])) for m in (0, 1, 7, 10**9)} == {(1, 15)}
    assert {tuple(rows_in_batch(m, 256, [1, 15])) for m in range(5)} == {(16, 240)}  # weights as given
    # 4 rows: one causal row every 4 micro-batches
    assert [rows_in_batch(m, 4, [1, 15])[0] for m in range(12)].count(1) == 3


def samplers(sizes, rank=0, world=1):
    return [ResumableBatchSampler(n, 1, seed=5 + t, rank=rank, world_size=world) for t, n in enumerate(sizes)]


def take(sampler, k):
    it = iter(sampler)
    return [next(it) for _ in range(k)]


def test_each_task_takes_its_own_rows_in_its_own_order_across_epochs():
    progress = ScheduleProgress(max_steps=100)
    keys = take(
        RowMixtureBatchSampler(samplers((40, 9)), [0.25, 0.75], batch_size=4, accumulate=2, progress=progress), 30
    )
    assert [done for _, done in keys] == [m // 2 / 100 for m in range(30)]  # the share of the run at its step
    for t, n in enumerate((40, 9)):
        mine = [row for parts, _ in keys for task, rows in parts if task == t for row in rows]
        single = ResumableBatchSampler(n, 1, seed=5 + t)
        expected = []
        for epoch in range(20):
            single.set_epoch(epoch)
            expected += [(e, indices[0]) for e, _, indices in single]
        assert mine == expected[: len(mine)] and len(mine) == rows_through(30 * 4, [0.25, 0.75])[t]
    assert max(epoch for parts, _ in keys for task, rows in parts if task == 1 for epoch, _ in rows) >= 8


def test_ranks_take_disjoint_rows_and_a_resumed_sampler_continues_exactly():
    per_rank = [take(RowMixtureBatchSampler(samplers((40, 30), r, 2), [0.5, 0.5], batch_size=3), 20) for r in (0, 1)]
    for a, b in zip(*per_rank):
        assert [t for t, _ in a[0]] == [t for t, _ in b[0]]
        for (_, rows_a), (_, rows_b) in zip(a[0], b[0]):
            assert not {i for _, i in rows_a} & {i for _, i in rows_b}
    full = per_rank[0]
    for n in (0, 7, 13):
        counts = collections.Counter()
        for parts, _ in full[:n]:
            counts.update({t: len(rows) for t, rows in parts})
        resumed = RowMixtureBatchSampler(samplers((40, 30), 0, 2), [0.5, 0.5], batch_size=3)
        resumed.resume(n, [counts[0], counts[1]])
        assert take(resumed, 7) == full[n : n + 7]


def test_stacking_refuses_rows_of_another_shape():
    row = {"input_ids": torch.ones(2, 5, dtype=torch.long), "labels": torch.ones(2, 5, dtype=torch.long)}
    row["attention_mask"] = torch.ones(2, 5, dtype=torch.long)
    longer = {k: torch.ones(1, 6, dtype=torch.long) for k in row}
    with pytest.raises(DataError, match=r"tasks \[0, 1\] give rows of \[5, 6\] tokens"):
        stack_rows([row, longer], [0, 1])
    with pytest.raises(DataError, match=r"task 1's batches carry \['decoder_input_ids'\]"):
        stack_rows([row, {**row, "decoder_input_ids": row["input_ids"]}], [0, 1])


# ----------------------------------------------------------------------------- a decoder's mixture


DATA = dict(max_train_bytes=60_000, max_val_bytes=10_000, block_size=24, batch_size=4)
TOKENIZER = TokenizerConfig(vocab_size=300, max_train_bytes=60_000, num_sentinels=0)


def mixture(cache: str, objectives=("clm", "mntp", "mlm", "prefix_lm"), arch="decoder", mixing="row", **data):
    config = DataConfig(cache_dir=cache, **{**DATA, **data})
    pipelines = {"mlm": "mlm", "span": "span"}
    tasks = [MixtureTask(o, o, pipelines.get(o, "clm"), config) for o in objectives]
    weights = [1.0, 3.0, 2.0, 2.0][: len(tasks)]
    return MixtureDataModule(
        tasks, arch=arch, tokenizer=TOKENIZER, tokenizer_data=config, weights=weights, seed=2, mixing=mixing
    )


def test_a_stacked_batch_carries_each_rows_mode_and_targets(tmp_path_factory):
    dm = mixture(str(tmp_path_factory.getbasetemp() / "mntp-cache"), batch_size=8)
    dm.setup()
    it = iter(dm.train_dataloader())
    batches = [dm.on_before_batch_transfer(next(it), 0) for _ in range(6)]
    for m, batch in enumerate(batches):
        assert set(batch) == {"input_ids", "attention_mask", "labels", "prefix_lengths", "row_task"}
        assert batch["input_ids"].shape == batch["labels"].shape == (8, 24)
        counts = torch.bincount(batch["row_task"], minlength=4).tolist()
        assert counts == rows_in_batch(m, 8, dm.rates)
        modes = batch["prefix_lengths"]
        owner = batch["row_task"]
        assert (modes[owner == 0] == 0).all()  # clm: causal
        assert (modes[(owner == 1) | (owner == 2)] == 24).all()  # mntp, mlm: fully visible
        assert ((modes[owner == 3] > 0) & (modes[owner == 3] < 24)).all()  # prefix LM
        labelled = (batch["labels"] != IGNORE_INDEX).float().mean(1)
        assert (labelled[owner == 0] == 1).all() and (labelled[(owner == 1) | (owner == 2)] < 0.5).all()
        clm = owner == 0  # a causal row's labels are its next tokens
        assert torch.equal(batch["labels"][clm][:, :-1], batch["input_ids"][clm][:, 1:])
    assert dm.state_dict()["task_batches"] == [
        sum(rows_in_batch(m, 8, dm.rates)[t] for m in range(6)) for t in range(4)
    ]


def test_row_mixing_refuses_tasks_of_another_shape(tmp_path):
    with pytest.raises(DataError, match=r"tasks.span: mixture.mixing=row stacks rows of .* not span on model.arch="):
        mixture(str(tmp_path), ("span",), arch="encoder_decoder")
    with pytest.raises(DataError, match="tasks.mntp: mntp needs model.arch=decoder"):
        mixture(str(tmp_path), ("mlm", "mntp"), arch="encoder", mixing="step")
    config = DataConfig(cache_dir=str(tmp_path), **DATA)
    tasks = [MixtureTask("a", "clm", "clm", config), MixtureTask("b", "clm", "clm", DataConfig(batch_size=5))]
    with pytest.raises(DataError, match=r"one data.batch_size among the tasks' rows, got \{'a': 4, 'b': 5\}"):
        MixtureDataModule(tasks, arch="decoder", tokenizer=TOKENIZER, tokenizer_data=config, mixing="row")


def test_a_row_mixture_resumed_on_two_ranks_uses_every_row_once(tmp_path_factory):
    """Saved on one rank accumulating 2 micro-batches, resumed on 2 ranks without accumulation
    (the same global batch): each task goes on from the position its rows reached, the ranks
    taking the next positions of its order between them, none twice."""
    cache = str(tmp_path_factory.getbasetemp() / "mntp-cache")

    def module(rank, world, accumulate):
        config = DataConfig(cache_dir=cache, **DATA)
        tasks = [MixtureTask("clm", "clm", "clm", config), MixtureTask("mntp", "mntp", "clm", config)]
        return MixtureDataModule(
            tasks,
            arch="decoder",
            tokenizer=TOKENIZER,
            tokenizer_data=config,
            weights=[1.0, 3.0],
            seed=2,
            mixing="row",
            accumulate=accumulate,
            rank=rank,
            world_size=world,
            max_steps=100,
        )

    one = module(None, None, 2)
    one.setup()
    it = iter(one.train_dataloader())
    for _ in range(6):  # 3 optimizer steps
        one.on_before_batch_transfer(next(it), 0)
    state = one.state_dict()
    before = take(RowMixtureBatchSampler(one._sampler.samplers, one.rates, batch_size=4, seed=2, accumulate=2), 6)
    after = []
    for rank in (0, 1):
        resumed = module(rank, 2, 1)
        resumed.load_state_dict(state)
        resumed.setup()
        resumed.train_dataloader()
        resumed._begin_train_epoch()  # where iterating the loader starts: the layout carried
        after.append(take(resumed._sampler, 5))
    assert [done for _, done in after[0]] == [s / 100 for s in range(3, 8)]  # the same optimizer steps go on
    for t in (0, 1):
        used = [row for parts, _ in before for task, rows in parts if task == t for row in rows]
        new = [row for keys in after for parts, _ in keys for task, rows in parts if task == t for row in rows]
        assert len(new) == 2 * 5 * rows_in_batch(0, 4, [0.25, 0.75])[t]
        order = ResumableBatchSampler(len(one._train_examples(t)), 1, seed=2 + t).order(0)
        assert sorted(i for _, i in used + new) == sorted(order[: len(used) + len(new)].tolist())
