"""ObjectiveBase: what every training objective shares. The subclasses own their modules,
losses and metrics; this class owns the optimizer and schedule, the per-step training
metrics (loss, perplexity, learning rate, gradient norm), the non-finite loss guard, the
evaluation plumbing (validation, test and `evaluate_batches`) and the FSDP2 hook. Throughput
and MFU (train/tokens_per_s, train/mfu) are measured by training.throughput.Throughput, which
`configure_callbacks` attaches to every Trainer: each training step hands it a StepWork, and
`flops_config` says which configuration's FLOPs a step spends. LanguageModelObjective, below, is
the one constructor of CausalLM and MaskedLM.

Training metrics, logged with `self.log` on the steps whose values reach the logger (every
trainer.log_every_n_steps optimizer steps; train/loss at every step, for the progress bar):
  train/loss, train/ppl   the minimised loss (label-smoothed if asked) and exp(plain NLL)
  train/lr                the first parameter group's learning rate for this step
  train/grad_norm         total 2-norm of all gradients, BEFORE clipping: Lightning calls
                          on_before_optimizer_step and then clips (Precision._after_closure in
                          lightning 2.6), and with a GradScaler the gradients are already unscaled
  train/skipped_steps     how many optimizer steps the non-finite guard has skipped so far

Validation and test (`val/...`, `test/...`) and `evaluate_batches` share one path per objective
(`eval_update` per batch, `eval_compute` at the end): losses are the plain NLL (no label
smoothing) summed over tokens and divided by the token count over all batches and ranks;
bpb (bits per byte of the text) only where the loss predicts the text in order
(`reports_bits_per_byte`), with the evaluated split's bytes per token.

The non-finite guard costs one host-device sync per step (`skip_nonfinite=False` removes it).

Every checkpoint records the objective's registered name and its model config under fixed
keys (training.checkpoints.OBJECTIVE_KEY, MODEL_CONFIG_KEY), so loading never guesses. How a recipe
builds an objective, how a checkpoint rebuilds it and what the final model directory holds
are classmethods here that a subclass overrides where it differs (`from_recipe`,
`from_hparams`, `final_model`, `final_head`, `from_final`).

Shape legend: B batch, T length.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypedDict, Unpack

import lightning as L
import torch
from torch import nn

from lit_transformer.model.config import TransformerConfig
from lit_transformer.model.language_model import LanguageModel
from lit_transformer.objectives.metrics import TokenAverage, bits_per_byte
from lit_transformer.objectives.optim import TrainingClock, build_optimizer, make_scheduler, parameter_groups
from lit_transformer.recipe.schema import OptimConfig, RunConfig
from lit_transformer.training.checkpoints import MODEL_CONFIG_KEY, OBJECTIVE_KEY
from lit_transformer.training.compiled_step import CompileScope, compile_scope, run_compiled
from lit_transformer.training.distributed import prepare_blocks, total_norm
from lit_transformer.training.throughput import StepWork, Throughput


def as_model_config(value: TransformerConfig | dict) -> TransformerConfig:
    return value if isinstance(value, TransformerConfig) else TransformerConfig.from_dict(dict(value))


def as_optim_config(value: OptimConfig | dict | None) -> OptimConfig:
    if value is None:
        return OptimConfig()
    return value if isinstance(value, OptimConfig) else OptimConfig.from_dict(dict(value))


def as_language_model(model: TransformerConfig | LanguageModel | dict) -> LanguageModel:
    """A LanguageModel to train further, or a fresh one built and initialised from a config."""
    return model if isinstance(model, LanguageModel) else LanguageModel.from_config(as_model_config(model))


class ObjectiveOptions(TypedDict, total=False):
    """Keyword options every objective takes, with OPTION_DEFAULTS.

    peak_flops                the device's peak FLOP/s for train/mfu (None: looked up on GPUs)
    skip_nonfinite            skip (and count) optimizer steps whose loss or gradients are not finite
    activation_checkpointing  recompute each Block in backward instead of keeping its activations
                              (memory for about one more forward pass)
    compile                   torch.compile the training step: its whole loss computation as one
                              graph, or each Block under FSDP2 or activation checkpointing
                              (training/compiled_step.py)
    max_time                  seconds of training (trainer.max_time) the linear and cosine
                              schedules decay over, read from `train_clock`; None: max_steps
    """

    peak_flops: float | None
    skip_nonfinite: bool
    activation_checkpointing: bool
    compile: bool
    max_time: float | None


OPTION_DEFAULTS: dict[str, Any] = {
    "peak_flops": None,
    "skip_nonfinite": True,
    "activation_checkpointing": False,
    "compile": False,
    "max_time": None,
}


class ObjectiveBase(L.LightningModule):
    """Subclasses call `super().__init__(...)`, build their modules and torchmetrics in
    `self.eval_metrics` (an nn.ModuleDict), and implement `training_step` (ending in
    `self.finish_training_step(...)`), `eval_update(batch, batch_idx)` and `eval_compute()`."""

    def __init__(
        self,
        *,
        model_config: TransformerConfig,
        optim: OptimConfig | dict | None,
        max_steps: int | None,
        hparams: dict[str, Any] | None = None,
        bytes_per_token: float | None = None,
        **options: Unpack[ObjectiveOptions],
    ):
        """`hparams`: the subclass's own constructor arguments, saved (with optim, max_steps
        and the options) so that `load_from_checkpoint` can rebuild the module. `options`: see
        ObjectiveOptions; activation checkpointing and compile are applied in
        `configure_model`, before FSDP2 sharding."""
        super().__init__()
        if bytes_per_token is not None and not bytes_per_token > 0:
            raise ValueError(f"bytes_per_token={bytes_per_token} must be positive")
        unknown = sorted(set(options) - set(OPTION_DEFAULTS))
        if unknown:
            raise TypeError(f"unknown objective option {unknown[0]!r}; the options are {sorted(OPTION_DEFAULTS)}")
        options = {**OPTION_DEFAULTS, **options}
        optim = as_optim_config(optim)
        saved = {**(hparams or {}), "optim": optim.to_dict(), "max_steps": max_steps, **options}
        self.save_hyperparameters(saved)
        self.model_config = model_config
        self.optim = optim
        self.max_steps = max_steps
        self.bytes_per_token = bytes_per_token
        self.peak_flops = options["peak_flops"]
        self.skip_nonfinite = options["skip_nonfinite"]
        self.activation_checkpointing = options["activation_checkpointing"]
        self.compile_blocks = options["compile"]  # not `self.compile`: that is nn.Module.compile
        # what trainer.compile compiles, decided in configure_model once the strategy is known
        self.compile_scope: CompileScope | None = None
        self.max_time = options["max_time"]
        # seconds of training so far (run by training.TimeBudget, saved in checkpoints)
        self.train_clock = TrainingClock()
        # optimizer steps skipped for a non-finite loss or gradient, saved in checkpoints: what
        # training.callbacks.NonFiniteGuard reads to stop a run after nonfinite_patience in a row
        self.skipped_steps: int = 0
        self.eval_metrics = nn.ModuleDict()
        self.step_work: StepWork | None = None  # this batch's work, taken by the Throughput callback
        # step metrics not yet logged, by prefix ("train/", and "train/<task>/" in a step-mixed
        # mixture): each task's latest values since the last logging step, which logs them all
        self.unwritten_task_metrics: dict[str, dict[str, Any]] = {}

    # ------------------------------------------------------------------ building and loading
    objective_names: tuple[str, ...] = ()  # set by registry.implements
    # Whether the eval loss is the NLL of every token of the text predicted in order, so that
    # loss / ln 2 / bytes per token is the text's bits per byte (bpb). A masked or span loss
    # covers only the corrupted tokens, each seen with the rest of the text: no bpb.
    reports_bits_per_byte: bool = False
    # Whether every loss of training_step goes through `loss_terms`, so that trainer.compile
    # may compile the whole step as one graph (training/compiled_step.py); else it compiles blocks.
    compiles_whole_step: bool = False

    @property
    def objective_name(self) -> str | None:
        """The registered name this module trains (saved in every checkpoint and final model);
        None for a subclass that is not registered (its checkpoints still save)."""
        return self.objective_names[0] if self.objective_names else None

    @staticmethod
    def recipe_options(cfg: RunConfig) -> dict[str, Any]:
        """The constructor arguments every objective takes from a recipe."""
        return dict(
            optim=cfg.optim,
            max_steps=cfg.trainer.max_steps,
            compile=cfg.trainer.compile,
            activation_checkpointing=cfg.trainer.activation_checkpointing,
            max_time=cfg.trainer.max_time,
        )

    @classmethod
    def from_recipe(cls, name: str, cfg: RunConfig, model: TransformerConfig | LanguageModel, data: Any):
        """The module a recipe trains: `model` is a config (from scratch) or a LanguageModel
        (fine-tuning, evaluation); `data` the TextDataModule (bytes_per_token, labels,
        tokenizer and special tokens). This default serves the language models."""
        return cls(model, bytes_per_token=data.bytes_per_token, **cls.recipe_options(cfg))

    @classmethod
    def from_hparams(cls, hparams: dict[str, Any], **overrides: Any):
        """Rebuild from saved hyperparameters (a checkpoint's, or a module's own)."""
        return cls(**{**hparams, **overrides})

    def final_model(self) -> LanguageModel:
        """The language model a finished run saves as config.json + model.safetensors."""
        return self.model

    def final_head(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
        """(description, weights) of a task head saved beside the final model, or None."""
        return None

    @classmethod
    def from_final(
        cls,
        name: str,
        cfg: RunConfig,
        lm: LanguageModel,
        data: Any,
        head: tuple[dict[str, Any], dict[str, torch.Tensor]] | None,
    ):
        """The module around a finished run's saved model (and head), for evaluation."""
        return cls.from_recipe(name, cfg, lm, data)

    def evaluation_streams(
        self, data: Any, task: str | None = None, split: str = "validation"
    ) -> list[tuple[str, Any]]:
        """(metric-name prefix, batches of `split`: validation or test) pairs that `evaluate`
        runs; one objective has one stream. `task` selects one task of a mixture (a single
        objective has none)."""
        if task is not None:
            raise KeyError(f"--task {task}: a {self.objective_name} run is one objective, not a mixture of tasks")
        return [("", data.val_dataloader() if split == "validation" else data.test_dataloader())]

    def measure_bytes_on(self, data: Any, split: str) -> None:
        """Take bits per byte's bytes per token from `split` of `data` (the test split's text is
        not the validation split's) for the evaluations that follow."""
        if self.bytes_per_token is not None:
            self.bytes_per_token = data.split_bytes_per_token(split)

    def bytes_state(self) -> Any:
        """The bytes per token that bits per byte divides by now (what measure_bytes_on sets),
        for restore_bytes_state."""
        return self.bytes_per_token

    def restore_bytes_state(self, state: Any) -> None:
        """Put back what bytes_state returned."""
        self.bytes_per_token = state

    @contextmanager
    def bytes_measured_on(self, data: Any, split: str) -> Iterator[None]:
        """measure_bytes_on(data, split) for the duration of the block; the bytes per token from
        before come back afterwards (or training's next validation would divide its loss by
        that set's)."""
        saved = self.bytes_state()
        self.measure_bytes_on(data, split)
        try:
            yield
        finally:
            self.restore_bytes_state(saved)

    def evaluation_batches(self, batches: Any, data_labels: list | None, model_labels: list | None) -> Any:
        """The batches `evaluate` feeds this module, given the label names the evaluation data
        holds and those the model was trained on (classifiers map one onto the other)."""
        return batches

    # ------------------------------------------------------------------ training
    def token_normalizer(self, count: torch.Tensor) -> torch.Tensor:
        """What to divide a rank's summed token loss by, so that DDP/FSDP's mean of the ranks'
        gradients is the gradient of (all ranks' summed loss / all ranks' tokens): the global
        token count / world size. Dividing by the local count would weight a token on a rank
        with few targets (MLM masks, seq2seq padding) more than one on a busy rank."""
        world = self.trainer.world_size if self._trainer is not None else 1
        if world == 1 or not torch.distributed.is_initialized():
            return count.clamp(min=1)
        total = count.detach().to(torch.float64).clone()
        torch.distributed.all_reduce(total)
        return (total / world).clamp(min=1).to(count.device)

    def loss_terms(self, terms: Callable, batch: dict[str, Any], *args: Any, **kwargs: Any):
        """`terms(self.model, batch, *args, **kwargs)`, one of the objectives' loss-terms
        functions: in a training step whose whole step compiles (compiled_step.py) through its
        compiled graph, else eagerly (evaluation runs eagerly: its last batch has another shape)."""
        if self.compile_scope == "step" and torch.is_grad_enabled():
            return run_compiled(terms, self.model, batch, *args, **kwargs)
        return terms(self.model, batch, *args, **kwargs)

    def fuse_head_and_loss(self) -> bool:
        """Whether the LM head's last projection and the loss run fused (fused_loss.py): in
        training, when that weight is a plain tensor. Under FSDP2 it is a shard outside the
        model's forward, and without gradients the plain path is cheaper."""
        if not torch.is_grad_enabled():
            return False
        from torch.distributed.tensor import DTensor

        return not isinstance(self.model.lm_head.decoder.weight, DTensor)

    def finish_training_step(
        self,
        loss: torch.Tensor,
        nll_mean: torch.Tensor | None,
        batch: dict[str, torch.Tensor],
        *,
        flop_tokens: torch.Tensor | float,
        head_positions: torch.Tensor | float,
        metrics: dict[str, torch.Tensor] | None = None,
        task: str | None = None,
        task_bytes_per_token: float | None = None,
    ) -> torch.Tensor | None:
        """The shared end of training_step: guard, log, hand the batch's work to the Throughput
        callback (`step_work`); returns the loss or None.

        nll_mean: the plain per-token NLL behind train/ppl (None where perplexity means nothing).
        flop_tokens: non-pad input tokens that the body of the model ran on; head_positions:
        positions the LM head ran on (MFU counts only the FLOPs actually spent).
        task: the mixture task this batch belongs to: the loss, ppl and bpb (with
        task_bytes_per_token) are also logged as train/<task>/..., and `metrics` only there.
        """
        attached = self._trainer is not None  # a plain loop (tests, notebooks) may call this too
        if self.skip_nonfinite and not torch.isfinite(loss):  # one host sync per step
            if not attached or self.trainer.world_size == 1:
                # Lightning then skips backward and the optimizer sees no gradients: no update.
                self.skipped_steps += 1
                if attached:
                    self.log("train/skipped_steps", float(self.skipped_steps))
                    # the non-finite value itself, or the logger would repeat the last finite loss
                    self.log("train/loss", loss.detach(), prog_bar=True)
                return None
            # Lightning forbids returning None under DDP/FSDP (all ranks must run backward);
            # the non-finite gradients are all-reduced to every rank and dropped in
            # on_before_optimizer_step instead, consistently everywhere.
        if not attached:
            return loss
        # the global batch's values, not rank 0's share of them (each rank's loss is its summed
        # loss over the global count / W: their mean is the batch's loss); every rank is here
        metrics = metrics or {}
        logged = self._ranks_mean([loss, *([] if nll_mean is None else [nll_mean]), *metrics.values()])
        self.log("train/loss", logged[0], prog_bar=True)  # every step: the progress bar shows it
        self.step_work = StepWork(batch, flop_tokens, head_positions)
        values: dict[str, Any] = dict(zip(metrics, logged[len(logged) - len(metrics) :]))
        step_values = {} if nll_mean is None else {"ppl": logged[1].exp()}
        if task is None:
            self.unwritten_task_metrics["train/"] = {**step_values, **values}
        else:  # a step-mixed task's step: kept until a logging step writes it
            values["loss"] = logged[0]
            if nll_mean is not None:
                values["ppl"] = step_values["ppl"]
                if task_bytes_per_token is not None:
                    values["bpb"] = bits_per_byte(logged[1], task_bytes_per_token)
            self.unwritten_task_metrics["train/"] = step_values
            self.unwritten_task_metrics[f"train/{task}/"] = values
        if self.writes_step_metrics():
            self.write_step_metrics()
        return loss

    def write_step_metrics(self) -> None:
        """Logs the step metrics kept since the last logging step: the learning rate, the skipped
        steps, and every task's latest values, as if each had been logged on its own step (the
        logger writes each name's last value), not only the task of this step."""
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        self.log("train/skipped_steps", float(self.skipped_steps))
        for prefix, task_values in self.unwritten_task_metrics.items():
            for name, value in task_values.items():
                self.log(f"{prefix}{name}", value)
        self.unwritten_task_metrics = {}

    def writes_step_metrics(self) -> bool:
        """Whether this training step's metrics reach the logger. Lightning writes a training
        step's values only every `trainer.log_every_n_steps` optimizer steps (and when the run
        stops) and drops the rest, as its own LearningRateMonitor knows; each `self.log` costs
        a walk over the metric's attributes (lightning's _ResultMetric.to), more than a tiny
        model's loss (benchmarks/README.md, "Mixtures against the causal LM"), so the step metrics
        beyond the progress bar's loss are logged only when they will be written. The same on
        every rank. `should_update_logs` is private, but Lightning's own LearningRateMonitor,
        ThroughputMonitor and DeviceStatsMonitor read it for this same decision; a release that
        renames it fails every training test with an AttributeError, never silently."""
        trainer = self.trainer
        return bool(trainer.fast_dev_run) or trainer._logger_connector.should_update_logs

    def _ranks_mean(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each (scalar) value's mean over the ranks, in one all-reduce; as given in one process."""
        values = [torch.as_tensor(v).detach() for v in values]
        if self.trainer.world_size == 1 or not torch.distributed.is_initialized():
            return values
        total = torch.stack([v.to(torch.float64) for v in values])  # (N,)
        torch.distributed.all_reduce(total)
        return list((total / self.trainer.world_size).to(torch.float32).unbind())

    def flops_config(self) -> TransformerConfig:
        """The configuration whose training FLOPs this objective spends (overridden where only
        part of the model runs); the Throughput callback counts MFU with it."""
        return self.model_config

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:  # training_step returned None: nothing to measure
            return
        norm = total_norm(grads)
        if self.writes_step_metrics():
            self.log("train/grad_norm", norm)
            if self.unwritten_task_metrics:
                # the run stops after this step (TimeBudget decides it in its own hook, just
                # before this one), which Lightning writes although training_step kept its
                # metrics for a later logging step: written now, or they would be stale
                self.write_step_metrics()
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)  # fp16 AMP skips inf steps itself
        if self.skip_nonfinite and scaler is None and not torch.isfinite(norm):
            # A finite loss can still overflow in backward (and under DDP/FSDP a non-finite loss
            # arrives here, all-reduced): drop the step on every rank alike, or one update would
            # turn every weight into NaN. AdamW skips parameters without a gradient: no moment
            # update, no decay.
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
            self.skipped_steps += 1  # logged with the next step's metrics

    # ------------------------------------------------------------------ evaluation
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.eval_update(batch, batch_idx)

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.eval_update(batch, batch_idx)

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    def eval_reset(self) -> None:
        for metric in self.eval_metrics.values():
            metric.reset()

    def lm_eval_metrics(self, loss: torch.Tensor | float, bytes_per_token: float | None = None) -> dict[str, float]:
        """loss, ppl and bpb from a mean NLL in nats per token; bpb with bytes per token (the
        argument, else the objective's own where `reports_bits_per_byte`)."""
        value = float(loss)
        out = {"loss": value, "ppl": math.exp(min(value, 700.0))}  # exp overflows a double past ~709
        if bytes_per_token is None and self.reports_bits_per_byte:
            bytes_per_token = self.bytes_per_token
        if bytes_per_token is not None:
            out["bpb"] = bits_per_byte(value, bytes_per_token)
        return out

    def _log_eval(self, prefix: str) -> None:
        values = self.eval_compute()  # torchmetrics sums over ranks here
        # The values are already global; sync_dist (a mean of equal numbers) only keeps
        # Lightning's epoch-level logging contract in distributed runs.
        self.log_dict({f"{prefix}/{k}": float(v) for k, v in values.items()}, sync_dist=True)
        self.eval_reset()

    # ------------------------------------------------------------------ optimisation
    def lr_scales(self) -> dict[str, float]:
        """Parameter-name prefixes with a learning-rate factor (the classifier's backbone)."""
        return {}

    def _fused_allowed(self) -> bool:
        """Lightning's mixed-precision plugin refuses gradient clipping with an optimizer that
        unscales gradients itself (fused AdamW), so fused is used only without that pairing."""
        if self._trainer is None:
            return True
        mixed = str(self.trainer.precision).endswith("-mixed")
        return not (mixed and self.trainer.gradient_clip_val)

    def configure_optimizers(self):
        groups = parameter_groups(
            self, self.optim.weight_decay, lr_scales=self.lr_scales(), muon=self.optim.optimizer == "muon"
        )
        optimizer = build_optimizer(groups, self.optim, allow_fused=self._fused_allowed())
        max_steps = self.max_steps
        if (max_steps is None or max_steps <= 0) and self._trainer is not None:
            estimated = self.trainer.estimated_stepping_batches
            max_steps = int(estimated) if math.isfinite(estimated) else None
        scheduler = make_scheduler(
            optimizer, self.optim, max_steps, self.model_config.d_model, max_time=self.max_time, clock=self.train_clock
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    def configure_model(self) -> None:
        """The compile scope (compiled_step.py), activation checkpointing and per-Block compile,
        then FSDP2 sharding under Lightning's ModelParallelStrategy (distributed.prepare_blocks);
        calling it again changes nothing."""
        self.compile_scope = compile_scope(
            compile=self.compile_blocks,
            activation_checkpointing=self.activation_checkpointing,
            sharded=self.device_mesh is not None,
            whole_step=self.compiles_whole_step,
        )
        prepare_blocks(
            self,
            activation_checkpointing=self.activation_checkpointing,
            compile=self.compile_scope == "blocks",
            mesh=self.device_mesh,
        )

    def configure_callbacks(self) -> list[L.Callback]:
        """train/tokens_per_s and train/mfu on any Trainer, the recipe's or a user's own."""
        return [Throughput(peak_flops=self.peak_flops)]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["skipped_steps"] = self.skipped_steps
        checkpoint["train_seconds"] = self.train_clock.read()  # a resumed time budget goes on from here
        checkpoint[OBJECTIVE_KEY] = self.objective_name
        checkpoint[MODEL_CONFIG_KEY] = self.model_config.to_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.skipped_steps = int(checkpoint.get("skipped_steps", 0))
        self.train_clock.reset(float(checkpoint.get("train_seconds", 0.0)))


class LanguageModelObjective(ObjectiveBase):
    """The constructor of the objectives that train a LanguageModel on one text stream with one
    bytes per token (CausalLM, MaskedLM); `token_averages` names their eval_metrics, each a
    TokenAverage."""

    token_averages: tuple[str, ...] = ("loss",)

    def __init__(
        self,
        model: TransformerConfig | LanguageModel | dict,
        optim: OptimConfig | dict | None = None,
        max_steps: int | None = None,
        *,
        bytes_per_token: float | None = None,
        **options: Unpack[ObjectiveOptions],
    ):
        """`model`: a config to build and initialise, or a LanguageModel to train further."""
        lm = as_language_model(model)
        super().__init__(
            model_config=lm.config,
            optim=optim,
            max_steps=max_steps,
            bytes_per_token=bytes_per_token,
            hparams={"model": lm.config.to_dict(), "bytes_per_token": bytes_per_token},
            **options,
        )
        self.model = lm
        for name in self.token_averages:
            self.eval_metrics[name] = TokenAverage()
