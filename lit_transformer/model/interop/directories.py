"""Model directories in and out of the core.

- `load_pretrained(dir)`: a transformers checkpoint directory (BERT, GPT-2, T5, LLaMA; config.json
  plus model.safetensors, sharded safetensors or pytorch_model.bin) or a lit-transformer model
  directory, as a LanguageModel.
- `save_pretrained(model, dir)`: lit-transformer's own format: config.json holding
  {"lit_transformer": 1, "model": TransformerConfig dict} and model.safetensors with the core's
  parameter names, each tied tensor stored once under its first name.
- `export_hf(model, dir)`: a directory transformers' `from_pretrained` loads with the same logits.

transformers is never imported: config.json and tensors are read and written directly, with
safetensors, or with `torch.load(weights_only=True)` for .bin files, which cannot run code.
Loading is strict: every core parameter must be filled and every checkpoint tensor used or
on its family's list of knowingly ignored names (import_maps.py); otherwise the error names
the keys. A directory is written next to its destination and renamed into place, so an
interrupted save never leaves half a directory.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from lit_transformer.model.config import TransformerConfig
from lit_transformer.model.init import init_weights
from lit_transformer.model.interop.import_maps import FAMILIES, family_for_export
from lit_transformer.model.interop.rules import Family, InteropError, to_core, to_hf
from lit_transformer.model.language_model import LanguageModel

__all__ = ["InteropError", "export_hf", "load_pretrained", "save_pretrained"]

NATIVE_FORMAT = 1  # the "lit_transformer" key of our config.json; bump when the layout changes
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- loading
def load_pretrained(
    path: str | os.PathLike,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    head_seed: int = 0,
) -> LanguageModel:
    """A LanguageModel from a transformers or lit-transformer directory, in eval mode.

    A checkpoint without its LM head (BertModel, GPT2Model, ...) gets an `init_weights` head
    drawn under `head_seed` (tied to the embeddings when the config ties them); a warning says so.
    Tensors that are not part of a language model (BERT's pooler and next-sentence head, old
    mask buffers) are dropped by name, and logged at INFO level.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not path.is_dir():
        raise InteropError(f"{path}: no such model directory")
    if not config_file.is_file():
        raise InteropError(f"{config_file}: missing; a model directory needs config.json")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise InteropError(f"{config_file}: not valid JSON ({error})") from None
    if not isinstance(raw, dict):
        raise InteropError(f"{config_file}: expected a JSON object, got {type(raw).__name__}")
    if "lit_transformer" in raw:
        model = _load_native(path, raw)
    else:
        model = _load_transformers(path, raw, _family(raw, config_file), head_seed)
    return model.to(device=device or "cpu", dtype=dtype).eval()


def _load_native(path: Path, raw: dict[str, Any]) -> LanguageModel:
    if raw["lit_transformer"] != NATIVE_FORMAT:
        raise InteropError(
            f"{path / 'config.json'}: lit_transformer format {raw['lit_transformer']!r}; "
            f"this version reads format {NATIVE_FORMAT}"
        )
    if not isinstance(raw.get("model"), dict):
        raise InteropError(f"{path / 'config.json'}: a lit_transformer config needs the model config under 'model'")
    cfg = TransformerConfig.from_dict(raw["model"], where=f"{path / 'config.json'}: model")
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise InteropError(f"{weights}: missing; a lit-transformer model directory needs model.safetensors")
    model = LanguageModel(cfg)
    _fill(model, read_safetensors(weights), str(weights))
    return model


def _family(raw: dict[str, Any], config_file: Path) -> Family:
    architectures = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if model_type is None:  # very old configs name only the class
        model_type = next(
            (f.model_type for f in FAMILIES.values() for a in architectures if a in f.architectures), None
        )
    if model_type not in FAMILIES:
        raise InteropError(
            f"{config_file}: unsupported model_type {model_type!r}; supported: "
            f"{', '.join(FAMILIES)} (or a lit-transformer model directory)"
        )
    family = FAMILIES[model_type]
    for name in architectures:
        if name not in family.architectures:
            raise InteropError(
                f"{config_file}: unsupported architecture {name!r}; supported for "
                f"{model_type}: {', '.join(family.architectures)}"
            )
    return family


