"""What a run evaluates while it trains: the sample generations after every validation
(`SampleGenerations`), and the recipe's `eval` section: every named evaluation on the initial weights,
at each validation that is due (`every_n_steps`) and once more on the final weights, logged as `eval/<name>/<metric>`
to every logger (W&B, CSV) and returned for metrics.json.

Under DDP and FSDP every rank runs every evaluation on the same data, inside
`gathered_parameters` (FSDP2's shards gathered, so the forward passes need no collectives and
ranks may decode different numbers of steps without deadlocking), and then takes rank 0's
numbers. Running everywhere rather than on rank 0 alone keeps the objectives' metrics, which
synchronise across ranks when they compute, from waiting on ranks that do not; the wall-clock
cost is the same, since rank 0 would otherwise run the same work while the others wait.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger

from lit_transformer.evaluation.eval_target import EvalTarget, Evaluation
from lit_transformer.evaluation.prompts import complete, encode_prompt, show_prompt
from lit_transformer.evaluation.suite import run_suite
from lit_transformer.recipe import registry
from lit_transformer.recipe.schema import RunConfig
from lit_transformer.recipe.tasks import trains_bidirectional_mode
from lit_transformer.training.distributed import eager_outside_the_step, gathered_parameters, is_sharded
from lit_transformer.training.rundir import SAMPLES_FILE


def eval_target(module: Any, cfg: RunConfig, tokenizer: Any, special: Any) -> EvalTarget:
    """The target for an objective module of a run with config cfg (in training and in `evaluate`)."""
    # a classifier holds a backbone, not a language model: its final model wraps a copy of it
    model = module.model if hasattr(module, "model") else module.final_model()
    decoder = model.config.arch == "decoder"
    return EvalTarget(
        model=model,
        tokenizer=tokenizer,
        special=special,
        cfg=cfg,
        module=module,
        bidirectional=decoder and trains_bidirectional_mode(cfg),
        prefix_lm=decoder and any(t.objective == "prefix_lm" for t in cfg.tasks),
        autocast_dtype=torch.bfloat16 if cfg.trainer.precision == "bf16-mixed" else None,
    )


class NamedEvaluations(Callback):
    """Runs `evaluations` after each validation in fit, and `finish` runs what the last one left
    out. commands/train.py builds the evaluations before training starts, so a bad entry or a missing
    file fails before the first step."""

    def __init__(self, evaluations: Sequence[Evaluation], cfg: RunConfig, tokenizer: Any, special: Any):
        self.evaluations = list(evaluations)
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.special = special
        self.done_at: dict[str, int] = {}  # entry name -> the step it last ran at
        self.latest: dict[str, float] = {}  # every metric's newest value

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """At step 0 of a new run (not a resumed one): the initial weights' numbers, the baseline
        that shows what pretraining bought (a probe on random features is well above chance)."""
        if trainer.global_step == 0:
            self._run(trainer, pl_module, final=False)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self._run(trainer, pl_module, final=False)

    def finish(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        """Every evaluation on the final weights that has not already run at this step; returns
        the final value of every evaluation (for metrics.json)."""
        self._run(trainer, pl_module, final=True)
        return dict(self.latest)

    def _run(self, trainer: L.Trainer, pl_module: L.LightningModule, *, final: bool) -> None:
        step = trainer.global_step
        pending = [e for e in self.evaluations if self.done_at.get(e.entry.name) != step]
        if not pending:
            return
        target = eval_target(pl_module, self.cfg, self.tokenizer, self.special)
        with gathered_parameters(pl_module), eager_outside_the_step(pl_module):
            metrics = run_suite(pending, target, step=step, final=final)
        metrics = trainer.strategy.broadcast(metrics, src=0)  # every rank holds rank 0's numbers
        ran = {key.split("/")[1] for key in metrics}
        for evaluation in pending:
            if evaluation.entry.name in ran:
                self.done_at[evaluation.entry.name] = step
        if not metrics:
            return
        self.latest = {**self.latest, **metrics}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


# ----------------------------------------------------------------------------- sample generations


class SampleGenerations(Callback):
    """After every validation of a generative objective (clm, span, seq2seq), generate from a few
    fixed prompts and log them as a W&B table `samples` (and a JSON line in samples.jsonl).

    `sample` returns (prompt, completion) pairs (validation_sampler builds the run's). It must not
    draw from the global random generator (use greedy decoding or its own torch.Generator)."""

    def __init__(self, sample: Callable[[L.LightningModule], list[tuple[str, str]]], run_dir: Path):
        self.sample = sample
        self.run_dir = run_dir

    @classmethod
    def for_run(cls, cfg: RunConfig, dm: Any, run_dir: Path) -> SampleGenerations:
        return cls(validation_sampler(cfg, dm), run_dir)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        if not trainer.is_global_zero and not is_sharded(pl_module):
            return
        # FSDP2: every rank gathers, rank 0 generates; eagerly: each decoding step has another key length
        with gathered_parameters(pl_module), eager_outside_the_step(pl_module):
            pairs = self.sample(pl_module) if trainer.is_global_zero else []
        if not trainer.is_global_zero:
            return
        step = trainer.global_step
        with (self.run_dir / SAMPLES_FILE).open("a") as file:
            file.write(json.dumps({"step": step, "samples": [{"prompt": p, "completion": c} for p, c in pairs]}) + "\n")
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_table(
                    key="samples",
                    columns=["step", "prompt", "completion"],
                    data=[[step, p, c] for p, c in pairs],
                    step=step,
                )


def validation_sampler(cfg: RunConfig, dm) -> Callable[[Any], list[tuple[str, str]]]:
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
