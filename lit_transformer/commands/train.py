"""Training runs, as plain functions the CLI (and tests, and notebooks) call: `train`
(pretrain and finetune) and `prepare`. A run reads top to bottom: resolve the recipe
(run/resolve.py) and refuse what cannot run, before anything is written; then build, fit and
finish (training/finish.py). The objective comes from the registry; nothing here branches on an
objective's name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lit_transformer import objectives
from lit_transformer.data.data_plan import DataPlan
from lit_transformer.data.modules.builder import build_data_module
from lit_transformer.errors import RunError
from lit_transformer.machine import cpu_threads
from lit_transformer.model.config import TransformerConfig
from lit_transformer.model.language_model import LanguageModel
from lit_transformer.recipe import registry
from lit_transformer.recipe.load import save_config
from lit_transformer.recipe.schema import RunConfig, TrainerConfig
from lit_transformer.run.loading import load_backbone, with_overrides
from lit_transformer.run.resolve import ResolvedRun, resolve_run
from lit_transformer.training import preflight
from lit_transformer.training.checkpoints import ResumeCounters, check_architecture, read_checkpoint
from lit_transformer.training.distributed import meta_language_model
from lit_transformer.training.finish import finish
from lit_transformer.training.rundir import CONFIG_YAML, open_run_dir
from lit_transformer.training.trainer import build_trainer, finish_wandb


def train(cfg: RunConfig, *, callbacks: Sequence[Any] = (), progress_bar: bool = True) -> dict[str, float]:
    """Pretrain or fine-tune as the recipe says; returns the final validation metrics, and the
    test split's (`test/...`) when the recipe names one. The run directory ends up holding
    everything `rundir` lists."""
    run = resolve_run(cfg)
    # before anything is written or spawned: devices, precision, compiler, cores and memory
    preflight.check(run.config.trainer, run.config.data, run.model, run.longest_input[1])
    with cpu_threads(run.config.trainer.num_threads):
        built = build(run, callbacks, progress_bar)
        try:
            with worker_errors():
                built.trainer.fit(built.module, datamodule=built.dm, ckpt_path=built.ckpt_path)
            return finish(
                run.config, built.trainer, built.module, built.dm, run.run_dir, built.evaluations, worker_errors
            )
        finally:
            finish_wandb(run.run_dir)


def finetune(cfg: RunConfig, **kwargs: Any) -> dict[str, float]:
    """`train` for a recipe that starts from finetune.from or trains a classifier."""
    if cfg.finetune.from_ is None and registry.spec(cfg.objective.name).lm_head:  # a task head may start fresh
        raise RunError("finetune needs finetune.from (or objective.name=classify); use pretrain to train from scratch")
    return train(cfg, **kwargs)


@dataclass(frozen=True)
class BuiltRun:
    """What `build` made: the objective, its data, the trainer, and the evaluations it runs."""

    module: objectives.ObjectiveBase
    dm: Any
    trainer: Any
    evaluations: Any | None
    ckpt_path: str | None


def build(run: ResolvedRun, callbacks: Sequence[Any], progress_bar: bool) -> BuiltRun:
    """The run directory (config.yaml first, so that a run that fails later can be started
    again), the data module (the tokenizer trained and the token cache filled), the objective,
    the named evaluations (their data read and checked now) and the trainer."""
    import lightning as L

    cfg, ckpt = run.config, run.resume_from
    run_dir = open_run_dir(cfg, ckpt)
    if ckpt is None:
        save_config(cfg, run_dir / CONFIG_YAML)
    L.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    model = starting_model(run.model, run.source)
    dm = data_module(run.data, run_dir, cfg.trainer, cfg.data.num_workers, model_vocab_size(model))
    module = build_objective(cfg, model, dm)
    extra = list(callbacks)
    if ckpt is not None:
        if ckpt.is_file():  # a one-line error naming the fields, not a load_state_dict traceback
            check_architecture(read_checkpoint(ckpt, mmap=True), module.model_config.to_dict(), ckpt)
        save_config(cfg, run_dir / CONFIG_YAML)  # after the checks: a refused resume changes nothing
        extra.append(ResumeCounters())  # Lightning's batch counters, when the data position moved to another layout
    evaluations = named_evaluations(run, dm)
    if evaluations is not None:
        extra.append(evaluations)
    if registry.spec(cfg.objective.name).generative(module.model_config.arch) and cfg.generation.enabled:
        from lit_transformer.evaluation.callback import SampleGenerations

        with worker_errors():  # the sampler reads its prompts from the validation data
            extra.append(SampleGenerations.for_run(cfg, dm, run_dir))
    trainer = build_trainer(cfg, run_dir, resume=ckpt is not None, callbacks=extra, progress_bar=progress_bar)
    return BuiltRun(module, dm, trainer, evaluations, str(ckpt) if ckpt is not None else None)


def starting_model(model: TransformerConfig, source: Any | None) -> TransformerConfig | LanguageModel:
    """What the objective trains: the resolved model config, or finetune.from's weights under it
    (the recipe's model fields applied on top)."""
    if source is None:
        return model
    lm = load_backbone(source)
    saved, wanted = lm.config.to_dict(), model.to_dict()
    changes = {key: value for key, value in wanted.items() if saved.get(key) != value}
    return with_overrides(lm, changes).train()  # loaded in eval mode


def model_vocab_size(model: TransformerConfig | LanguageModel) -> int:
    return model.vocab_size if isinstance(model, TransformerConfig) else model.config.vocab_size


def data_module(plan: DataPlan, run_dir: Path, trainer: TrainerConfig, workers: int, vocab_size: int | None):
    """The prepared data module the objective reads: the run's data plan (one data kind, or a
    mixture's tasks), built in data/, with at most as many loader workers as a rank has cores."""
    dm = build_data_module(
        plan,
        run_dir=str(run_dir),
        model_vocab_size=vocab_size,
        workers=preflight.capped_workers(trainer, workers),
    )
    dm.prepare_data()
    dm.setup("fit")
    return dm


def build_objective(cfg: RunConfig, model: TransformerConfig | LanguageModel, dm) -> objectives.ObjectiveBase:
    """The objective LightningModule, from its registered class."""
    name = cfg.objective.name
    if isinstance(model, TransformerConfig) and cfg.trainer.strategy == "fsdp" and registry.spec(name).lm_head:
        model = meta_language_model(model)  # each rank allocates only its shards in configure_model
    return registry.objective_class(name).from_recipe(name, cfg, model, dm)


def named_evaluations(run: ResolvedRun, dm: Any):
    """The recipe's eval section as a callback, its data read and checked now; None without one."""
    if not run.config.eval:
        return None
    from lit_transformer.evaluation.callback import NamedEvaluations
    from lit_transformer.evaluation.suite import build_suite

    eval_cfg = run.evaluation_config  # the run's tokenizer, which the data module has just written
    return NamedEvaluations(build_suite(eval_cfg.eval, eval_cfg), eval_cfg, dm.tokenizer, dm.special_tokens)


@contextlib.contextmanager
def worker_errors():
    """A data-loader worker that dies (killed, out of memory, os._exit) makes torch raise
    "DataLoader worker (pid X) exited unexpectedly / is killed by signal"; as a one-line RunError."""
    # torch imports a module at the first record_function (Lightning wraps every step in one);
    # a worker's death signal raised inside that import is logged by torch with a traceback
    # before it reaches us, so the first record_function runs here, before any worker starts
    with torch.autograd.profiler.record_function("lit-transformer"):
        pass
    try:
        yield
    except RuntimeError as error:
        # Lightning's teardown may fail in turn ("call iter(combined_loader) first") while
        # handling the worker's error: look along the chain of exceptions
        cause: BaseException | None = error
        while cause is not None and "DataLoader worker" not in str(cause):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        first = str(cause).strip().splitlines()[0]
        raise RunError(
            f"a data-loader worker died ({first}); data.num_workers=0 loads in the main process, "
            "where the cause shows; resume=auto continues from the newest checkpoint"
        ) from None


def prepare(cfg: RunConfig, *, part: str | None = None, merge: int | None = None) -> dict[str, Any]:
    """Train or load the tokenizer and fill the token cache (every task's, for a mixture), or
    write a shared store (data.store_dir: part "I/N" of it, or `merge` its N parts); writes
    tokenizer.json and config.yaml."""
    from lit_transformer.data.tokens.prepare import format_summary
    from lit_transformer.data.tokens.prepare import prepare as prepare_data

    shared = cfg.data.store == "litdata" and cfg.data.store_dir is not None
    if (part is not None or merge is not None) and (cfg.tasks or not shared):
        raise RunError("prepare --part and --merge write a shared store: set data.store=litdata and data.store_dir")
    run = resolve_run(cfg, training=False)
    cfg, run_dir = run.config, run.run_dir
    vocab = run.model.vocab_size if cfg.finetune.from_ is None else None
    if shared and not cfg.tasks:
        from lit_transformer.data.tokens.prepare import require_litdata

        require_litdata()  # one line naming the extra, before remote_store imports litdata
        from lit_transformer.data.tokens.remote_store import prepare_store

        data_kind = registry.spec(cfg.objective.name).data
        summary = prepare_store(
            cfg.data, cfg.tokenizer, data_kind, run_dir, part=part, merge=merge, model_vocab_size=vocab
        )
    elif cfg.tasks:
        dm = data_module(run.data, run_dir, cfg.trainer, cfg.data.num_workers, vocab)
        summary = {"tokenizer": str(run_dir / "tokenizer.json"), "tasks": dm.summaries()}
        print(f"tokenizer  {dm.vocab_size:,} tokens -> {run_dir / 'tokenizer.json'}")
        for task, splits in summary["tasks"].items():
            for split in splits.values():
                print(f"{task:<12} " + format_summary(split))
    else:
        summary = prepare_data(
            cfg.data,
            cfg.tokenizer,
            registry.spec(cfg.objective.name).data,
            run_dir,
            seed=cfg.trainer.seed,
            model_vocab_size=vocab,
        )
    if not (run_dir / CONFIG_YAML).exists():
        save_config(cfg, run_dir / CONFIG_YAML)
    return summary