def read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """load_file, with a truncated or corrupted file as one InteropError naming it."""
    try:
        return load_file(file)
    except Exception as error:  # safetensors raises its own SafetensorError (or OSError) with a long text
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise InteropError(f"{file}: not a readable safetensors file ({first})") from None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    found = next((path / name for name in WEIGHT_FILES if (path / name).is_file()), None)
    if found is None:
        raise InteropError(f"{path}: no weights found (looked for {', '.join(WEIGHT_FILES)})")
    files = [found]
    if found.name.endswith(".index.json"):  # sharded: {"weight_map": {tensor name: shard file}}
        files = [path / shard for shard in sorted(set(json.loads(found.read_text())["weight_map"].values()))]
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise InteropError(f"{file}: missing (a shard listed in {found})")
        if file.suffix == ".safetensors":
            tensors.update(read_safetensors(file))
            continue
        try:
            loaded = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as error:  # refused pickled code, or a truncated / corrupted file
            blocked = re.search(r"GLOBAL (\S+)", str(error))
            raise InteropError(
                f"{file}: refused: it pickles {blocked.group(1)}, not only tensors; weights load "
                "with weights_only=True, so it did not run"
                if blocked
                else f"{file}: not a readable PyTorch weights file ({type(error).__name__})"
            ) from None
        if not isinstance(loaded, dict) or not all(isinstance(t, torch.Tensor) for t in loaded.values()):
            raise InteropError(f"{file}: not a state dict of tensors")
        tensors.update(loaded)
    return tensors


def _load_transformers(path: Path, raw: dict[str, Any], family: Family, head_seed: int) -> LanguageModel:
    tensors = _read_tensors(path)
    if family.prefix and not any(name.startswith(family.prefix) for name in tensors):
        tensors = {family.prefix + name: t for name, t in tensors.items()}  # a bare base-model checkpoint
    architectures = raw.get("architectures") or []
    head = (
        family.architectures[architectures[0]]
        if architectures
        else any(name.startswith(family.head_prefixes) for name in tensors)
    )
    cfg = family.config_from_hf(raw, head)
    if (
        cfg.tie_embeddings
        and family.embedding in tensors
        and family.head_weight in tensors
        and not torch.equal(tensors[family.embedding], tensors[family.head_weight])
    ):
        # As transformers does: a config that says tied but a checkpoint holding two different
        # matrices means untied (transformers 5 writes tie_word_embeddings=true for every T5).
        cfg = cfg.replace(tie_embeddings=False)

    core: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}  # core name -> the checkpoint name it came from, for messages
    missing, used = [], set()
    for rule in family.rules(cfg, head):
        if rule.kind == "zeros":
            continue
        present = [name for name in rule.hf if name in tensors]
        if not present:
            missing.append(rule.hf[0])
            continue
        used.update(present)
        for name, tensor in zip(rule.core, to_core(rule, tensors[present[0]])):
            core[name], source[name] = tensor, present[0]
    unexpected = [name for name in tensors if name not in used and not family.is_ignored(name)]
    if missing or unexpected:
        raise InteropError(
            f"{path}: the checkpoint does not match the transformers {family.name} layout its "
            f"config.json describes: {_listing(missing, unexpected)}"
        )
    ignored = [name for name in tensors if name not in used]
    if ignored:
        log.info("%s: ignored %d tensors (%s): %s", path, len(ignored), family.ignored_note, _names(ignored))

    model = LanguageModel(cfg)
    if not head:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(head_seed)
            init_weights(model.lm_head, cfg)
        what = architectures[0] if architectures else "the checkpoint"
        log.warning(
            "%s: %s has no LM head; lm_head is initialised by init_weights under seed %d%s",
            path,
            what,
            head_seed,
            " (its decoder tied to the embeddings)" if cfg.tie_embeddings else "",
        )
    _fill(model, core, str(path), source=source, optional_prefix=None if head else "lm_head.")
    return model


