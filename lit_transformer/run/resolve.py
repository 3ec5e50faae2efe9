"""A run's config, finished in one place and in order, before anything is written or started:

  1. the recipe: `load_recipe` reads, merges and checks it; a from-scratch recipe without `auto`
     values comes back finished, its model section holding every field of the model
  2. its `auto` values, measured and chosen when the run starts (training/auto_resolve.py, rules
     in recipe/auto_rules.py); the model section is then completed as in step 1
  3. the fine-tuning start: finetune.from's tokenizer (where tokenizer.path is unset) and how a
     decoder reads text (bidirectionally when the source is a mixture that trained that mode);
     the model itself comes with the source's weights (loading.load_backbone)

`pretrain`, `finetune`, `prepare` and `--print-config` (steps 1 and 2) all call `finish_config`. The imports are
inside the steps: `--print-config` of a recipe without `auto` values loads no torch.
"""

from __future__ import annotations

import dataclasses

from lit_transformer.errors import RunError
from lit_transformer.recipe.auto_rules import auto_keys
from lit_transformer.recipe.schema import RunConfig
from lit_transformer.recipe.tasks import trains_bidirectional_mode


def finish_config(cfg: RunConfig, *, read_source: bool = True) -> RunConfig:
    """`cfg` (from load_recipe) with what it leaves to the start of the run filled in.
    read_source=False (`--print-config`) leaves step 3 to the run: its source may not exist yet."""
    if cfg.finetune.from_ is None:
        if not auto_keys(cfg):
            return cfg
        from lit_transformer.training.auto_resolve import resolve_auto  # measures: torch

        return resolve_auto(cfg)
    if not read_source:
        return cfg
    from lit_transformer.commands.loading import resolve_source

    source = resolve_source(cfg.finetune.from_)
    if cfg.tokenizer.path is None:
        if source.tokenizer is None:
            raise RunError(f"finetune.from={cfg.finetune.from_} has no tokenizer.json; set tokenizer.path")
        cfg = dataclasses.replace(cfg, tokenizer=dataclasses.replace(cfg.tokenizer, path=str(source.tokenizer)))
    if cfg.finetune.attention is None:
        pretrained = source.run_config
        mode = "bidirectional" if pretrained is not None and trains_bidirectional_mode(pretrained) else "causal"
        cfg = dataclasses.replace(cfg, finetune=dataclasses.replace(cfg.finetune, attention=mode))
    return cfg
