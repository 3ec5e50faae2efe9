"""trainer.float8: the blocks' matrix products in float8 (Micikevicius et al. 2022, "FP8 Formats
for Deep Learning"), through torchao's float8 training, the library torchtitan uses.

Each nn.Linear inside a Block becomes torchao's Float8Linear: its input, weight and output
gradient are scaled per tensor into float8 (e4m3 forward, e5m2 for gradients) for the three
products of forward and backward, with the weights, optimizer state and everything else kept as
before. Two things stay in the compute dtype, as torchtitan leaves them: the LM head, whose
logits feed a softmax over the whole vocabulary, and any product with a side that is not a
multiple of 16 (float8 kernels need 16-aligned shapes). Float8 products need float8 matrix
units: NVIDIA compute capability 8.9 or newer (L4, RTX 4090, H100, H200, B200); anywhere else
the run is refused at start-up (`check_float8`). torchao is the `float8` extra.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn

from lit_transformer.errors import RecipeError
from lit_transformer.model.transformer import Block

MIN_CAPABILITY = (8, 9)  # Ada Lovelace and Hopper: the first GPUs with float8 tensor cores
ALIGNMENT = 16  # torch._scaled_mm's requirement on both sides of a float8 product


def float8_refusal(accelerator: str) -> str | None:
    """Why trainer.float8 cannot run with `accelerator` on this machine, or None."""
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if not on_gpu or not torch.cuda.is_available():
        return "trainer.float8=true needs an NVIDIA GPU with float8 matrix units (H100, H200, L4); this run is on CPU"
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name()
        return (
            f"trainer.float8=true needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer "
            f"(H100, H200, L4); {name} has {capability[0]}.{capability[1]}"
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "trainer.float8=true needs torchao: pip install 'lit-transformer[float8]'"
    return None


def check_float8(accelerator: str) -> None:
    """Refuse trainer.float8 at start-up, in one line, where it cannot run."""
    reason = float8_refusal(accelerator)
    if reason is not None:
        raise RecipeError(reason)


def is_float8_candidate(module: nn.Module) -> bool:
    """An nn.Linear whose product float8 kernels can take (both sides multiples of 16)."""
    return type(module) is nn.Linear and module.in_features % ALIGNMENT == 0 and module.out_features % ALIGNMENT == 0


def convert_to_float8(model: nn.Module) -> int:
    """Swap every eligible nn.Linear inside a Block for torchao's Float8Linear, in place (before
    compile and FSDP2 sharding, torchtitan's order); returns how many were swapped. The parameters
    keep their names, so checkpoints load with or without float8."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted = 0
    for block in [m for m in model.modules() if isinstance(m, Block)]:
        eligible = {name for name, sub in block.named_modules() if is_float8_candidate(sub)}
        if not eligible:
            continue
        convert_to_float8_training(
            block, config=Float8LinearConfig(), module_filter_fn=lambda sub, fqn, eligible=eligible: fqn in eligible
        )
        converted += len(eligible)
    return converted


class Float8Training(L.Callback):
    """Converts the objective's model when fitting starts: in `setup`, which Lightning calls
    before `configure_model` (so before compile and FSDP2 sharding), and only for `fit`, so that
    `evaluate` and `generate` on a float8-trained model run its ordinary weights anywhere."""

    def __init__(self):
        self.converted = 0  # nn.Linear modules swapped, for the start-up summary and the tests

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.converted = convert_to_float8(pl_module)
