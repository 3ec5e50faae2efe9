"""The model a recipe describes, resolved in one place: preset + the recipe's model keys + the
tokenizer's vocabulary -> TransformerConfig (`build_model_config`), written back as a complete
model section (`complete_model`), and checked against the objective and the data (`check_fits`).

load_recipe completes the model of a from-scratch recipe without `auto` values; a recipe with
them is completed when the run starts (run/resolve.py, through training/auto_resolve.py); a
fine-tuning recipe's model comes with its source's weights and is checked then.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lit_transformer.data.data_config import AUTO, BLOCK_WARMUP_OBJECTIVES, LM_OBJECTIVES, check_store_dir
from lit_transformer.errors import DataError, RecipeError
from lit_transformer.model.config import ConfigError, TransformerConfig, preset
from lit_transformer.recipe import auto_rules, registry, tasks
from lit_transformer.recipe.schema import ModelSection, RunConfig


def complete_model(cfg: RunConfig, source: str) -> RunConfig:
    """`cfg` with its model section holding every field of the model it describes, checked."""
    model = build_model_config(cfg, source)
    check_fits(cfg, model, source)
    cfg.model = ModelSection(preset=cfg.model.preset, **model.to_dict())
    return cfg


def build_model_config(cfg: RunConfig, source: str = "recipe") -> TransformerConfig:
    """preset + overrides + vocabulary -> TransformerConfig, for a recipe that trains from
    scratch. Core ConfigErrors become RecipeErrors naming the file."""
    values = model_overrides(cfg)
    if "vocab_size" not in values:
        values["vocab_size"] = tokenizer_vocab_size(cfg, source)
    return _model_from(cfg.model.preset, values, source)


def stand_in_model(cfg: RunConfig, source: str = "recipe") -> TransformerConfig:
    """The model of a recipe with `auto` values, valid values standing in for them
    (auto_rules.STAND_IN, the shape SHAPES[3]): the recipe's checks run on it at load, and the
    rules size from it (every value they choose replaces a stand-in)."""
    values = {k: v for k, v in model_overrides(cfg).items() if v != AUTO}
    if cfg.model.size == AUTO:
        d_model, n_layers, n_heads = auto_rules.SHAPES[3]
        values.update(d_model=d_model, n_layers=n_layers, n_heads=n_heads, d_ff=4 * d_model)
    if cfg.model.dropout == AUTO:
        values["dropout"] = auto_rules.STAND_IN["dropout"]
    if "vocab_size" not in values:
        auto_vocab = cfg.tokenizer.vocab_size == AUTO
        values["vocab_size"] = auto_rules.STAND_IN["vocab_size"] if auto_vocab else tokenizer_vocab_size(cfg, source)
    return _model_from(cfg.model.preset, values, source)


def _model_from(preset_name: str | None, values: dict[str, Any], source: str) -> TransformerConfig:
    try:
        if preset_name is not None:
            return preset(preset_name, **values)
        missing = [
            f.name
            for f in dataclasses.fields(TransformerConfig)
            if f.default is dataclasses.MISSING and f.name not in values
        ]
        if missing:
            raise RecipeError(
                f"{source}: missing value for model.{missing[0]} (set model.preset, or all of "
                f"{', '.join('model.' + m for m in missing)})"
            )
        return TransformerConfig(**values)
    except ConfigError as error:
        raise RecipeError(f"{source}: {error}") from None


def tokenizer_vocab_size(cfg: RunConfig, source: str = "recipe") -> int:
    """The embedding size a recipe's tokenizer needs: the size of tokenizer.path's tokenizer,
    else tokenizer.vocab_size (a trained tokenizer has at most that many tokens)."""
    if cfg.tokenizer.path is None:
        return cfg.tokenizer.vocab_size
    from lit_transformer.data.tokens.tokenizer import (
        load_tokenizer,  # the tokenizers library, only when a recipe names a file
    )

    try:
        return load_tokenizer(cfg.tokenizer.path).get_vocab_size(with_added_tokens=True)
    except DataError as error:
        raise RecipeError(f"{source}: {error}") from None


def model_overrides(cfg: RunConfig) -> dict[str, Any]:
    """The model fields the recipe sets explicitly (None means: keep the preset's or source's value)."""
    return {k: v for k, v in dataclasses.asdict(cfg.model).items() if k not in ("preset", "size") and v is not None}


def model_config(cfg: RunConfig) -> TransformerConfig:
    """The TransformerConfig a loaded from-scratch recipe describes (its model section is complete)."""
    if cfg.finetune.from_ is not None:
        raise RecipeError("a fine-tuning recipe's model comes from finetune.from: load it with loading.load_backbone")
    if auto_rules.auto_keys(cfg):
        raise RecipeError(
            f"{', '.join(auto_rules.auto_keys(cfg))} = auto: resolved when the run starts (run/resolve.py)"
        )
    return TransformerConfig(**model_overrides(cfg))


def longest_input(cfg: RunConfig) -> tuple[str, int]:
    """(key, value) of the longest sequence the objective (or any task of a mixture) feeds the model."""
    if cfg.tasks:
        return tasks.longest_task_input(cfg)
    keys = registry.spec(cfg.objective.name).length_keys
    return max(((f"data.{k}", getattr(cfg.data, k)) for k in keys), key=lambda item: item[1])


DOCUMENT_MASK_OBJECTIVES = ("clm", "mlm")  # the collators that see packed documents whole


def check_fits(cfg: RunConfig, model: TransformerConfig, source: str) -> None:
    """The objective trains this architecture, and the data fits the learned position table.
    Called once a run's model config is known (at load, or after loading finetune.from)."""
    spec = registry.spec(cfg.objective.name)
    if cfg.tasks:
        tasks.check_mixture(cfg, model.arch, source)
    elif model.arch not in spec.archs:
        raise RecipeError(
            f"{source}: objective.name={spec.name} needs model.arch in {list(spec.archs)}, got {model.arch!r}"
        )
    if cfg.data.document_mask and not cfg.tasks and cfg.objective.name not in DOCUMENT_MASK_OBJECTIVES:
        raise RecipeError(
            f"{source}: data.document_mask=true applies to objective.name in "
            f"{list(DOCUMENT_MASK_OBJECTIVES)} (packed LM blocks), not {cfg.objective.name!r}"
        )
    if cfg.data.streaming and not cfg.tasks and spec.data not in LM_OBJECTIVES:  # at load: a refused run writes nothing
        raise RecipeError(
            f"{source}: data.streaming=true is for LM objectives ({', '.join(LM_OBJECTIVES)}), "
            f"not {cfg.objective.name!r}"
        )
    if cfg.data.store != "cache" and not cfg.tasks and spec.data not in LM_OBJECTIVES:
        raise RecipeError(
            f"{source}: data.store={cfg.data.store} is for LM objectives ({', '.join(LM_OBJECTIVES)}), "
            f"not {cfg.objective.name!r}"
        )
    try:  # a shared store's settings: refused here, before a run or a prepare writes anything
        check_store_dir(cfg.data)
    except DataError as error:
        raise RecipeError(f"{source}: {error}") from None
    if cfg.data.batch_tokens is not None and not cfg.tasks and spec.data in LM_OBJECTIVES:
        raise RecipeError(
            f"{source}: data.batch_tokens is for seq2seq and classify (examples of varying length); "
            f"{cfg.objective.name!r} trains on packed blocks of data.block_size tokens: set data.batch_size"
        )
    if cfg.data.block_warmup_steps and (cfg.tasks or cfg.objective.name not in BLOCK_WARMUP_OBJECTIVES):
        raise RecipeError(
            f"{source}: data.block_warmup_steps cuts packed blocks into shorter rows: it applies to "
            f"objective.name in {list(BLOCK_WARMUP_OBJECTIVES)} without tasks, not "
            f"{'a mixture' if cfg.tasks else repr(cfg.objective.name)}"
        )
    if cfg.data.batch_warmup_steps and cfg.tasks:
        raise RecipeError(
            f"{source}: data.batch_warmup_steps cuts one objective's batches; a mixture's steps draw "
            "from several tasks (set data.batch_warmup_steps=0)"
        )
    if cfg.data.document_mask and model.attention_kind == "linear":
        raise RecipeError(
            f"{source}: data.document_mask=true needs model.attention_kind='softmax' "
            "(linear attention's running sums cross document boundaries)"
        )
    moded = [t for t in cfg.tasks if model.arch == "decoder" and t.objective in tasks.MODE_OBJECTIVES]
    efficient = "model.sliding_window is set" if model.sliding_window is not None else None
    efficient = "model.attention_kind='linear'" if model.attention_kind == "linear" else efficient
    if moded and efficient:
        raise RecipeError(
            f"{source}: tasks.{moded[0].name}.objective={moded[0].objective} reads decoder rows with a "
            f"bidirectional part (attention modes), which needs full softmax attention; {efficient}"
        )
    if cfg.optim.optimizer == "muon" and cfg.trainer.strategy == "fsdp":
        # Muon orthogonalises the update of a whole matrix (Newton-Schulz); FSDP2 holds shards
        raise RecipeError(
            f"{source}: optim.optimizer=muon needs whole weight matrices: use trainer.strategy=ddp or auto, not fsdp"
        )
    key, length = longest_input(cfg)
    if model.position == "learned" and length > model.max_seq_len:  # at startup, not at the first batch
        raise RecipeError(
            f"{source}: {key}={length} exceeds model.max_seq_len={model.max_seq_len}, "
            f"the size of the learned position table"
        )
