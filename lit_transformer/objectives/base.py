"""ObjectiveBase: what every training objective shares. The subclasses own their modules,
losses and metrics; this class owns the optimizer and schedule, the per-step training
metrics (loss, perplexity, learning rate, gradient norm, throughput, MFU), the non-finite
loss guard, the evaluation plumbing (validation, test and `evaluate_batches`) and the FSDP2
hook.

Training metrics, logged with `self.log` at every step (the Trainer's log_every_n_steps
decides what reaches the logger), except tokens_per_s and mfu, computed on logging steps only:
  train/loss, train/ppl   the minimised loss (label-smoothed if asked) and exp(plain NLL)
  train/lr                the first parameter group's learning rate for this step
  train/grad_norm         total 2-norm of all gradients, BEFORE clipping: Lightning calls
                          on_before_optimizer_step and then clips (Precision._after_closure in
                          lightning 2.6), and with a GradScaler the gradients are already unscaled
  train/tokens_per_s      non-pad tokens per second summed over ranks, averaged over the
                          window since the last logging step (wall clock, CUDA synchronised once
                          per window, not per step)
  train/mfu               model FLOPs per second / peak FLOP/s of all devices (Chowdhery et al.
                          2022, PaLM, 4.1 and appendix B), FLOPs from model.accounting; only
                          when the peak is known (PEAK_FLOPS on a GPU, or `peak_flops`)
  train/skipped_steps     how many optimizer steps the non-finite guard has skipped so far

Validation and test (`val/...`, `test/...`) and `evaluate_batches` share one path per objective
(`eval_update` per batch, `eval_compute` at the end): losses are the plain NLL (no label
smoothing) summed over tokens and divided by the token count over all batches and ranks.

The non-finite guard costs one host-device sync per step (`skip_nonfinite=False` removes it).

Shape legend: B batch, T length.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, TypedDict, Unpack

import lightning as L
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..model.config import TransformerConfig
from ..model.language_model import LanguageModel
from ..model.transformer import Block
from .metrics import bits_per_byte, peak_flops_for
from .optim import OptimConfig, build_optimizer, make_scheduler, parameter_groups


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
    compile                   torch.compile every Block (identical blocks share one graph)
    """

    peak_flops: float | None
    skip_nonfinite: bool
    activation_checkpointing: bool
    compile: bool


OPTION_DEFAULTS: dict[str, Any] = {"peak_flops": None, "skip_nonfinite": True, "activation_checkpointing": False,
                                   "compile": False}


def non_pad_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if attention_mask is None:
        return torch.tensor(float(input_ids.numel()), device=input_ids.device)
    return attention_mask.sum().float()


