"""Everything specific to DDP and FSDP2, in one place, so that the model core and the
objectives stay the same on one CPU or many GPUs:

  FSDP2Strategy           Lightning's ModelParallelStrategy as pure FSDP2
  prepare_blocks          activation checkpointing and torch.compile per Block, then the
                          fully_shard loop (torchtitan's order), from an objective's configure_model
  meta_language_model     build on the meta device; materialize allocates and initialises
                          each rank's shards after sharding
  gathered_parameters     unshard every FSDP2 unit for generation and BLEU decoding
  eager_outside_the_step  compiled blocks run eagerly for generation and evaluations
  full_state_dict         the whole state dict on CPU, gathered from the shards
  total_norm              the global gradient norm, sharded DTensors included
  local_rank              this process's index on its node, before the process group exists
  is_main_process         rank 0 of node 0, before the process group exists

Nothing here knows an objective or a recipe.
"""

from __future__ import annotations

import contextlib
import itertools
import os

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.checkpoint import checkpoint

from lit_transformer.model.init import init_weights
from lit_transformer.model.language_model import LanguageModel
from lit_transformer.model.transformer import Block


def local_rank() -> int:
    """This process's index among the processes of its node: LOCAL_RANK (Lightning's launcher and
    torchrun set it), else SLURM_LOCALID (srun sets only that), else 0 (a single process)."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        value = os.environ.get(name)
        if value is not None:
            return int(value)
    return 0


def is_main_process() -> bool:
    """False in every process but the first of the job: the extra processes of a node (local
    rank > 0, NODE_RANK > 0), and those torchrun (RANK) or srun (SLURM_PROCID) start on other
    nodes, whose local rank is 0 too (torchrun sets no NODE_RANK)."""
    first = ("NODE_RANK", "RANK", "SLURM_PROCID")
    return local_rank() == 0 and all(os.environ.get(name, "0") == "0" for name in first)


class FSDP2Strategy(ModelParallelStrategy):
    """ModelParallelStrategy as pure FSDP2: data_parallel_size = world size and
    tensor_parallel_size = 1, fixed once the launcher knows the world size (its "auto"
    defaults are data_parallel = nodes and tensor_parallel = devices per node, i.e. tensor
    parallelism inside a node, which the objectives do not implement). The device mesh takes
    the root device's type, so on CPU it is a gloo mesh and on GPUs an NCCL one.

    Checkpoints are distributed: a directory holding one shard file per rank and meta.pt."""

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether FSDP2 has sharded the module's parameters (they are DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's whole state dict on CPU. Under FSDP2 every rank must call this (the
    shards are all-gathered); rank 0 receives the tensors, the other ranks an empty dict."""
    if not is_sharded(module):
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def meta_language_model(config) -> LanguageModel:
    """A LanguageModel of shapes only, for FSDP2: each rank allocates and initialises its shards
    in `materialize`, so a model larger than one device's memory can be built, with exactly the
    weights an eager init draws now (the generator state is kept for that)."""
    model = LanguageModel.from_config(config, device="meta")
    model.init_rng_state = torch.get_rng_state()
    return model


def materialize(module: torch.nn.Module, device: torch.device) -> None:
    """Allocate and initialise a module built on the meta device after FSDP2 sharded it: each
    rank allocates only its shards (`to_empty`), and `init_weights` then draws every weight
    in full, one tensor at a time on the CPU, keeping this rank's rows. The draws come from
    the global generator in the order an unsharded `init_weights` takes them, so the sharded
    model starts from exactly the weights a one-process run starts from, at a peak of one
    whole tensor beyond the shards. (DTensor's own random ops would draw each shard locally on
    CPU meshes; torch.distributed.tensor._random supports only CUDA-like devices.)"""
    if not any(p.is_meta for p in module.parameters()):
        return
    # Only modules that hold meta tensors themselves: `to_empty` on the whole LightningModule
    # would also replace the torchmetrics states and their reset defaults with uninitialised
    # memory (Metric._apply maps both), so a validation loss started from garbage: inf or NaN
    # in some runs, depending on what the allocator handed back.
    for sub in module.modules():
        if any(t.is_meta for t in itertools.chain(sub.parameters(recurse=False), sub.buffers(recurse=False))):
            sub.to_empty(device=device, recurse=False)
    for sub in module.modules():
        if isinstance(sub, LanguageModel):
            sub.tie_weights()  # to_empty allocates a tied weight once per name
            state = getattr(sub, "init_rng_state", None)  # set by commands/train.py when it built the model
            with torch.random.fork_rng(devices=[]), _WholeTensorDraws():
                if state is not None:
                    torch.set_rng_state(state)
                init_weights(sub, sub.config)
    left = [name for name, p in module.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"meta-device parameters left without initialisation: {left[:3]}")


