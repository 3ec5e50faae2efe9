"""One resolved run: a recipe (as `load_recipe` returns it, overrides applied) turned into
everything a command needs before anything is trained or written, in one place and in order:

  1. the fine-tuning start: finetune.from resolved; its tokenizer (where tokenizer.path is
     unset) and how a decoder reads text (bidirectionally when the source is a mixture that
     trained that mode)
  2. trainer.precision where the recipe leaves it null: the objective's default, for this machine
  3. `auto` values, in one pass (training/auto_resolve.py measures and applies the rules of
     recipe/auto_rules.py); a resumed run takes those its config.yaml recorded
  4. the model config, built once and checked against the objective and the data (a
     fine-tuning run's: finetune.from's with the recipe's model keys on top)
  5. the checkpoint a resumed run continues (found before step 3), and the accumulation that
     keeps its global batch
  6. the data plan the data module is built from
  7. for a training run, the eval section's files: each exists and reads (the entries' other
     keys were checked with the recipe)

The result is frozen; nothing changes the run config after it. `pretrain`, `finetune`,
`prepare`, `info`, `evaluate` and `--print-config` all start here. Imports that need torch are
inside the steps that need them: `--print-config` and `info` of a plain recipe load no torch.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lit_transformer import machine
from lit_transformer.data.data_plan import DataPlan
from lit_transformer.errors import RunError
from lit_transformer.model.config import TransformerConfig
from lit_transformer.recipe import registry
from lit_transformer.recipe.model_section import (
    check_fits,
    complete_model,
    longest_input,
    model_config,
    model_overrides,
)
from lit_transformer.recipe.schema import RunConfig
from lit_transformer.recipe.tasks import data_plan, task_datas, trains_bidirectional_mode


@dataclass(frozen=True)
class ResolvedRun:
    """What a run trains, on what, from where: every value plain."""

    config: RunConfig  # the recipe, complete: what config.yaml records
    model: TransformerConfig | None  # the model trained (None: a fine-tuning start not read, --print-config)
    source: Any | None  # finetune.from resolved (run/loading.py's Source)
    resume_from: Path | None  # the checkpoint a resumed run continues
    data: DataPlan
    longest_input: tuple[str, int]  # (key, tokens): the longest sequence a batch holds

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run.dir)

    @property
    def evaluation_config(self) -> RunConfig:
        """The config the named evaluations read: the run's own tokenizer, which the data module
        writes into the run directory (asked in training only: rundir imports torch)."""
        from lit_transformer.training.rundir import TOKENIZER_JSON

        return _replace(self.config, tokenizer={"path": str(self.run_dir / TOKENIZER_JSON)})


def resolve_run(
    cfg: RunConfig,
    *,
    measure: Callable[..., float] | None = None,
    read_source: bool = True,
    training: bool = True,
    quiet: bool = False,
) -> ResolvedRun:
    """`cfg` resolved for this machine. read_source=False (`--print-config`) leaves the
    fine-tuning start unread: its source may not exist yet. training=False (`prepare`, `info`)
    looks for no checkpoint to resume. `measure` gives one process's training FLOP/s for a model
    (training/auto_resolve.py's probe by default; tests pass a fixed speed)."""
    cfg = copy.deepcopy(cfg)  # the caller's config stays as it was read
    source = None
    if cfg.finetune.from_ is not None and read_source:
        from lit_transformer.run.loading import resolve_source

        source = resolve_source(cfg.finetune.from_)
        cfg = _start_from(cfg, source)
    if cfg.trainer.precision is None:
        cfg.trainer.precision = default_precision(registry.spec(cfg.objective.name).precision, cfg.trainer.accelerator)
    resume_from = None
    if training and cfg.resume is not None:
        from lit_transformer.training.rundir import resume_checkpoint

        resume_from = resume_checkpoint(cfg)
    if cfg.finetune.from_ is None:  # a fine-tuning recipe brings its model: `auto` is refused at load
        from lit_transformer.training.auto_resolve import auto_values  # torch only for `auto` values

        values = auto_values(cfg, measure=measure, quiet=quiet)
        if values:
            cfg = dataclasses.replace(cfg, **_with_auto_values(values, cfg.model, cfg.tokenizer, cfg.data))
            complete_model(cfg, "recipe")
    model = None
    if cfg.finetune.from_ is None:
        model = model_config(cfg)
    elif source is not None:
        from lit_transformer.run.loading import source_model_config

        model = source_model_config(source).replace(**model_overrides(cfg))
        check_fits(cfg, model, f"finetune.from={cfg.finetune.from_}")
    if resume_from is not None:
        accumulate = _accumulation_for(resume_from, cfg.trainer, task_datas(cfg), bool(cfg.tasks))
        cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, accumulate_grad_batches=accumulate))
    if training:
        _check_eval_files(cfg.eval)
    return ResolvedRun(
        config=cfg,
        model=model,
        source=source,
        resume_from=resume_from,
        data=data_plan(cfg),
        longest_input=longest_input(cfg),
    )


