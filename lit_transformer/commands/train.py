"""Training runs, as plain functions the CLI (and tests, and notebooks) call: `train`
(pretrain and finetune) and `prepare`. The objective comes from the registry; nothing here
branches on an objective's name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lit_transformer import objectives
from lit_transformer.commands.average import last_checkpoints, load_average, record_average, write_average
from lit_transformer.commands.loading import (
    Source,
    consolidated,
    load_backbone,
    resolve_source,
    save_final,
    source_model_config,
    with_overrides,
)
from lit_transformer.commands.run_config import finish_config
from lit_transformer.data.modules.builder import build_data_module
from lit_transformer.errors import RunError
from lit_transformer.evaluation.prompts import complete, encode_prompt, show_prompt
from lit_transformer.model.config import TransformerConfig
from lit_transformer.model.language_model import LanguageModel
from lit_transformer.recipe import registry
from lit_transformer.recipe.load import save_config
from lit_transformer.recipe.model_section import check_fits, longest_input, model_config, model_overrides
from lit_transformer.recipe.schema import RunConfig
from lit_transformer.recipe.tasks import data_plan, task_data
from lit_transformer.training import preflight
from lit_transformer.training.auto_resolve import cpu_threads
from lit_transformer.training.callbacks import SampleGenerations, time_budget_spent
from lit_transformer.training.checkpoints import (
    ResumeCounters,
    accumulate_for,
    check_architecture,
    checkpoint_meta,
    read_checkpoint,
    saved_data_state,
)
from lit_transformer.training.distributed import is_main_process, is_sharded, meta_language_model
from lit_transformer.training.rundir import CONFIG_YAML, TOKENIZER_JSON, open_run_dir
from lit_transformer.training.trainer import build_trainer, finish_wandb


def data_module(cfg: RunConfig, run_dir: Path | None, model_vocab_size: int | None = None):
    """The prepared data module the objective reads: the recipe's data plan (one data kind, or a
    mixture's tasks), built in data/."""
    dm = build_data_module(
        data_plan(cfg),
        run_dir=str(run_dir) if run_dir is not None else None,
        model_vocab_size=model_vocab_size,
        workers=preflight.capped_workers(cfg.trainer, cfg.data.num_workers),
    )
    dm.prepare_data()
    dm.setup("fit")
    return dm


def starting_model(cfg: RunConfig, source: Source | None) -> TransformerConfig | LanguageModel:
    """What the objective trains: the recipe's model config (built once, by load_recipe), or
    finetune.from's weights with the recipe's model fields applied on top."""
    if source is None:
        return model_config(cfg)
    lm = with_overrides(load_backbone(source), model_overrides(cfg)).train()  # loaded in eval mode
    check_fits(cfg, lm.config, f"finetune.from={cfg.finetune.from_}")
    return lm


def build_objective(cfg: RunConfig, model: TransformerConfig | LanguageModel, dm) -> objectives.ObjectiveBase:
    """The objective LightningModule, from its registered class."""
    name = cfg.objective.name
    if isinstance(model, TransformerConfig) and cfg.trainer.strategy == "fsdp" and registry.spec(name).lm_head:
        model = meta_language_model(model)  # each rank allocates only its shards in configure_model
    return registry.objective_class(name).from_recipe(name, cfg, model, dm)


def names_test_files(cfg: RunConfig) -> bool:
    """Whether the recipe names a test split (data.test_files, or a task's)."""
    return any(data.test_files for data in ([task_data(cfg, t) for t in cfg.tasks] if cfg.tasks else [cfg.data]))


def train(cfg: RunConfig, *, callbacks: Sequence[Any] = (), progress_bar: bool = True) -> dict[str, float]:
    """Pretrain or fine-tune as the recipe says; returns the final validation metrics, and the
    test split's (`test/...`) when the recipe names one. The run directory ends up holding
    everything `rundir` lists."""
    cfg = finish_config(cfg)
    with cpu_threads(cfg.trainer.num_threads):
        return _train(cfg, callbacks, progress_bar)


def finetune(cfg: RunConfig, **kwargs: Any) -> dict[str, float]:
    """`train` for a recipe that starts from finetune.from or trains a classifier."""
    if cfg.finetune.from_ is None and registry.spec(cfg.objective.name).lm_head:  # a task head may start fresh
        raise RunError("finetune needs finetune.from (or objective.name=classify); use pretrain to train from scratch")
    return train(cfg, **kwargs)


