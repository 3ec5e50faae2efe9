"""`auto` recipe values (recipe/auto_rules.py, training/auto_resolve.py): the model's size, the vocabulary,
dropout and the batch resolved from the corpus and the budget when a run starts, deterministic for
a given corpus and step speed, recorded in config.yaml so the run repeats without them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import RECIPES, TINY_RUN, losses, tiny_run_config
from safetensors.torch import load_file

from lit_transformer.commands.cli import main
from lit_transformer.commands.train import train
from lit_transformer.model.accounting import non_embedding_parameters
from lit_transformer.recipe import auto_rules
from lit_transformer.recipe.load import RecipeError, load_recipe, to_yaml
from lit_transformer.run.resolve import resolve_run
from lit_transformer.training import auto_resolve

# the tiny runs' shape keys back to null, so that model.size=auto may choose them
NO_SHAPE = ["model.d_model=null", "model.n_heads=null", "model.d_ff=null", "model.n_layers=null"]
ALL_AUTO = [*NO_SHAPE, "model.size=auto", "tokenizer.vocab_size=auto", "model.dropout=auto"]


@pytest.fixture(autouse=True)
def _no_inherited_values(monkeypatch):
    """resolve_auto leaves its values in the environment for the processes a launcher starts:
    restored after each test."""
    monkeypatch.setenv(auto_resolve.ENV, "{}")


def write_corpus(folder: Path, megabytes: float) -> Path:
    """A text file of the given size (only its size matters to the rules)."""
    path = folder / f"corpus-{megabytes}.txt"
    line = "the quick brown fox jumps over the lazy dog again and again\n"
    path.write_text(line * math.ceil(megabytes * 1e6 / len(line)))
    return path


def fixed_speed(flops: float):
    def measure(model, trainer, data):
        return flops

    return measure


def resolve_auto(cfg, **options):
    """The config a run of `cfg` trains with (run/resolve.py resolves its `auto` values)."""
    return resolve_run(cfg, training=False, **options).config


def resolved(tmp_path: Path, megabytes: float, flops: float, *extra: str):
    corpus = write_corpus(tmp_path, megabytes)
    cfg = tiny_run_config(
        tmp_path / "run", *ALL_AUTO, f"data.train_files=[{corpus}]", "data.max_train_bytes=null", *extra
    )
    return resolve_auto(cfg, measure=fixed_speed(flops), quiet=True)


# ----------------------------------------------------------------------------- the rules


def test_auto_values_resolve_deterministically_from_the_corpus_and_the_step_speed(tmp_path):
    a = resolved(tmp_path, 1.26, 5e9, "trainer.max_time=250", "data.batch_size=auto")
    b = resolved(tmp_path, 1.26, 5e9, "trainer.max_time=250", "data.batch_size=auto")
    assert to_yaml(a) == to_yaml(b)
    assert auto_rules.auto_keys(a) == []  # plain values everywhere
    model = a.model
    # the rules by hand: the tokens the budget buys, per weight, choose the shape
    chosen = (model.d_model, model.n_layers, model.n_heads)
    assert chosen in auto_rules.SHAPES
    tokens = 5e9 * 250 / auto_rules.flops_per_token(load_model(a), a.data.block_size)
    assert tokens >= auto_rules.TOKENS_PER_WEIGHT * non_embedding_parameters(load_model(a))
    index = auto_rules.SHAPES.index(chosen)
    if index + 1 < len(auto_rules.SHAPES):  # the next shape up would not have seen enough tokens per weight
        bigger = auto_rules.shape_config(load_model(a), *auto_rules.SHAPES[index + 1])
        bigger = bigger.replace(vocab_size=auto_rules.vocab_for(1_260_000, bigger))
        assert 5e9 * 250 / auto_rules.flops_per_token(bigger, a.data.block_size) < auto_rules.TOKENS_PER_WEIGHT * (
            non_embedding_parameters(bigger)
        )
    assert a.tokenizer.vocab_size == model.vocab_size == auto_rules.vocab_for(1_260_000, load_model(a))
    passes = tokens * auto_rules.BYTES_PER_TOKEN / 1_260_000
    assert a.model.dropout == auto_rules.dropout_for(passes)
    steps = tokens / (a.data.batch_size * a.data.block_size)
    assert steps >= auto_rules.MIN_STEPS > steps / 2  # the largest power-of-two batch leaving MIN_STEPS


def load_model(cfg):
    from lit_transformer.recipe.model_section import model_config

    return model_config(cfg)


def test_a_faster_machine_gets_a_larger_model_and_a_larger_corpus_a_larger_vocabulary(tmp_path):
    slow = resolved(tmp_path, 1.0, 1e9, "trainer.max_time=250")
    fast = resolved(tmp_path, 1.0, 1e11, "trainer.max_time=250")
    assert non_embedding_parameters(load_model(fast)) > non_embedding_parameters(load_model(slow))
    # the corpus alone, the head bound off (a wide model): a power of two near bytes / 150
    assert [auto_rules.vocab_for(n, None) for n in (100_000, 600_000, 1_260_000, 5_000_000)] == [
        1024,
        4096,
        8192,
        32768,
    ]
    wide = auto_rules.shape_config(load_model(fast), 768, 12, 12)
    assert auto_rules.vocab_for(5_000_000, wide) == 32768
    narrow = auto_rules.shape_config(load_model(fast), 96, 2, 2)
    assert auto_rules.vocab_for(5_000_000, narrow) == 2048  # the head may not outweigh two 96-wide blocks


def test_dropout_grows_with_the_passes_over_the_corpus():
    assert [auto_rules.dropout_for(p) for p in (0.5, 1.5, 2.0, 3.0, 4.0, 6.0, 7.5, 9.0, 40.0)] == [
        0.0, 0.0, 0.0, 0.05, 0.05, 0.1, 0.15, 0.2, 0.2
    ]  # fmt: skip


def test_dropout_agrees_with_the_runs_it_cites():
    """auto_rules' docstring: 1.4 passes of WMT news wanted none, 5 passes of WikiText-2 0.1 (as
    does speedrun-clm's 5.9 on WikiText-2), 10 passes 0.2."""
    assert [auto_rules.dropout_for(p) for p in (1.4, 5.0, 5.9, 10.0)] == [0.0, 0.1, 0.1, 0.2]