def default_precision(objective_default: str, accelerator: str) -> str:
    """trainer.precision when a recipe leaves it null: the objective's default (registry.py),
    except that a bf16 default becomes 32-true on a CPU-only run whose CPU has no bf16 matrix
    instructions (AMX, AVX512-BF16). There bf16 is emulated, and a step runs many times slower
    than in float32 (docs/defaults.md, "float32 on CPUs without bf16 matrix instructions")."""
    if not objective_default.startswith("bf16") or accelerator in ("gpu", "cuda", "mps"):
        return objective_default
    if accelerator == "auto" and machine.has_nvidia_gpu():
        return objective_default
    return objective_default if machine.cpu_has_bf16_matmul() else "32-true"


def evaluation_run(source: Any, target: str) -> RunConfig:
    """The config `evaluate` rebuilds a source's objective with: its run's config and tokenizer,
    or, for a model directory outside a run (an exported transformers model), the defaults for
    its architecture's objective. objective.bleu is off: evaluate decodes in translate entries,
    not in every heldout batch."""
    from lit_transformer.run.loading import load_language_model, source_objective

    if source.tokenizer is None:
        raise RunError(f"{target}: evaluate needs the model's tokenizer.json beside it (in the run or model directory)")
    cfg = source.run_config
    if cfg is None:
        arch = load_language_model(source).config.arch
        cfg = RunConfig()
        cfg.objective.name = source_objective(source) if source.kind == "model" else registry.DEFAULT_FOR_ARCH[arch]
        cfg.model.arch = arch
    return _replace(cfg, tokenizer={"path": str(source.tokenizer)}, objective={"bleu": False})


# ----------------------------------------------------------------------------- the steps


def _replace(cfg: RunConfig, **sections: dict[str, Any]) -> RunConfig:
    """`cfg` with some fields of some sections changed (the only place a run config changes)."""
    changed = {name: dataclasses.replace(getattr(cfg, name), **fields) for name, fields in sections.items()}
    return dataclasses.replace(cfg, **changed)


def _start_from(cfg: RunConfig, source: Any) -> RunConfig:
    """Step 1: what finetune.from brings when the recipe leaves it unset."""
    if cfg.tokenizer.path is None:
        if source.tokenizer is None:
            raise RunError(f"finetune.from={cfg.finetune.from_} has no tokenizer.json; set tokenizer.path")
        cfg = _replace(cfg, tokenizer={"path": str(source.tokenizer)})
    if cfg.finetune.attention is None:
        pretrained = source.run_config
        mode = "bidirectional" if pretrained is not None and trains_bidirectional_mode(pretrained) else "causal"
        cfg = _replace(cfg, finetune={"attention": mode})
    return cfg


def _with_auto_values(values: dict[str, Any], model: Any, tokenizer: Any, data: Any) -> dict[str, Any]:
    """Step 3: the sections (model, tokenizer, data) with `values` (training/auto_resolve.py) in
    place of `auto`; model.size back to null, its shape set."""
    sections = {"model": model, "tokenizer": tokenizer, "data": data}
    fields: dict[str, dict[str, Any]] = {"model": {}, "tokenizer": {}, "data": {}}
    for key, value in values.items():
        if key == "model.size":
            fields["model"].update(size=None, **value)
        else:
            section, name = key.split(".")
            fields[section][name] = value
    return {name: dataclasses.replace(sections[name], **changed) for name, changed in fields.items()}


def _check_eval_files(entries: list) -> None:
    """Step 7: a missing or unreadable evaluation file is refused now, not after the tokenizer
    is trained and the token cache filled (build_suite reads the files then)."""
    from lit_transformer.data.sources.files import resolve_files

    for entry in entries:
        for key in ("files", "train_files", "target_files"):
            if getattr(entry, key):
                resolve_files(getattr(entry, key), f"eval {entry.name}: {key}")


def _accumulation_for(ckpt: Path, trainer: Any, datas: list, mixture: bool) -> int:
    """Step 5: the trainer.accumulate_grad_batches that keeps the global batch `ckpt` was trained
    with on this run's ranks (checkpoints.accumulate_for: changed only where the recipe left it
    as saved; one line says so, and config.yaml records it), else a RunError."""
    from lit_transformer.training.checkpoints import accumulate_for, checkpoint_meta, saved_data_state
    from lit_transformer.training.distributed import is_main_process
    from lit_transformer.training.preflight import processes_per_node

    state = saved_data_state(checkpoint_meta(ckpt))
    asked = trainer.accumulate_grad_batches
    if state is None:
        return asked
    # a mixture's samplers take data.batch_size examples; one data kind's, a batch under batch_tokens
    units = [d.batch_size if mixture or d.batch_tokens is None else 1 for d in datas]
    world = processes_per_node(trainer) * trainer.num_nodes
    accumulate = accumulate_for(state, world_size=world, units=units, accumulate=asked, path=ckpt)
    if accumulate != asked and is_main_process():
        print(
            f"resume: trainer.accumulate_grad_batches={accumulate} (was {asked}) keeps the "
            f"global batch of {ckpt} on {world} rank(s)",
            file=sys.stderr,
        )
    return accumulate