def _train(cfg: RunConfig, callbacks: Sequence[Any], progress_bar: bool) -> dict[str, float]:
    import lightning as L

    source = resolve_source(cfg.finetune.from_) if cfg.finetune.from_ is not None else None
    # before anything is written or spawned: the devices, the cores and the memory it needs
    checked_model = model_config(cfg) if source is None else source_model_config(source)
    preflight.check(cfg.trainer, cfg.data, checked_model, longest_input(cfg)[1])
    run_dir, ckpt = open_run_dir(cfg)
    if ckpt is not None:
        cfg = keep_global_batch(cfg, ckpt)  # before the data module, which takes the accumulation
    if ckpt is None:
        save_config(cfg, run_dir / CONFIG_YAML)  # first, so that a run that fails later can be started again
    L.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    model = starting_model(cfg, source)
    vocab = model.vocab_size if isinstance(model, TransformerConfig) else model.config.vocab_size
    dm = data_module(cfg, run_dir, vocab)
    module = build_objective(cfg, model, dm)
    if ckpt is not None:
        if ckpt.is_file():  # a one-line error naming the fields, not a load_state_dict traceback
            check_architecture(read_checkpoint(ckpt, mmap=True), module.model_config.to_dict(), ckpt)
        save_config(cfg, run_dir / CONFIG_YAML)  # after the checks: a refused resume changes nothing
    extra = list(callbacks)
    if ckpt is not None:
        extra.append(ResumeCounters())  # Lightning's batch counters, when the data position moved to another layout
    evaluations = named_evaluations(cfg, run_dir, dm)  # before training: a bad entry fails here
    if evaluations is not None:
        extra.append(evaluations)
    try:
        with worker_errors():
            if registry.spec(cfg.objective.name).generative(module.model_config.arch) and cfg.generation.enabled:
                extra.append(SampleGenerations(sample_fn(cfg, dm), run_dir))
            trainer = build_trainer(cfg, run_dir, resume=ckpt is not None, callbacks=extra, progress_bar=progress_bar)
            trainer.fit(module, datamodule=dm, ckpt_path=str(ckpt) if ckpt is not None else None)
        # a run whose trainer.max_time ran out is finished, like one that reached max_steps
        spent = time_budget_spent(trainer)
        interrupted = trainer.interrupted or (trainer.global_step < cfg.trainer.max_steps and not spent)
        average = cfg.trainer.average_last or 1
        # FSDP2 shards cannot take a whole state dict: a sharded run's average is written after
        # save_final (its metrics are then those of the last weights)
        averaged = (
            load_average(module, run_dir, average) if not interrupted and average > 1 and not is_sharded(module) else []
        )
        # Lightning validates at the step where should_stop was set (a spent time budget) too
        at_end = spent or cfg.trainer.max_steps % cfg.trainer.val_check_interval == 0
        validated_last = (
            not averaged and at_end and any(k.startswith("val/") for k in trainer.callback_metrics)
        )  # not so after resuming a finished run
        if not interrupted and not validated_last:
            with worker_errors():
                trainer.validate(module, datamodule=dm, verbose=False)  # the final model's metrics
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        if not interrupted and evaluations is not None:
            if averaged:  # the averaged weights are new: every evaluation runs on them
                evaluations.done_at.clear()
            metrics.update(evaluations.finish(trainer, module))
        if not interrupted and names_test_files(cfg):
            module.measure_bytes_on(dm, "test")
            with worker_errors():
                trainer.test(module, datamodule=dm, verbose=False)  # the final model's, once
            metrics.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/")})
        if not interrupted:
            final = consolidated(module, trainer.global_rank)  # FSDP: every rank gathers, rank 0 saves
            if trainer.is_global_zero:
                save_final(final, run_dir, metrics)
                if average > 1 and is_sharded(module):
                    averaged = last_checkpoints(run_dir, average)
                    write_average(averaged, run_dir, run_dir)
                elif averaged:
                    record_average(averaged, run_dir)
    finally:
        finish_wandb(run_dir)
    return metrics


