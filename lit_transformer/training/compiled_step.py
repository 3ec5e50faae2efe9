"""trainer.compile: where torch.compile's graphs begin and end.

Two scopes, chosen per run from what wraps the blocks (`compile_scope`):

- "step" (one process or DDP, no activation checkpointing): the objective's loss terms, from
  the token ids through the embeddings, every block, the final norm and the LM head to the
  loss sums, run as one graph per input shape, the way nanoGPT and litgpt compile the whole
  model. The head and the fused loss (fused_loss.py) are inside it, so inductor sees the last
  block's output, the head's matrix products and the softmax together instead of three eager
  pieces between compiled blocks.
- "blocks" (FSDP2, activation checkpointing, or an objective whose loss does not go through
  `ObjectiveBase.loss_terms`: classification, a user's own subclass): each Block compiled on its own (torchtitan's
  regional compile, distributed.prepare_blocks). FSDP2 gathers a block's shards in hooks around
  its forward, and a checkpointed block reruns its forward in backward; both wrap a block, not
  the step. Identical blocks share one graph; the embeddings, head and loss run eager.

What keeps the step's graph whole (no graph breaks; tests/training/test_compiled_step.py counts
them): the decisions that read tensor values are taken before the graph is entered. A padding
mask that masks nothing (packed rows: the collators always send one) is dropped from the batch
here, so the graph takes SDPA's fused causal path without a bias tensor, as the eager step does
through masks.masks_nothing. The masked-LM head gathers the masked positions (a count known only
from the data): dynamo captures that as one symbolic size (`capture_dynamic_output_shape_ops`)
instead of breaking the graph there. Shapes start static (packed rows keep one shape); a second
shape of the same terms marks the changed sizes dynamic (torch.compile's automatic dynamic
shapes), so ragged seq2seq batches cost one more compilation, not one per length.

Graph breaks and recompilations are logged under `--debug` (commands/cli.py sets TORCH_LOGS).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

CompileScope = Literal["step", "blocks"]
# the padding masks of a batch that `without_full_masks` may drop (collators' key names)
MASK_KEYS = ("attention_mask", "decoder_attention_mask")
_GRAPHS: dict[Callable, Callable] = {}  # terms function -> its compiled form (dynamo guards per model)


def compile_scope(
    *, compile: bool, activation_checkpointing: bool, sharded: bool, whole_step: bool
) -> CompileScope | None:
    """What trainer.compile compiles for a run: None (nothing), the whole step, or each block.
    `whole_step`: the objective computes its loss through `ObjectiveBase.loss_terms`."""
    if not compile:
        return None
    return "step" if whole_step and not (activation_checkpointing or sharded) else "blocks"


def without_full_masks(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch's tensors without the padding masks that mask nothing (one host sync each, the
    one the eager step's masks_nothing makes too), so that the graph is built for the unmasked
    case. Other entries (a mixture's task index) are left out: the loss terms read tensors only,
    and dynamo would guard on each value and compile again for the next one."""
    drop = {key for key in MASK_KEYS if isinstance(batch.get(key), torch.Tensor) and bool(batch[key].all())}
    return {key: value for key, value in batch.items() if isinstance(value, torch.Tensor) and key not in drop}


def run_compiled(terms: Callable, model: torch.nn.Module, batch: dict[str, Any], *args: Any, **kwargs: Any):
    """`terms(model, batch, *args, **kwargs)` through its compiled graph."""
    graph = _GRAPHS.get(terms)
    if graph is None:
        graph = _GRAPHS[terms] = torch.compile(terms)
    # read when dynamo traces (the first call of each graph), so it must hold around every call
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        return graph(model, without_full_masks(batch), *args, **kwargs)
