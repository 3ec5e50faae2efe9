"""Token-count batching (data.batch_tokens): batches of similar length within a token budget,
every example once per epoch, equal batch counts on every rank, exact resume, and far less
padding than batches of a fixed number of random examples."""

from __future__ import annotations

import numpy as np
import pytest

from lit_transformer.commands.cli import main
from lit_transformer.data.batches.sampler import ResumableBatchSampler, TokenBatchSampler
from lit_transformer.data.data_config import DataConfig, TokenizerConfig
from lit_transformer.data.modules.text_module import TextDataModule

# sentence lengths with a long tail, as in real parallel text (a few sentences 10x the median)
LENGTHS = np.random.default_rng(0).lognormal(2.3, 0.5, size=997).astype(int) + 1


def members(sampler, epoch):
    sampler.set_epoch(epoch)
    return [idx for _, _, idx in sampler]


@pytest.mark.parametrize("budget", [64, 301])
def test_batches_fit_the_budget_and_cover_every_example_once(budget):
    sampler = TokenBatchSampler(LENGTHS, budget, seed=5)
    epochs = [members(sampler, e) for e in (0, 1)]
    for batches in epochs:
        assert len(batches) == len(sampler)
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(LENGTHS)))  # each example exactly once
        for b in batches:
            cost = len(b) * LENGTHS[list(b)].max()
            assert cost <= budget or len(b) == 1  # only a single over-long example exceeds it
    assert epochs[0] != epochs[1]  # a new order every epoch
    assert members(TokenBatchSampler(LENGTHS, budget, seed=5), 1) == epochs[1]  # deterministic


def test_sorted_batches_waste_less_padding_than_random_ones():
    token_batches = members(TokenBatchSampler(LENGTHS, 400), 0)
    mean_size = round(np.mean([len(b) for b in token_batches]))
    random_batches = members(ResumableBatchSampler(len(LENGTHS), mean_size), 0)

    def efficiency(batches):
        return sum(LENGTHS[list(b)].sum() for b in batches) / sum(len(b) * LENGTHS[list(b)].max() for b in batches)

    assert efficiency(token_batches) > 0.9 > 0.6 > efficiency(random_batches)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_get_disjoint_batches_of_equal_count(world):
    per_rank = [members(TokenBatchSampler(LENGTHS, 200, seed=1, rank=r, world_size=world), 2) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1
    flat = [i for batches in per_rank for b in batches for i in b]
    assert len(flat) == len(set(flat))
    single = members(TokenBatchSampler(LENGTHS, 200, seed=1), 2)
    assert len(single) - len(per_rank[0]) * world < world  # only the remainder is dropped


def test_resume_skips_exactly_the_consumed_batches():
    full = members(TokenBatchSampler(LENGTHS, 150, seed=2), 3)
    resumed = TokenBatchSampler(LENGTHS, 150, seed=2)
    resumed.resume(3, 7)
    assert members(resumed, 3) == full[7:]


def test_data_module_refuses_token_batches_of_packed_blocks(tmp_path):
    from lit_transformer.errors import DataError

    with pytest.raises(DataError, match="data.batch_tokens is for seq2seq and classify; 'clm'"):
        TextDataModule(DataConfig(cache_dir=str(tmp_path), batch_tokens=256), TokenizerConfig(), "clm")


def test_seq2seq_module_batches_by_tokens(tmp_path):
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"), max_length=24, max_target_length=8, batch_tokens=96)
    dm = TextDataModule(cfg, TokenizerConfig(kind="unigram", vocab_size=1500, num_sentinels=0), "seq2seq")
    dm.prepare_data()
    dm.setup()
    sizes = set()
    for batch in dm.train_dataloader():
        rows = batch["input_ids"].shape[0]
        longest = max(batch["input_ids"].shape[1], batch["labels"].shape[1])
        assert rows * longest <= 96 or rows == 1
        sizes.add(rows)
    assert len(sizes) > 2  # short sentences travel in bigger batches
    val = next(iter(dm.val_dataloader()))
    assert val["input_ids"].shape[0] == cfg.batch_size  # validation keeps batch_size


@pytest.mark.parametrize(
    "recipe,extra,message",
    [
        ("tiny-clm", [], "data.batch_tokens is for seq2seq and classify"),
        ("tiny-unilm", [], "data.batch_tokens is not offered in a mixture"),
        ("tiny-seq2seq", ["data.batch_tokens=0"], "data.batch_tokens=0"),
    ],
)
def test_batch_tokens_refused_where_it_does_not_apply(recipe, extra, message, tmp_path, capsys):
    from helpers import RECIPES

    args = ["pretrain", str(RECIPES / f"{recipe}.yaml"), "data.batch_tokens=512", *extra, f"run.dir={tmp_path / 'r'}"]
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_token_batched_run_resumes_exactly(tmp_path, private_cache):
    from helpers import RECIPES, SMALL, StopAt, losses

    from lit_transformer.commands.train import train
    from lit_transformer.recipe.load import load_recipe

    args = [
        *SMALL,
        "data.batch_tokens=80",
        "model.dropout=0.0",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "trainer.checkpoint_every_n_steps=3",
        "generation.enabled=false",
        "trainer.precision=32-true",
    ]
    recipe = RECIPES / "tiny-seq2seq.yaml"
    train(load_recipe(recipe, [*args, f"run.dir={tmp_path / 'straight'}"]), progress_bar=False)
    resumed = [*args, f"run.dir={tmp_path / 'resumed'}"]
    train(load_recipe(recipe, resumed), callbacks=[StopAt(3)], progress_bar=False)
    train(load_recipe(recipe, [*resumed, "resume=auto"]), progress_bar=False)
    straight, again = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert sorted(straight) == sorted(again) == list(range(6))
    assert [again[s] for s in range(6)] == pytest.approx([straight[s] for s in range(6)], abs=1e-6)