def test_without_a_time_budget_max_steps_is_the_budget_and_nothing_is_measured(tmp_path):
    def no_measure(*_):
        raise AssertionError("max_steps budgets need no speed")

    cfg = tiny_run_config(tmp_path / "run", *ALL_AUTO, "trainer.max_steps=200")
    out = resolve_auto(cfg, measure=no_measure, quiet=True)
    tokens = 200 * 3 * 24  # steps x TINY_RUN's batch x block
    assert (out.model.d_model, out.model.n_layers, out.model.n_heads) == auto_rules.SHAPES[
        0
    ]  # few tokens: the smallest
    assert out.model.dropout == auto_rules.dropout_for(tokens * auto_rules.BYTES_PER_TOKEN / 150_000)


# ----------------------------------------------------------------------------- runs


def test_a_run_with_the_resolved_values_written_out_equals_the_auto_run(tmp_path, capsys):
    auto_run = tmp_path / "auto"
    assert main(["pretrain", str(RECIPES / "tiny-clm.yaml"), *TINY_RUN, *ALL_AUTO, f"run.dir={auto_run}",
                 "trainer.max_steps=4", "trainer.val_check_interval=4", "model.max_seq_len=32"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "auto: model.d_model=96 model.n_layers=2 model.n_heads=2" in err and "tokenizer.vocab_size=1024" in err
    written = load_recipe(auto_run / "config.yaml", [f"run.dir={tmp_path / 'plain'}"])
    assert auto_rules.auto_keys(written) == [] and written.model.d_model == 96 and written.tokenizer.vocab_size == 1024
    train(written, progress_bar=False)
    assert losses(auto_run) == losses(tmp_path / "plain")
    a, b = load_file(auto_run / "model.safetensors"), load_file(tmp_path / "plain" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_print_config_shows_the_resolved_values(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(auto_resolve, "measure_flops_per_second", fixed_speed(2e9))
    corpus = write_corpus(tmp_path, 0.6)
    args = [*TINY_RUN, *ALL_AUTO, f"data.train_files=[{corpus}]", "trainer.max_time=60", "data.max_train_bytes=null"]
    assert main(["pretrain", str(RECIPES / "tiny-clm.yaml"), *args, "--print-config"]) == 0
    out, err = capsys.readouterr()
    assert "auto: model.d_model=" in err and "GFLOP/s measured" in err
    expected = resolve_auto(load_recipe(RECIPES / "tiny-clm.yaml", args), measure=fixed_speed(2e9))
    assert out == to_yaml(expected) and auto_rules.auto_keys(expected) == []


def test_a_resumed_run_takes_the_values_its_config_recorded(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    first = resolved(tmp_path, 1.0, 3e9, "trainer.max_time=100", f"run.dir={run_dir}")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(first))

    def no_measure(*_):
        raise AssertionError("a resume must not measure again")

    corpus = write_corpus(tmp_path, 1.0)
    cfg = tiny_run_config(run_dir, *ALL_AUTO, f"data.train_files=[{corpus}]", "data.max_train_bytes=null",
                          "trainer.max_time=100", "resume=auto")  # fmt: skip
    again = resolve_auto(cfg, measure=no_measure, quiet=True)
    assert again.model == first.model and again.tokenizer == first.tokenizer


def test_processes_a_launcher_starts_take_the_first_process_values(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(auto_resolve.ENV, json.dumps({"run_dir": str(run_dir), "values": {"model.dropout": 0.2}}))
    cfg = tiny_run_config(run_dir, "model.dropout=auto", "trainer.max_time=10")

    def no_measure(*_):
        raise AssertionError("the values come from the first process")

    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_auto(cfg, measure=no_measure, quiet=True).model.dropout == 0.2
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's first process: every process would measure its own
    with pytest.raises(RecipeError, match="torchrun or srun"):
        resolve_auto(cfg, measure=no_measure, quiet=True)


def test_the_speed_probe_measures_a_real_step():
    cfg = load_recipe(RECIPES / "tiny-clm.yaml", [*TINY_RUN])
    flops = auto_resolve.measure_flops_per_second(load_model(cfg), cfg.trainer, cfg.data)
    assert math.isfinite(flops) and 1e6 < flops < 1e13


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["model.size=auto"], "model.size=auto chooses model.d_model, which is set to 24"),
        (["model.size=big"], "model.size='big' must be 'auto' or null"),
        ([*NO_SHAPE, "model.size=auto", "model.preset=gpt2-small"], "model.preset=gpt2-small too"),
        (["tokenizer.vocab_size=auto", "tokenizer.path=tok.json"], "tokenizer.path=tok.json is one already trained"),
        (["tokenizer.vocab_size=auto", "model.vocab_size=300"], "model.vocab_size=300"),
        (["tokenizer.vocab_size=lots"], "tokenizer.vocab_size='lots' must be a positive integer or 'auto'"),
        (["data.batch_size=auto"], "data.batch_size=auto sizes the batch from trainer.max_time, which is null"),
        (["model.dropout=auto", "data.streaming=true"], "model.dropout=auto reads the size of the training files"),
        (["model.dropout=auto", "objective.name=seq2seq"], "not objective.name=seq2seq"),
        (["model.dropout=auto", "data.hub_name=wikitext"], "data.hub_name=wikitext has none here"),
    ],
)
def test_bad_auto_combinations_are_one_line_errors(tmp_path, extra, message):
    with pytest.raises(RecipeError) as error:
        tiny_run_config(tmp_path, *extra)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_auto_with_a_fine_tuning_source_or_a_mixture_is_refused(tmp_path):
    with pytest.raises(RecipeError, match=r"model.dropout=auto sizes a model trained from scratch; finetune.from"):
        load_recipe(RECIPES / "tiny-classify-from-pretrained.yaml", ["model.dropout=auto"])
    with pytest.raises(RecipeError, match=r"model.dropout=auto reads one corpus; a mixture"):
        load_recipe(RECIPES / "tiny-unilm.yaml", ["model.dropout=auto"])