class ObjectiveBase(L.LightningModule):
    """Subclasses call `super().__init__(...)`, build their modules and torchmetrics in
    `self.eval_metrics` (an nn.ModuleDict), and implement `training_step` (ending in
    `self.finish_training_step(...)`), `eval_update(batch, batch_idx)` and `eval_compute()`."""

    def __init__(self, *, model_config: TransformerConfig, optim: OptimConfig | dict | None, max_steps: int | None,
                 hparams: dict[str, Any] | None = None, bytes_per_token: float | None = None,
                 **options: Unpack[ObjectiveOptions]):
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
        self.skipped_steps = 0
        self.eval_metrics = nn.ModuleDict()
        self._flops_cache: dict[tuple[int, int | None], tuple[float, float]] = {}
        self._window_start: float | None = None
        self._window: torch.Tensor | None = None  # (tokens, model FLOPs) since the window start
        self._window_step = 0

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

    def fuse_head_and_loss(self) -> bool:
        """Whether the LM head's last projection and the loss run fused (fused_loss.py): in
        training, when that weight is a plain tensor. Under FSDP2 it is a shard outside the
        model's forward, and without gradients the plain path is cheaper."""
        if not torch.is_grad_enabled():
            return False
        from torch.distributed.tensor import DTensor

        return not isinstance(self.model.lm_head.decoder.weight, DTensor)

    def finish_training_step(self, loss: torch.Tensor, nll_mean: torch.Tensor | None,
                             batch: dict[str, torch.Tensor], *, flop_tokens: torch.Tensor | float,
                             head_positions: torch.Tensor | float,
                             metrics: dict[str, torch.Tensor] | None = None) -> torch.Tensor | None:
        """The shared end of training_step: guard, log, count throughput; returns the loss or None.

        nll_mean: the plain per-token NLL behind train/ppl (None where perplexity means nothing).
        flop_tokens: non-pad input tokens that the body of the model ran on; head_positions:
        positions the LM head ran on (MFU counts only the FLOPs actually spent).
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
        self.log("train/loss", loss.detach(), prog_bar=True)
        if nll_mean is not None:
            self.log("train/ppl", nll_mean.exp())
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        self.log("train/skipped_steps", float(self.skipped_steps))
        for name, value in (metrics or {}).items():
            self.log(f"train/{name}", value)
        self._count_work(batch, flop_tokens, head_positions)
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._window_start is None:
            self._window_start, self._window_step = time.perf_counter(), self.global_step

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:  # training_step returned None: nothing to measure
            return
        norm = total_norm(grads)
        self.log("train/grad_norm", norm)
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

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        every = max(self.trainer.log_every_n_steps, 1)
        if self.global_step == self._window_step or self.global_step % every or self._window is None:
            return  # accumulating, or not a logging step
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # host time must cover the GPU work it timed
        now = time.perf_counter()
        seconds = max(now - self._window_start, 1e-9)
        totals = self.trainer.strategy.reduce(self._window, reduce_op="sum")  # (2,) over all ranks
        self.log("train/tokens_per_s", totals[0] / seconds)
        peak = self._peak_flops()
        if peak is not None:
            self.log("train/mfu", totals[1] / seconds / (peak * self.trainer.world_size))
        self._window_start, self._window_step, self._window = now, self.global_step, None

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

    def lm_eval_metrics(self, loss: torch.Tensor) -> dict[str, float]:
        """loss, ppl and (with bytes_per_token) bpb from a mean NLL in nats per token."""
        value = float(loss)
        out = {"loss": value, "ppl": math.exp(min(value, 700.0))}  # exp overflows a double past ~709
        if self.bytes_per_token is not None:
            out["bpb"] = bits_per_byte(value, self.bytes_per_token)
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
        groups = parameter_groups(self, self.optim.weight_decay, lr_scales=self.lr_scales())
        optimizer = build_optimizer(groups, self.optim, allow_fused=self._fused_allowed())
        max_steps = self.max_steps
        if (max_steps is None or max_steps <= 0) and self._trainer is not None:
            estimated = self.trainer.estimated_stepping_batches
            max_steps = int(estimated) if math.isfinite(estimated) else None
        scheduler = make_scheduler(optimizer, self.optim, max_steps, self.model_config.d_model)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    def configure_model(self) -> None:
        """Per Block, in torchtitan's order: activation checkpointing, then torch.compile, then
        FSDP2 (under Lightning's ModelParallelStrategy) shards every Block and each top-level
        module with parameters (its root group gathers embeddings, norms and heads; tied
        weights stay inside one group). Sharding needs a device mesh; the first two do not, so
        a plain loop may call this too. Calling it again changes nothing."""
        blocks = [module for module in self.modules() if isinstance(module, Block)]
        if self.activation_checkpointing:
            for block in blocks:
                checkpoint_block(block)
        if self.compile_blocks:
            # Per block rather than the whole model: the stack's mask and position bookkeeping
            # (data-dependent, e.g. dropping an all-ones mask for SDPA's fused path) and the MLM
            # head's masked positions stay eager; identical blocks share one compiled graph.
            for block in blocks:
                if getattr(block, "_compiled_call_impl", None) is None:
                    block.compile()
        mesh = self.device_mesh
        if mesh is None:
            return
        try:
            from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

        if "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
            raise ValueError("tensor parallelism is not implemented: use ModelParallelStrategy(tensor_parallel_size=1)")
        dp_mesh = mesh["data_parallel"] if mesh.mesh_dim_names and "data_parallel" in mesh.mesh_dim_names else mesh
        for module in self.modules():
            if isinstance(module, Block) and not isinstance(module, FSDPModule):
                fully_shard(module, mesh=dp_mesh)
        for child in self.children():
            if not isinstance(child, FSDPModule) and any(True for _ in child.parameters()):
                fully_shard(child, mesh=dp_mesh)
            if isinstance(child, LanguageModel):
                # MaskedLM calls logits_at, not forward: gather the root unit's shards there too
                register_fsdp_forward_method(child, "logits_at")
        from ..training import materialize  # here: training imports the recipe schema, which imports objectives

        kind = dp_mesh.device_type
        materialize(self, torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["skipped_steps"] = self.skipped_steps

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.skipped_steps = int(checkpoint.get("skipped_steps", 0))

    # ------------------------------------------------------------------ throughput internals
    def _count_work(self, batch: dict[str, torch.Tensor], flop_tokens: torch.Tensor | float,
                    head_positions: torch.Tensor | float) -> None:
        body, head = self._flops_per_token(batch)
        tokens = non_pad_tokens(batch["input_ids"], batch.get("attention_mask"))
        if "decoder_input_ids" in batch:
            tokens = tokens + non_pad_tokens(batch["decoder_input_ids"], batch.get("decoder_attention_mask"))

        def on_device(x):
            return torch.as_tensor(x, dtype=torch.float32, device=tokens.device)

        work = torch.stack([on_device(tokens), on_device(flop_tokens) * body + on_device(head_positions) * head])
        self._window = work if self._window is None else self._window + work

    def _flops_per_token(self, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
        """(body FLOPs per input token, LM-head FLOPs per head position) for this batch's lengths."""
        T = batch["input_ids"].shape[1]
        T_dec = batch["decoder_input_ids"].shape[1] if "decoder_input_ids" in batch else None
        key = (T, T_dec)
        if key not in self._flops_cache:
            from ..model.accounting import train_flops

            cfg = self.flops_config()
            flops = train_flops(cfg, T, T_dec if cfg.arch == "encoder_decoder" else None)
            outputs = T_dec if T_dec is not None and cfg.arch == "encoder_decoder" else T
            self._flops_cache[key] = ((flops.total - flops.lm_head) / T, flops.lm_head / outputs)
        return self._flops_cache[key]

    def flops_config(self) -> TransformerConfig:
        """The configuration whose training FLOPs this objective spends (overridden where only
        part of the model runs)."""
        return self.model_config

    def _peak_flops(self) -> float | None:
        if self.peak_flops is not None:
            return self.peak_flops
        if self.device.type != "cuda":
            return None
        return peak_flops_for(torch.cuda.get_device_name(self.device), str(self.trainer.precision))


@contextlib.contextmanager
def gathered_parameters(module: nn.Module):
    """Every FSDP2 unit inside `module` unsharded on this rank for the duration; nothing happens
    without FSDP2. Every rank must enter (the gather is collective); inside, the model runs
    without collectives. For work that calls parts of the model directly or a rank-dependent
    number of times (generation, BLEU decoding), which FSDP2's gather-in-forward-hooks would
    leave with sharded weights or deadlock on. Costs the full model's memory on every rank
    while inside. Each unit's reshard-after-forward setting is restored on the way out (the
    root unit's is automatically off: restoring it through the public setter would turn it on)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import FSDPModule
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    saved = []
    for unit in units:
        state = unit._get_fsdp_state()
        saved.append((state, state._auto_reshard_after_forward,
                      [group.post_forward_mesh_info for group in state._fsdp_param_groups]))
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        for unit in units:
            unit.unshard()
        yield
    finally:
        for unit, (state, auto, infos) in zip(units, saved):
            unit.reshard()
            state._auto_reshard_after_forward = auto
            for group, info in zip(state._fsdp_param_groups, infos):
                group.post_forward_mesh_info = info
        for unit, (state, _, _) in zip(units, saved):
            if state._is_root:
                # Forward calls made inside (on rank 0 only, for sample generation) were recorded
                # in the order FSDP2 prefetches from in the next backward; left there, the ranks
                # would prefetch different units and deadlock.
                unit.reset_iter_state()


class CheckpointedBlock(Block):
    """A Block that keeps only its inputs and recomputes the rest in backward
    (torch.utils.checkpoint, non-reentrant: dropout masks repeat, keyword arguments pass)."""

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation and generation: nothing to save
            return super().forward(*args, **kwargs)
        return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)


def checkpoint_block(block: Block) -> None:
    """Turn on activation checkpointing for one Block by swapping its class for
    CheckpointedBlock (as FSDP2's fully_shard swaps classes): the module keeps its identity,
    parameter names and state dict, so checkpoints load with or without it."""
    if isinstance(block, CheckpointedBlock):
        return
    if type(block) is not Block:
        raise TypeError(f"activation checkpointing wraps Block modules, not {type(block).__name__}")
    block.__class__ = CheckpointedBlock


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all gradients together (sharded DTensors included: a global norm)."""
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
    else:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    full_tensor = getattr(norm, "full_tensor", None)  # a DTensor under FSDP2: reduce the shards
    return full_tensor() if full_tensor is not None else norm