def keep_global_batch(cfg: RunConfig, ckpt: Path) -> RunConfig:
    """`cfg` with the trainer.accumulate_grad_batches that keeps the global batch `ckpt` was
    trained with on this run's ranks (checkpoints.accumulate_for: changed only where the recipe
    left it as saved; one line says so, and config.yaml records it), else a RunError."""
    state = saved_data_state(checkpoint_meta(ckpt))
    if state is None:
        return cfg
    t = cfg.trainer
    datas = [task_data(cfg, task) for task in cfg.tasks] if cfg.tasks else [cfg.data]
    # a mixture's samplers take data.batch_size examples; one data kind's, a batch under batch_tokens
    units = [d.batch_size if cfg.tasks or d.batch_tokens is None else 1 for d in datas]
    world = preflight.processes_per_node(t) * t.num_nodes
    accumulate = accumulate_for(state, world_size=world, units=units, accumulate=t.accumulate_grad_batches, path=ckpt)
    if accumulate == t.accumulate_grad_batches:
        return cfg
    if is_main_process():
        print(
            f"resume: trainer.accumulate_grad_batches={accumulate} (was {t.accumulate_grad_batches}) keeps the "
            f"global batch of {ckpt} on {world} rank(s)",
            file=sys.stderr,
        )
    return dataclasses.replace(cfg, trainer=dataclasses.replace(t, accumulate_grad_batches=accumulate))


def named_evaluations(cfg: RunConfig, run_dir: Path, dm: Any):
    """The recipe's eval section as a callback, its data read and checked now; None without one."""
    if not cfg.eval:
        return None
    from lit_transformer.evaluation.callback import NamedEvaluations
    from lit_transformer.evaluation.suite import build_suite

    # the evaluations tokenize with the run's tokenizer, which the data module has just written
    eval_cfg = dataclasses.replace(
        cfg, tokenizer=dataclasses.replace(cfg.tokenizer, path=str(run_dir / TOKENIZER_JSON))
    )
    return NamedEvaluations(build_suite(cfg.eval, eval_cfg), eval_cfg, dm.tokenizer, dm.special_tokens)


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


def sample_fn(cfg: RunConfig, dm):
    """The SampleGenerations callback's sampler: fixed prompts (the recipe's, else the starts
    of the first validation examples as the collator builds them), decoded with a seeded
    generator so sampling never touches the global one."""
    g = cfg.generation
    style = registry.spec(cfg.objective.name).prompt_for(cfg.model.arch)
    tokenizer, special = dm.tokenizer, dm.special_tokens
    if g.prompts:
        prompts = [encode_prompt(p, tokenizer, special, style) for p in g.prompts]
    else:
        # no truth test on the loader: a streaming split's DataLoader has no len()
        batch = next(iter(dm.generation_dataloader()), None)
        prompts = []
        if batch is not None:
            for ids, mask in zip(batch["input_ids"][: g.num_prompts], batch["attention_mask"][: g.num_prompts]):
                row = ids[mask.bool()].tolist()
                prompts.append(row[: g.prompt_tokens] if style == "continue" else row)
    shown = [show_prompt(tokenizer, style, p) for p in prompts]
    options = dict(do_sample=g.do_sample, temperature=g.temperature, top_k=g.top_k, top_p=g.top_p)

    def sample(module) -> list[tuple[str, str]]:
        if not prompts:
            return []
        device = next(module.parameters()).device
        generator = torch.Generator(device=device).manual_seed(cfg.trainer.seed)
        texts = complete(
            module.model,
            tokenizer,
            special,
            style,
            prompts,
            max_new_tokens=g.max_new_tokens,
            generator=generator,
            **options,
        )
        return list(zip(shown, texts))

    return sample


def prepare(cfg: RunConfig, *, part: str | None = None, merge: int | None = None) -> dict[str, Any]:
    """Train or load the tokenizer and fill the token cache (every task's, for a mixture), or
    write a shared store (data.store_dir: part "I/N" of it, or `merge` its N parts); writes
    tokenizer.json and config.yaml."""
    from lit_transformer.data.tokens.prepare import format_summary
    from lit_transformer.data.tokens.prepare import prepare as prepare_data

    shared = cfg.data.store == "litdata" and cfg.data.store_dir is not None
    if (part is not None or merge is not None) and (cfg.tasks or not shared):
        raise RunError("prepare --part and --merge write a shared store: set data.store=litdata and data.store_dir")
    cfg = finish_config(cfg)
    run_dir = Path(cfg.run.dir)
    vocab = model_config(cfg).vocab_size if cfg.finetune.from_ is None else None
    if shared and not cfg.tasks:
        from lit_transformer.data.tokens.prepare import require_litdata

        require_litdata()  # one line naming the extra, before remote_store imports litdata
        from lit_transformer.data.tokens.remote_store import prepare_store

        data_kind = registry.spec(cfg.objective.name).data
        summary = prepare_store(
            cfg.data, cfg.tokenizer, data_kind, run_dir, part=part, merge=merge, model_vocab_size=vocab
        )
    elif cfg.tasks:
        dm = data_module(cfg, run_dir, vocab)
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
