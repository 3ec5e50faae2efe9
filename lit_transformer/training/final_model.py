"""A finished run's model on disk: lit-transformer's format (config.json records the objective),
the task head beside it, the final metrics; and the whole weights of a sharded (FSDP2) run
gathered for saving. Serves the end of training (finish.py) and checkpoint averaging.

The module is the objective LightningModule, taken by what it offers (final_model,
final_head, objective_name, from_hparams): this layer imports no objective.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lit_transformer.model.interop.directories import save_pretrained
from lit_transformer.training.distributed import full_state_dict, is_sharded
from lit_transformer.training.rundir import CLASSIFIER_JSON, CLASSIFIER_WEIGHTS, LABELS_JSON, METRICS_JSON


def consolidated(module, rank: int):
    """The objective with whole (unsharded) CPU weights, for saving the final model. Without
    FSDP this is the module itself. Under FSDP2 every rank must call it (the shards are
    all-gathered); rank 0 gets a fresh copy rebuilt from the module's hyperparameters and
    loaded with the gathered weights, the other ranks None."""
    if not is_sharded(module):
        return module
    state = full_state_dict(module)
    if rank != 0:
        return None
    with torch.device("cpu"):
        copy = type(module).from_hparams(dict(module.hparams))
    copy.load_state_dict(state)
    return copy


def save_final(module, run_dir: Path, metrics: dict[str, float] | None = None) -> None:
    """The final model in lit-transformer's format (config.json records the objective), the
    task head beside it when the objective has one, and the final validation metrics."""
    from safetensors.torch import save_file

    save_pretrained(module.final_model(), run_dir, objective=module.objective_name)
    head = module.final_head()
    if head is not None:
        spec, weights = head
        labels = json.loads((run_dir / LABELS_JSON).read_text()) if (run_dir / LABELS_JSON).is_file() else {}
        save_file(weights, str(run_dir / CLASSIFIER_WEIGHTS))
        (run_dir / CLASSIFIER_JSON).write_text(
            json.dumps({**spec, "label_names": labels.get("labels")}, indent=1) + "\n"
        )
    if metrics is not None:
        (run_dir / METRICS_JSON).write_text(json.dumps(metrics, indent=1, sort_keys=True) + "\n")
