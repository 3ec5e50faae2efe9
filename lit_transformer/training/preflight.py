"""Start-up checks of what a recipe asks of the machine, before anything is written or spawned:
devices that exist, data-loader workers the cores can feed, and memory one rank needs.

A recipe written for 8 GPUs (recipes/base/paper.yaml) and started on a 2-core CPU machine
would otherwise spawn 8 processes with 4 workers each and be killed by the kernel's
out-of-memory killer minutes later, without a message.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass

import torch

from lit_transformer.constants import LOSS_CHUNK_ROWS, LOSS_GPU_PIECE_BYTES
from lit_transformer.data.data_config import DataConfig
from lit_transformer.errors import RecipeError
from lit_transformer.model.config import TransformerConfig
from lit_transformer.recipe.schema import TrainerConfig

GB = 1e9
# Resident memory of one training process before the model: Python, torch, Lightning, datasets,
# tokenizers and wandb imported, with a margin over the measurement (docs/defaults.md, "Start-up
# memory check").
PROCESS_BYTES = int(0.6 * GB)
# A data-loader worker is a fork of its rank; copy-on-write keeps most pages shared, but the
# interpreter's reference counts touch some (an estimate, not a measurement of every corpus).
WORKER_BYTES = int(0.25 * GB)


def cpu_cores() -> int:
    """Cores this process may run on (the affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_memory() -> int:
    """Bytes of the first GPU (ranks get one GPU each; nodes are alike)."""
    return torch.cuda.get_device_properties(0).total_memory


def on_gpu(trainer: TrainerConfig) -> bool:
    accelerator = trainer.accelerator
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and gpu_count() > 0)


def processes_per_node(trainer: TrainerConfig) -> int:
    """Lightning's process count on this node: `devices`, with "auto" meaning every GPU, or one
    process on a CPU."""
    devices = trainer.devices
    if devices == "auto":
        return max(gpu_count(), 1) if on_gpu(trainer) else 1
    return int(devices)


def check_devices(t: TrainerConfig) -> None:
    """One line naming the keys to change when the recipe asks for devices that are not here."""
    gpus = gpu_count()
    if t.accelerator in ("gpu", "cuda") and gpus == 0:
        raise RecipeError(
            f"trainer.accelerator={t.accelerator} but this machine has no CUDA GPU; "
            "set trainer.accelerator=cpu (or auto)"
        )
    wanted = processes_per_node(t)
    if on_gpu(t):
        if wanted > gpus:
            raise RecipeError(
                f"trainer.devices={t.devices} but this machine has {gpus} GPU(s); set "
                f"trainer.devices={gpus} (and raise trainer.accumulate_grad_batches by the same "
                "factor to keep the global batch)"
            )
        return
    cores = cpu_cores()
    if wanted > cores:
        # a CPU "device" is a process: more of them than cores only time-slice the same cores
        raise RecipeError(
            f"trainer.devices={t.devices} asks for {wanted} processes but this machine has no GPU and {cores} CPU "
            f"core(s); to run here set trainer.devices=1 (up to {cores}) and "
            f"trainer.accumulate_grad_batches={t.accumulate_grad_batches * wanted} to keep the global batch"
        )


