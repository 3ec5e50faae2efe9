"""Recipes: every file in recipes/ loads and builds its model; the schema's errors are one
line naming the file, the full key and the closest valid key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import RECIPES

from lit_transformer.model.config import TransformerConfig, preset
from lit_transformer.model.language_model import LanguageModel
from lit_transformer.recipe.auto_rules import auto_keys
from lit_transformer.recipe.load import (
    RecipeError,
    RunConfig,
    load_recipe,
    save_config,
    to_dict,
)
from lit_transformer.recipe.model_section import model_config
from lit_transformer.run.resolve import resolve_run

ALL = sorted(RECIPES.glob("*.yaml"))
PAPER_PARAMETERS = {  # millions, from each paper (ours: the recipe's tokenizer vocabulary)
    "bert-base-mlm": (108, 111),  # Devlin et al. 2019: 110M
    "gpt2-small-clm": (123, 126),  # Radford et al. 2019: 124M (117M as first reported)
    "t5-base-span": (220, 224),  # Raffel et al. 2020: 220M
    "transformer-base-wmt": (60, 66),  # Vaswani et al. 2017 Table 3: 65M
    "transformer-big-wmt": (208, 215),  # Vaswani et al. 2017 Table 3: 213M
    "llama-style-clm": (1090, 1110),  # TinyLlama: 1.1B
    "ul2-base": (220, 225),  # Tay et al. 2022 trained T5 sizes; T5-base: 220M
    "unilm-base": (120, 126),  # Dong et al. 2019 used BERT-base's shape: 110M (+ GPT-2's 50k vocabulary)
    "gptbert-base": (110, 114),  # ours: GPT-BERT's base shape (12 x 768, GEGLU 2560) and 16k vocabulary
    "speedrun-clm": (1, 6),  # ours: sized for 5 minutes on 2 CPU cores
    "small-corpus-translation": (5, 6.5),  # ours: a 2017-style model for 2 CPU cores, 8k shared BPE
}


def test_the_recipes_promised_exist():
    names = {p.stem for p in ALL}
    for objective in ("mlm", "clm", "span", "seq2seq", "classify", "unilm", "ul2", "gptbert"):
        assert f"tiny-{objective}" in names
    assert {
        "tiny-classify-from-pretrained",
        "minilm-classify",
        "transformer-base-wmt",
        "bert-base-mlm",
        "gpt2-small-clm",
        "t5-base-span",
        "llama-style-clm",
    } <= names


@pytest.mark.parametrize("path", ALL, ids=[p.stem for p in ALL])
def test_every_recipe_loads_and_builds(path):
    cfg = load_recipe(path)
    assert isinstance(cfg, RunConfig) and isinstance(cfg.trainer.max_steps, int)
    if cfg.finetune.from_ is not None:  # the model comes from elsewhere: a run or MiniLM
        assert cfg.objective.name == "classify"
        if cfg.finetune.from_ == "minilm":
            from lit_transformer.run.loading import resolve_source

            source = resolve_source("minilm")
            assert source.kind == "model" and source.tokenizer is not None
        return
    if auto_keys(cfg):  # sized when the run starts: here at a fixed 100 GFLOP/s, 2 CPU cores' order
        cfg = resolve_run(cfg, measure=lambda *_: 100e9, training=False, quiet=True).config
    model_cfg = model_config(cfg)
    big = "tiny" not in path.stem
    model = LanguageModel.from_config(model_cfg, device="meta" if big else "cpu")
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    if big:
        low, high = PAPER_PARAMETERS[path.stem]
        assert low <= millions <= high, millions
    else:
        assert millions < 2
        ids = torch.randint(0, model_cfg.vocab_size, (3, 7))
        extra = {"decoder_input_ids": ids[:, :5]} if model_cfg.arch == "encoder_decoder" else {}
        assert model(ids, **extra).shape[:2] == (3, 5 if extra else 7)


def test_paper_recipes_keep_the_papers_settings():
    wmt = load_recipe(RECIPES / "transformer-base-wmt.yaml")
    o = wmt.optim
    assert (o.schedule, o.warmup_steps, o.label_smoothing, o.beta1, o.beta2, o.eps, o.lr) == (
        "inverse_sqrt",
        4000,
        0.1,
        0.9,
        0.98,
        1e-9,
        1.0,
    )
    assert wmt.data.source_files[0].endswith("train.en") and wmt.data.target_files[0].endswith("train.de")
    assert model_config(wmt).norm_position == "post"
    assert load_recipe(RECIPES / "t5-base-span.yaml").trainer.precision.startswith("bf16")
    assert model_config(load_recipe(RECIPES / "llama-style-clm.yaml")).n_kv_heads == 4


@pytest.mark.parametrize("name", ["transformer-base-wmt", "transformer-big-wmt", "small-corpus-translation"])
def test_translation_recipes_decode_and_average_as_the_paper(name):
    """Vaswani et al. 2017, 6.1: beam 4, length penalty 0.6, the average of the last 5 checkpoints;
    5.1: batches by token count. The paper's recipes keep its schedule; the CPU ones decay
    linearly to the end of their 15-minute budget."""
    cfg = load_recipe(RECIPES / f"{name}.yaml")
    assert (cfg.objective.name, cfg.objective.num_beams, cfg.objective.length_penalty) == ("seq2seq", 4, 0.6)
    assert cfg.trainer.average_last == 5 and cfg.optim.label_smoothing == 0.1
    assert cfg.tokenizer.kind == "bpe" and cfg.data.batch_tokens is not None
    if name.startswith("transformer-"):
        assert cfg.optim.schedule == "inverse_sqrt" and cfg.trainer.max_time is None
    else:
        assert cfg.optim.schedule == "linear" and cfg.trainer.max_time is not None and cfg.trainer.max_time <= 13 * 60


# Every field unlike gpt2-small's (the test checks that), in a combination the core accepts.
UNLIKE_GPT2 = dict(
    arch="encoder_decoder",
    vocab_size=301,
    d_model=48,
    n_heads=4,
    n_layers=3,
    d_ff=70,
    n_decoder_layers=2,
    n_kv_heads=2,
    head_dim=8,
    max_seq_len=40,
    position="rope",
    rope_base=500.0,
    relative_buckets=16,
    relative_max_distance=64,
    norm="rmsnorm",
    norm_eps=1e-6,
    norm_position="post",
    embedding_norm=True,
    activation="swiglu",
    bias=False,
    dropout=0.2,
    attention_dropout=0.05,
    scale_embeddings=True,
    scale_attention=False,
    type_vocab_size=2,
    tie_embeddings=False,
    lm_head="bert_mlm",
    scale_decoder_output=True,
    init_std=0.03,
    attention_impl="math",
    sliding_window=16,
    global_tokens=1,
    qk_norm=True,
)


def test_every_model_field_reaches_the_model_config(tmp_path):
    """Each core field written in a recipe arrives in the built config: all of them at once
    over a preset that differs in every one (a field added to the core must join UNLIKE_GPT2)."""
    want = TransformerConfig(**UNLIKE_GPT2)
    base = preset("gpt2-small").to_dict()
    every = {f.name for f in dataclasses.fields(TransformerConfig)} - {"attention_kind"}  # linear excludes a window
    assert {k for k, v in want.to_dict().items() if base[k] != v} == every
    path = write(tmp_path, "all.yaml", "objective:\n  name: span\nmodel:\n  preset: gpt2-small\n")
    cfg = load_recipe(path, [f"model.{k}={v}" for k, v in UNLIKE_GPT2.items()])
    assert model_config(cfg) == want
    linear = load_recipe(
        path, ["model.arch=encoder_decoder", "model.attention_kind=linear", "model.attention_dropout=0"]
    )
    assert model_config(linear).attention_kind == "linear"


def test_a_single_value_is_a_list_of_one(tmp_path):
    cfg = load_recipe(
        write(tmp_path, "one.yaml", BASE + "data:\n  val_files: valid.txt\n"),
        ["data.train_files=corpus.txt", "logger.wandb.tags=tiny", "generation.prompts=def main("],
    )
    assert (cfg.data.train_files, cfg.data.val_files) == (["corpus.txt"], ["valid.txt"])
    assert cfg.logger.wandb.tags == ["tiny"] and cfg.generation.prompts == ["def main("]
    assert load_recipe(write(tmp_path, "two.yaml", BASE), ["data.train_files=[a.txt,b.txt]"]).data.train_files == [
        "a.txt",
        "b.txt",
    ]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


BASE = "objective:\n  name: clm\nmodel:\n  preset: gpt2-small\n"


def test_extends_and_overrides_merge_in_order(tmp_path):
    write(tmp_path, "base.yaml", BASE + "trainer:\n  max_steps: 5\n  seed: 3\n")
    write(tmp_path, "mid.yaml", "extends: base.yaml\ntrainer:\n  max_steps: 7\n")
    child = write(tmp_path, "child.yaml", "extends: mid.yaml\noptim:\n  lr: 0.01\nfinetune:\n  pooling: last\n")
    cfg = load_recipe(child, ["trainer.seed=11", "model.d_model=96", "logger.wandb.tags=[a,b]"])
    assert (cfg.trainer.max_steps, cfg.trainer.seed, cfg.optim.lr) == (7, 11, 0.01)
    assert model_config(cfg).d_model == 96 and model_config(cfg).n_layers == 12
    assert cfg.logger.wandb.tags == ["a", "b"]
    assert cfg.run.dir == str(Path("runs") / "child")  # default run directory: the recipe's name
    assert type(cfg.trainer).__module__ == "lit_transformer.recipe.schema"  # plain dataclasses, no DictConfig


def test_saved_config_reads_back_equal(tmp_path):
    cfg = load_recipe(RECIPES / "tiny-classify-from-pretrained.yaml", ["trainer.max_steps=9"])
    save_config(cfg, tmp_path / "config.yaml")
    assert "from: runs/tiny-mlm" in (tmp_path / "config.yaml").read_text()
    assert load_recipe(tmp_path / "config.yaml") == cfg
    assert to_dict(cfg)["finetune"]["from"] == "runs/tiny-mlm"


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        (
            BASE + "trainer:\n  max_step: 3\n",
            [],
            r"bad\.yaml: unknown key trainer\.max_step \(did you mean `trainer\.max_steps`\?\)",
        ),
        (BASE + "trainer:\n  lr: 3\n", [], r"bad\.yaml: unknown key trainer\.lr \(did you mean `optim\.lr`\?\)"),
        (BASE + "trainr:\n  max_steps: 3\n", [], r"bad\.yaml: unknown key trainr \(did you mean `trainer`\?\)"),
        (
            BASE + "logger:\n  wandb:\n    mdoe: online\n",
            [],
            r"unknown key logger\.wandb\.mdoe \(did you mean `logger\.wandb\.mode`\?\)",
        ),
        (BASE + "trainer:\n  max_steps: many\n", [], r"bad\.yaml: trainer\.max_steps: Value 'many' .* Integer"),
        (
            BASE + "trainer:\n  precision: bf16\n",
            [],
            r"trainer\.precision: Invalid value 'bf16'.*\(did you mean `bf16-",
        ),
        (
            BASE,
            ["trainer.max_stepz=3"],
            r"command line: unknown key trainer\.max_stepz \(did you mean `trainer\.max_steps`\?\)",
        ),
        (BASE, ["optim.lr=fast"], r"command line: optim\.lr: Value 'fast'"),
        (BASE, ["trainer.max_steps"], r"command line: override 'trainer\.max_steps' is not key=value"),
        (BASE, ["optim.lr=-0.1"], r"bad\.yaml: optim\.lr=-0\.1 must be positive"),
        (BASE, ["model.dropout=1.5"], r"bad\.yaml: model\.dropout=1\.5 is outside \[0, 1\)"),
        (BASE, ["optim.label_smoothing=1"], r"optim\.label_smoothing=1\.0 is outside \[0, 1\)"),
        (BASE, ["data.mlm_probability=2"], r"bad\.yaml: data\.mlm_probability=2\.0 must be in \[0, 1\)"),
        (BASE, ["model.d_model=100"], r"bad\.yaml: model\.d_model=100 is not divisible by model\.n_heads=12"),
        (BASE, ["objective.name=mlm"], r"objective\.name=mlm needs model\.arch in \['encoder'\], got 'decoder'"),
        (BASE, ["trainer.devices=0"], r"trainer\.devices=0 must be a positive integer or 'auto'"),
        ("model:\n  preset: gpt2-small\n", [], r"bad\.yaml: missing value for objective\.name"),
        ("objective:\n  name: clm\nmodel:\n  arch: decoder\n", [], r"missing value for model\.d_model"),
        (BASE + "trainer:\n  max_steps: [1, 2\n", [], r"bad\.yaml: line \d+, column \d+: malformed YAML"),
        (BASE + "model:\n  d_model: 96\n", [], r"bad\.yaml: line 5, column 1: malformed YAML: duplicate key 'model'"),
        ("- a\n- b\n", [], r"bad\.yaml: a recipe is a mapping of sections, got list"),
        ("extends: nowhere.yaml\n" + BASE, [], r"bad\.yaml: extends .*nowhere\.yaml: no such recipe file"),
    ],
)
def test_bad_recipes_give_one_line_errors(tmp_path, text, overrides, message):
    path = write(tmp_path, "bad.yaml", text)
    with pytest.raises(RecipeError, match=message) as info:
        load_recipe(path, overrides)
    assert "\n" not in str(info.value)


def test_error_in_a_parent_names_the_parent(tmp_path):
    write(tmp_path, "parent.yaml", BASE + "optim:\n  lrr: 1\n")
    child = write(tmp_path, "child.yaml", "extends: parent.yaml\n")
    with pytest.raises(RecipeError, match=r"parent\.yaml: unknown key optim\.lrr \(did you mean `optim\.lr`\?\)"):
        load_recipe(child)


def test_extends_cycle_and_missing_file(tmp_path):
    write(tmp_path, "a.yaml", "extends: b.yaml\n")
    write(tmp_path, "b.yaml", "extends: a.yaml\n")
    with pytest.raises(RecipeError, match=r"extends cycle: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_recipe(tmp_path / "a.yaml")
    with pytest.raises(RecipeError, match=r"missing\.yaml: no such recipe file"):
        load_recipe(tmp_path / "missing.yaml")