class _WholeTensorDraws(torch.overrides.TorchFunctionMode):
    """Inside: `normal_` on a sharded DTensor draws the whole tensor from the global
    generator on the CPU and copies this rank's dim-0 chunk into the local shard (FSDP2
    shards dim 0 as torch.chunk does)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor, Shard

        kwargs = dict(kwargs or {})
        # nn.init.normal_ dispatches itself (keyword arguments) while a mode is active
        if func not in (torch.Tensor.normal_, torch.nn.init.normal_):
            return func(*args, **kwargs)
        target = args[0] if args else kwargs.pop("tensor")
        if not isinstance(target, DTensor):
            return func(target, *args[1:], **kwargs)
        (placement,) = target.placements
        whole = torch.empty(target.shape, dtype=target.dtype)
        func(whole, *args[1:], **kwargs)  # the draws of an unsharded init
        local = target.to_local()
        if isinstance(placement, Shard):
            mesh = target.device_mesh
            pieces = torch.chunk(whole, mesh.size(), dim=placement.dim)
            rank = mesh.get_local_rank()
            whole = pieces[rank] if rank < len(pieces) else whole[:0]
        if whole.shape != local.shape:
            raise RuntimeError(f"shard shape {tuple(local.shape)} is not torch.chunk's {tuple(whole.shape)}")
        with torch.no_grad():
            local.copy_(whole)
        return target


def prepare_blocks(module: nn.Module, *, activation_checkpointing: bool, compile: bool, mesh=None) -> None:
    """Per Block, in torchtitan's order: activation checkpointing, then torch.compile, then
    FSDP2 (when `mesh` is given) shards every Block and each top-level child with parameters
    (its root group gathers embeddings, norms and heads; tied weights stay inside one group),
    and a meta-built model is materialised. Sharding needs a device mesh; the first two do
    not, so a plain loop may call this too. Calling it again changes nothing."""
    blocks = [sub for sub in module.modules() if isinstance(sub, Block)]
    if activation_checkpointing:
        for block in blocks:
            checkpoint_block(block)
    if compile:
        # Per block rather than the whole model: the stack's mask and position bookkeeping
        # (data-dependent, e.g. dropping an all-ones mask for SDPA's fused path) and the MLM
        # head's masked positions stay eager; identical blocks share one compiled graph.
        for block in blocks:
            if getattr(block, "_compiled_call_impl", None) is None:
                block.compile()
    if mesh is None:
        return
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    if "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
        raise ValueError("tensor parallelism is not implemented: use ModelParallelStrategy(tensor_parallel_size=1)")
    dp_mesh = mesh["data_parallel"] if mesh.mesh_dim_names and "data_parallel" in mesh.mesh_dim_names else mesh
    for sub in module.modules():
        if isinstance(sub, Block) and not isinstance(sub, FSDPModule):
            fully_shard(sub, mesh=dp_mesh)
    for child in module.children():
        if not isinstance(child, FSDPModule) and any(True for _ in child.parameters()):
            fully_shard(child, mesh=dp_mesh)
        if isinstance(child, LanguageModel):
            # MaskedLM calls logits_at, not forward: gather the root unit's shards there too
            register_fsdp_forward_method(child, "logits_at")
    kind = dp_mesh.device_type
    materialize(module, torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind))


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
    # FSDP2 takes the first unit whose forward runs as the root of its tree (lazy init) and then
    # refuses a forward through an outer unit. Before the first training step (the step-0
    # evaluations) nothing has run yet, and an evaluation that calls a part of the model (the
    # classify probe reads `model.transformer`) would make an inner Block its own root: training's
    # forward then fails with "FSDP state has already been lazily initialized". So the outermost
    # units are made roots here, as their first forward would; once done this is a no-op.
    inner = {id(sub) for unit in units for sub in unit.modules() if sub is not unit}
    for unit in units:
        if id(unit) not in inner:
            unit._get_fsdp_state()._lazy_init()
    saved = []
    for unit in units:
        state = unit._get_fsdp_state()
        saved.append(
            (
                state,
                state._auto_reshard_after_forward,
                [group.post_forward_mesh_info for group in state._fsdp_param_groups],
            )
        )
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


def eager_outside_the_step(module: nn.Module):
    """A context in which blocks compiled for training (trainer.compile) run eagerly: sample
    generation and named evaluations call them with shapes that change from call to call (a
    growing KV cache, ragged batches of choices), each a new graph to compile, which costs far more
    than the few batches it would speed up. Measured on 2 CPU cores with a cold compile cache
    (2026-11-27): a tiny clm run that generates and evaluates at each validation, stopped and
    resumed (the option table's compiled store row, tests/option_pairs.py), took 132 s compiling them, 65 s
    not. Validation batches keep one shape and stay compiled. A module with nothing compiled gets
    no context at all: under the stance a tiny model's eager forward took about 2% longer (median
    of 5 rounds of 300 calls)."""
    compiled_step = getattr(module, "compile_scope", None) == "step"  # compiled_step.py
    if compiled_step or any(getattr(sub, "_compiled_call_impl", None) is not None for sub in module.modules()):
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()