def workers_limit(trainer: TrainerConfig) -> int:
    """The data-loader workers one rank may start: the cores it has (at least one)."""
    return max(cpu_cores() // processes_per_node(trainer), 1)


def capped_workers(trainer: TrainerConfig, wanted: int) -> int:
    """`wanted` data-loader workers (data.num_workers), at most the cores one rank has (a notice
    on stderr when capped)."""
    per_rank = workers_limit(trainer)
    if wanted <= per_rank:
        return wanted
    print(
        f"data.num_workers={wanted} capped to {per_rank}: {cpu_cores()} CPU core(s) shared by "
        f"{processes_per_node(trainer)} process(es)",
        file=sys.stderr,
    )
    return per_rank


@dataclass(frozen=True)
class MemoryEstimate:
    states: int  # weights, gradients and AdamW moments held by one rank
    activations: int  # kept for backward, one micro-batch, logits included
    tokens: int  # the longest sequence the estimate assumed

    @property
    def per_rank(self) -> int:
        return self.states + self.activations


def estimate(t: TrainerConfig, data: DataConfig, model: TransformerConfig, tokens: int) -> MemoryEstimate:
    """What one rank holds while training, from the config alone (docs/scaling.md, "Memory"): states at
    16 bytes per parameter (8 in bf16-true), divided over the ranks under FSDP; activations
    from Korthikanti et al. 2022 (table 2): 34 * T * d_model bytes per layer and sequence in 16-bit,
    its MLP share (19 of 34, for d_ff = 4 d_model) scaled by d_ff, doubled in float32; plus one
    chunk of the loss's float32 logits. `tokens`: the longest sequence a batch holds (the recipe's
    configured maximum, `recipe.model_section.longest_input`)."""
    from lit_transformer.model.accounting import count_parameters

    params = count_parameters(model)
    states = params * (8 if t.precision == "bf16-true" else 16)
    if t.strategy == "fsdp":
        states //= processes_per_node(t) * t.num_nodes
    batch = data.batch_size
    if data.batch_tokens is not None:  # pairs x the longest side <= batch_tokens (one over-long pair alone)
        batch = max(data.batch_tokens // tokens, 1)
    width = 2 if t.precision == "32-true" else 1  # bytes per element over the 16-bit formula's 2
    full_layer = (15 * model.d_model + 19 * model.d_ff / 4) * width  # per token
    layers = model.n_layers
    if model.arch == "encoder_decoder":  # a decoder layer adds cross-attention: about half a layer more
        layers += model.decoder_layers * 3 / 2
    if t.activation_checkpointing:  # block inputs only, plus one block recomputed at a time
        activations = (2 * model.d_model * width * layers + full_layer) * tokens * batch
    else:
        activations = full_layer * layers * tokens * batch
    # the LM head's logits exist one chunk of at most CHUNK_ROWS rows at a time, in the compute
    # dtype, and become that chunk's gradient in place (objectives/fused_loss.py): 4 bytes at most
    logits = 4 * min(batch * tokens, LOSS_CHUNK_ROWS) * model.vocab_size
    if on_gpu(t):  # plus a GPU piece's two float32 copies (the CPU's pieces are a few MB)
        logits += 2 * min(logits, LOSS_GPU_PIECE_BYTES)
    return MemoryEstimate(states=int(states), activations=int(activations + logits), tokens=tokens)


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(trainer: TrainerConfig, data: DataConfig, model: TransformerConfig, tokens: int) -> None:
    """One line when one node's ranks cannot fit, naming the keys that shrink the need."""
    need = estimate(trainer, data, model, tokens)
    if data.batch_tokens is not None:
        key, size = "data.batch_tokens", f"data.batch_tokens={data.batch_tokens}"
    else:
        key, size = "data.batch_size", f"data.batch_size={data.batch_size} x {need.tokens} tokens"
    fixes = (
        f"lower {key} (raise trainer.accumulate_grad_batches to keep the global batch), "
        "set trainer.activation_checkpointing=true, or trainer.check_memory=false to try anyway"
    )
    shape = f"states {need.states / GB:.1f} GB + activations {need.activations / GB:.1f} GB at {size}"
    if on_gpu(trainer):
        total = gpu_memory()
        if need.per_rank > total:
            raise RecipeError(
                f"one GPU needs about {need.per_rank / GB:.1f} GB ({shape}) but has {total / GB:.1f} GB; {fixes}"
            )
        return
    available = available_memory()
    if available is None:
        return
    ranks = processes_per_node(trainer)
    total = (
        ranks * (need.per_rank + PROCESS_BYTES) + ranks * min(data.num_workers, workers_limit(trainer)) * WORKER_BYTES
    )
    if total > available:
        raise RecipeError(
            f"{ranks} process(es) x about {(need.per_rank + PROCESS_BYTES) / GB:.1f} GB each ({shape}) "
            f"need about {total / GB:.1f} GB but this machine has {available / GB:.1f} GB available; "
            f"{fixes}"
        )


def check_precision(t: TrainerConfig) -> None:
    """16-mixed needs a GPU: on CPU Lightning would autocast to float16, which the CPU kernels
    run slowly and without the loss scaling that keeps fp16 gradients finite. float8 needs a
    GPU with float8 matrix units (training/float8.py)."""
    on_cpu = t.accelerator == "cpu" or (t.accelerator == "auto" and not torch.cuda.is_available())
    if t.precision == "16-mixed" and on_cpu:
        raise RecipeError("trainer.precision=16-mixed needs CUDA GPUs; on CPU use bf16-mixed, bf16-true or 32-true")
    if t.float8:
        from lit_transformer.training.float8 import check_float8

        check_float8(t.accelerator)


CXX_COMPILERS = ("g++", "c++", "clang++")  # what inductor's C++ backend looks for besides $CXX


def check_compile_toolchain(t: TrainerConfig) -> None:
    """trainer.compile on a CPU: inductor writes C++ and builds it with the machine's compiler;
    without one, the first step would fail deep inside torch.compile."""
    if not t.compile or on_gpu(t):
        return
    wanted = [os.environ["CXX"]] if os.environ.get("CXX") else list(CXX_COMPILERS)
    if not any(shutil.which(c) for c in wanted):
        raise RecipeError(
            f"trainer.compile=true on a CPU needs a C++ compiler (inductor builds its kernels), and this machine "
            f"has none of {', '.join(wanted)}: install one (Debian: apt install g++) or set trainer.compile=false"
        )


def check(trainer: TrainerConfig, data: DataConfig, model: TransformerConfig, tokens: int) -> None:
    """Every start-up check that needs only the recipe and the machine, before anything is
    trained or written: devices, precision, float8, the compile toolchain, memory. Devices and
    memory in local rank 0 of each node only: the node's other ranks (started by Lightning,
    torchrun or srun) find the machine already loaded by their siblings, and their memory counted
    by rank 0. The resolved run gives what the checks need: its trainer and data sections, the
    model config and the longest sequence a batch holds."""
    # here, not at the top: estimate() serves `info --plan`, which must not import Lightning
    from lit_transformer.training.distributed import local_rank

    check_precision(trainer)
    check_compile_toolchain(trainer)
    if local_rank() > 0:
        return
    check_devices(trainer)
    if trainer.check_memory:
        check_memory(trainer, data, model, tokens)