def _parameter_groups(model: torch.nn.Module) -> dict[str, list[str]]:
    """First name -> every state-dict name of one tensor (tied weights appear under several)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return {names[0]: names for names in groups.values()}


@torch.no_grad()
def _fill(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    where: str,
    *,
    source: dict[str, str] | None = None,
    optional_prefix: str | None = None,
) -> None:
    """Copy `tensors` (core names, any alias of a tied group) into the model, strictly. Groups
    whose names all start with `optional_prefix` may be absent (they keep their init)."""
    source = source or {}
    groups = _parameter_groups(model)
    group_of = {name: first for first, names in groups.items() for name in names}
    unexpected = [name for name in tensors if name not in group_of]
    chosen: dict[str, str] = {}
    for name in tensors:
        if name not in group_of:
            continue
        first = group_of[name]
        if first in chosen:
            if not torch.equal(tensors[chosen[first]], tensors[name]):
                raise InteropError(
                    f"{where}: {chosen[first]} and {name} are one tied tensor in this config, "
                    "but the checkpoint holds different values"
                )
            continue
        chosen[first] = name
    missing = [
        first
        for first, names in groups.items()
        if first not in chosen and not (optional_prefix and all(n.startswith(optional_prefix) for n in names))
    ]
    if missing or unexpected:
        raise InteropError(f"{where}: the weights do not match the model config: {_listing(missing, unexpected)}")
    state = model.state_dict(keep_vars=True)
    for first, name in chosen.items():
        target, tensor = state[first], tensors[name]
        if tuple(target.shape) != tuple(tensor.shape):
            raise InteropError(
                f"{where}: {source.get(name, name)} has shape {tuple(tensor.shape)}; "
                f"the config makes {first} {tuple(target.shape)}"
            )
        target.copy_(tensor)


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _listing(missing: list[str], unexpected: list[str]) -> str:
    parts = []
    if missing:
        parts.append(f"missing {len(missing)}: {_names(missing)}")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)}: {_names(unexpected)}")
    return "; ".join(parts)


# ----------------------------------------------------------------------------- saving
def _check_model(model: Any) -> LanguageModel:
    if not isinstance(model, LanguageModel):
        raise InteropError(f"expected a LanguageModel, got {type(model).__name__}")
    return model


def save_pretrained(model: LanguageModel, out_dir: str | os.PathLike, *, objective: str | None = None) -> Path:
    """Write lit-transformer's model directory (config.json + model.safetensors); returns its path.
    `objective` (the training objective's registered name) is recorded in config.json under
    "objective" when given; loading ignores it.

    safetensors refuses tensors that share memory, so each tied group is stored once under its
    first state-dict name (e.g. transformer.tokens.weight); loading re-ties through the config.
    """
    _check_model(model)
    state = model.state_dict()
    tensors = {first: state[first].detach().cpu().contiguous() for first in _parameter_groups(model)}
    config = {"lit_transformer": NATIVE_FORMAT, "model": model.config.to_dict()}
    if objective is not None:
        config["objective"] = objective
    return _write_dir(Path(out_dir), config, tensors)


def export_hf(model: LanguageModel, out_dir: str | os.PathLike, *, extra_config: dict[str, Any] | None = None) -> Path:
    """Write a directory that transformers' `from_pretrained` loads as BertForMaskedLM,
    GPT2LMHeadModel, T5ForConditionalGeneration or LlamaForCausalLM, with the same logits.

    `extra_config` adds keys to config.json (token ids such as eos_token_id, pad_token_id,
    decoder_start_token_id, which belong to the tokenizer); it may not change a mapped field.
    A config no transformers family can express raises InteropError naming the field.
    """
    cfg = _check_model(model).config
    family = family_for_export(cfg)
    fields = family.config_to_hf(cfg)
    extra = dict(extra_config or {})
    clash = sorted(key for key in extra if fields.get(key) is not None or key in ("architectures", "model_type"))
    if clash:
        raise InteropError(f"extra_config may not override fields the model config determines: {', '.join(clash)}")
    state = model.state_dict()
    dtype = state["transformer.tokens.weight"].dtype
    tensors, exported = {}, set()
    for rule in family.rules(cfg, True):
        tensor = to_hf(rule, [state[name] for name in rule.core]).detach().to(device="cpu", dtype=dtype)
        tensors.update({name: tensor.clone().contiguous() for name in rule.written})
        exported.update(rule.core)
    groups = _parameter_groups(model)
    left = [first for first, names in groups.items() if not exported.intersection(names)]
    if left:  # a field the family's checks let through but its layout has no place for
        raise InteropError(f"cannot export to transformers {family.name}: no place for {_names(left)}")
    config = {
        "architectures": [family.export_architecture],
        "model_type": family.model_type,
        **fields,
        "dtype": str(dtype).removeprefix("torch."),
        **extra,
    }
    return _write_dir(Path(out_dir), config, tensors)


def _write_dir(out_dir: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """Write config.json and model.safetensors into a fresh sibling directory, then rename it
    into place. Into an existing directory (a run directory holding a tokenizer, say) the two
    files are moved in one by one, weights first, and nothing else there is touched."""
    if out_dir.exists() and not out_dir.is_dir():
        raise InteropError(f"{out_dir}: exists and is not a directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})  # transformers checks "format"
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if out_dir.exists():
            for name in ("model.safetensors", "config.json"):
                os.replace(tmp / name, out_dir / name)
            tmp.rmdir()
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
