"""The run schema: one typed dataclass per recipe section, read with OmegaConf.

A recipe is YAML merged onto `RunConfig` (OmegaConf.structured), file by file along its
`extends:` chain, then `key=value` overrides; the result is converted to plain dataclasses
(`OmegaConf.to_object`) so nothing past `load_recipe` sees a DictConfig. Every failure is one
`RecipeError` whose one-line message names the file, the full dotted key and the closest
valid key.

The model section is generated from `TransformerConfig`'s fields (each an optional override of
the preset), so a new core field is a new recipe key without touching this file.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf import errors as oc_errors

from .data.config import DataConfig, TokenizerConfig
from .data.errors import DataError
from .model.config import ConfigError, TransformerConfig, preset
from .objectives.optim import OptimConfig

ObjectiveName = Literal["mlm", "clm", "span", "seq2seq", "classify"]
Strategy = Literal["auto", "ddp", "fsdp"]
Accelerator = Literal["auto", "cpu", "gpu", "cuda", "mps"]
Precision = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed"]
WandbMode = Literal["offline", "online", "disabled"]
Pooling = Literal["first", "mean", "last"]


class RecipeError(ValueError):
    """A recipe cannot be read: the one-line message names the file and the key."""


# ----------------------------------------------------------------------------- sections

_MODEL_HINTS = typing.get_type_hints(TransformerConfig)
ModelSection = dataclasses.make_dataclass(
    "ModelSection",
    [("preset", Optional[str], field(default=None))]
    + [(f.name, Optional[_MODEL_HINTS[f.name]], field(default=None)) for f in dataclasses.fields(TransformerConfig)],
)
ModelSection.__doc__ = (
    "`preset` (a name from lit_transformer.PRESETS) plus any TransformerConfig field as an override; "
    "None keeps the preset's value. vocab_size defaults to the tokenizer's."
)


@dataclass
class ObjectiveConfig:
    name: ObjectiveName = MISSING
    bleu: bool = True  # seq2seq: decode some validation batches and report corpus BLEU (sacrebleu)
    bleu_batches: int = 2  # validation batches decoded for BLEU


@dataclass
class TrainerConfig:
    max_steps: int = 1000  # optimizer steps
    devices: Any = 1  # int or "auto"; Lightning's `devices`, per node (data.batch_size is per device)
    num_nodes: int = 1
    accelerator: Accelerator = "auto"
    # ddp: a replica per device; fsdp: FSDP2 via ModelParallelStrategy (sharded weights, gradients
    # and AdamW state, meta-device init, sharded checkpoints); both also run on CPU with gloo
    strategy: Strategy = "auto"
    # None: bf16-mixed for span corruption (T5 activations overflow float16's range: Raffel et
    # al. 2020 trained in bfloat16, and fp16 T5 gives inf/NaN), 32-true otherwise
    precision: Optional[Precision] = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = 1.0
    val_check_interval: int = 200  # optimizer steps between validations
    limit_val_batches: Optional[int] = None  # None: the whole validation split
    log_every_n_steps: int = 10
    checkpoint_every_n_steps: int = 500
    seed: int = 0
    deterministic: bool = False
    # torch's CPU threads (None: its default, one per core). Tiny models gain little from a
    # second thread and lose several times over when other processes share the cores.
    num_threads: Optional[int] = None
    compile: bool = False  # torch.compile each Transformer block (inductor; needs a C++ compiler on CPU)
    activation_checkpointing: bool = False  # recompute each block in backward: memory for ~1 more forward
    # stop after this many optimizer steps in a row were skipped for a non-finite loss or gradient
    nonfinite_patience: int = 10


@dataclass
class WandbConfig:
    mode: WandbMode = "offline"  # online falls back to offline without an API key
    project: str = "lit-transformer"
    name: Optional[str] = None  # None: the run directory's name
    entity: Optional[str] = None
    tags: list[str] = field(default_factory=list)


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    csv: bool = True


@dataclass
class RunSection:
    dir: Optional[str] = None  # None: runs/<recipe file name without .yaml>
    overwrite: bool = False


@dataclass
class FinetuneConfig:
    # `from` in YAML and on the command line (a Python keyword, hence the trailing underscore here):
    # a run directory, a Lightning checkpoint, a transformers directory, or `minilm`.
    from_: Optional[str] = None
    pooling: Optional[Pooling] = None  # None: first for encoders, last for decoders, mean for encoder-decoders
    backbone_lr_ratio: float = 1.0  # backbone lr = optim.lr * ratio; the head gets optim.lr
    head_dropout: float = 0.1


@dataclass
class GenerationConfig:
    """Sample generations logged as a W&B table at every validation (clm, span, seq2seq)."""

    enabled: bool = True
    prompts: list[str] = field(default_factory=list)  # empty: the first few validation texts
    num_prompts: int = 3
    prompt_tokens: int = 16  # prompts taken from validation data are cut to this many tokens
    max_new_tokens: int = 24
    do_sample: bool = False
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)  # type: ignore[valid-type]
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    run: RunSection = field(default_factory=RunSection)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    resume: Optional[str] = None  # null | auto | path to a Lightning checkpoint


# ----------------------------------------------------------------------------- key names
# `finetune.from` is spelled `from_` in the dataclass; these translate at the YAML boundary.

_ALIASES = {"from": "from_"}


def _to_internal(key: str) -> str:
    return ".".join(_ALIASES.get(part, part) for part in key.split("."))


def _to_public(key: str) -> str:
    back = {v: k for k, v in _ALIASES.items()}
    return ".".join(back.get(part, part) for part in key.split("."))


def _rename(tree: Any, mapping: dict[str, str]) -> Any:
    if isinstance(tree, dict):
        return {mapping.get(k, k) if isinstance(k, str) else k: _rename(v, mapping) for k, v in tree.items()}
    return tree


def _section_type(path: list[str]) -> type | None:
    """The dataclass at a dotted path of RunConfig, or None when the path leaves the schema."""
    cls: Any = RunConfig
    for part in path:
        if not dataclasses.is_dataclass(cls):
            return None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        cls = hints[part]
    return cls if dataclasses.is_dataclass(cls) else None


def all_keys(cls: Any = RunConfig, prefix: str = "") -> list[str]:
    """Every leaf key of the schema as a public dotted path (`trainer.max_steps`, `finetune.from`)."""
    keys = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        path = f"{prefix}{_to_public(f.name)}"
        keys.extend(all_keys(hint, path + ".") if dataclasses.is_dataclass(hint) else [path])
    return keys


def suggest(full_key: str) -> str:
    """' (did you mean `x`?)': the same name in another section, else the closest sibling."""
    public = _to_public(full_key)
    parts = public.split(".")
    keys = all_keys()
    same_leaf = [k for k in keys if k.split(".")[-1] == parts[-1] and k != public]
    if same_leaf:
        return f" (did you mean `{same_leaf[0]}`?)"
    parent = ".".join(parts[:-1])
    siblings = [k for k in keys + _sections() if k.rsplit(".", 1)[0] == parent or ("." not in k and not parent)]
    names = [k.split(".")[-1] if parent else k.split(".")[0] for k in siblings]
    match = difflib.get_close_matches(parts[-1], names, n=1, cutoff=0.5)
    if not match:
        match = difflib.get_close_matches(public, keys, n=1, cutoff=0.6)
        return f" (did you mean `{match[0]}`?)" if match else ""
    return f" (did you mean `{parent + '.' if parent else ''}{match[0]}`?)"


def _sections() -> list[str]:
    return [_to_public(f.name) for f in dataclasses.fields(RunConfig)]


# ----------------------------------------------------------------------------- loading


def load_recipe(path: str | os.PathLike, overrides: typing.Sequence[str] = ()) -> RunConfig:
    """Read a recipe (following `extends:`), apply `key=value` overrides, validate, and return
    plain dataclasses. Every problem is a RecipeError naming the file and the key."""
    path = Path(path)
    merged = OmegaConf.structured(RunConfig)
    for source, tree in _chain(path, []):
        merged = _merge(merged, tree, source)
    if overrides:
        merged = _merge(merged, _parse_overrides(overrides), "command line")
    try:
        check_ranges(merged, str(path))  # before the sections' own checks, which name keys less precisely
    except oc_errors.OmegaConfBaseException:
        pass  # a missing value: to_object names it below
    try:
        cfg: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except oc_errors.OmegaConfBaseException as error:
        raise _translate(error, str(path)) from None
    except (DataError, ConfigError) as error:  # the sections' own __post_init__ checks
        raise RecipeError(f"{path}: {_first_line(error)}") from None
    if cfg.run.dir is None:
        cfg.run.dir = str(Path("runs") / path.stem)
    if cfg.trainer.precision is None:
        cfg.trainer.precision = "bf16-mixed" if cfg.objective.name == "span" else "32-true"
    validate(cfg, str(path))
    return cfg


def _chain(path: Path, seen: list[Path]) -> list[tuple[str, dict]]:
    """[(file, tree)] from the farthest ancestor to `path` itself."""
    resolved = path.resolve()
    if resolved in seen:
        cycle = " -> ".join(str(p) for p in [*seen, resolved])
        raise RecipeError(f"{path}: extends cycle: {cycle}")
    if not path.is_file():
        where = f"{seen[-1]}: extends " if seen else ""
        raise RecipeError(f"{where}{path}: no such recipe file")
    try:
        tree = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise RecipeError(f"{path}:{at}: malformed YAML: {problem}") from None
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of sections, got {type(tree).__name__}")
    parents = tree.pop("extends", None)
    if parents is None:
        parents = []
    elif isinstance(parents, str):
        parents = [parents]
    elif not (isinstance(parents, list) and all(isinstance(p, str) for p in parents)):
        raise RecipeError(f"{path}: extends must be a file name or a list of file names")
    chain: list[tuple[str, dict]] = []
    for parent in parents:
        chain.extend(_chain(path.parent / parent, [*seen, resolved]))
    chain.append((str(path), _rename(tree, _ALIASES)))
    return chain


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, except that a key given twice in one mapping is an error (PyYAML keeps the
    last silently, which would drop half of a section written twice)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _parse_overrides(overrides: typing.Sequence[str]) -> Any:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise RecipeError(f"command line: override {item!r} is not key=value")
    fixed = [_to_internal(k) + "=" + v for k, v in (item.split("=", 1) for item in overrides)]
    try:
        return OmegaConf.from_dotlist(fixed)
    except oc_errors.OmegaConfBaseException as error:
        raise RecipeError(f"command line: cannot parse overrides {list(overrides)}: {_first_line(error)}") from None
    except Exception as error:  # the grammar's parse errors are not OmegaConf exceptions
        raise RecipeError(f"command line: cannot parse overrides {list(overrides)}: {_first_line(error)}") from None


def _merge(base: Any, tree: Any, source: str) -> Any:
    try:
        return OmegaConf.merge(base, tree)
    except oc_errors.OmegaConfBaseException as error:
        raise _translate(error, source) from None


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _translate(error: oc_errors.OmegaConfBaseException, source: str) -> RecipeError:
    key = getattr(error, "full_key", None) or ""
    public = _to_public(key)
    if isinstance(error, oc_errors.ConfigKeyError):
        return RecipeError(f"{source}: unknown key {public}{suggest(key)}")
    if isinstance(error, oc_errors.MissingMandatoryValue):
        return RecipeError(f"{source}: missing value for {public}")
    message = _first_line(error)
    if "is not a ListConfig" in message:
        message = "expected a list, e.g. [a, b]"
    if "Did you mean" in message:
        message = message.split(" Did you mean")[0]
    hint = ""
    parent = _section_type(key.split(".")[:-1]) if key else None
    if parent is not None and key:
        leaf = key.split(".")[-1]
        allowed = typing.get_args(_literal(typing.get_type_hints(parent).get(leaf)))
        value = getattr(error, "value", None) if hasattr(error, "value") else None
        if allowed and value is not None:
            match = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1, cutoff=0.5)
            hint = f" (did you mean `{match[0]}`?)" if match else ""
    return RecipeError(f"{source}: {public}: {message}{hint}" if public else f"{source}: {message}")


def _literal(hint: Any) -> Any:
    """The Literal inside Optional[Literal[...]], or the hint itself."""
    if typing.get_origin(hint) is Literal:
        return hint
    for arg in typing.get_args(hint):
        if typing.get_origin(arg) is Literal:
            return arg
    return None


# ----------------------------------------------------------------------------- checks

ARCH_FOR = {"mlm": ("encoder",), "clm": ("decoder",), "span": ("encoder_decoder",),
             "seq2seq": ("encoder_decoder",), "classify": ("encoder", "decoder", "encoder_decoder")}


def check_ranges(cfg: Any, source: str) -> None:
    """Range checks OmegaConf's types cannot express; each failure names the key. Reads by
    attribute only, so it runs on the merged DictConfig as well as on the dataclasses."""

    def need(ok: bool, key: str, value: Any, what: str) -> None:
        if not ok:
            raise RecipeError(f"{source}: {key}={value!r} {what}")

    o, t, f, g = cfg.optim, cfg.trainer, cfg.finetune, cfg.generation
    need(o.lr > 0, "optim.lr", o.lr, "must be positive")
    need(o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "must not be negative")
    for key in ("beta1", "beta2"):
        need(0 <= getattr(o, key) < 1, f"optim.{key}", getattr(o, key), "is outside [0, 1)")
    need(o.eps > 0, "optim.eps", o.eps, "must be positive")
    need(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must not be negative")
    need(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", o.min_lr_ratio, "is outside [0, 1]")
    need(0 <= o.label_smoothing < 1, "optim.label_smoothing", o.label_smoothing, "is outside [0, 1)")
    for key in ("max_steps", "accumulate_grad_batches", "val_check_interval",
                "log_every_n_steps", "checkpoint_every_n_steps", "num_nodes", "nonfinite_patience"):
        need(getattr(t, key) > 0, f"trainer.{key}", getattr(t, key), "must be a positive integer")
    need(t.devices == "auto" or (isinstance(t.devices, int) and not isinstance(t.devices, bool) and t.devices > 0),
         "trainer.devices", t.devices, "must be a positive integer or 'auto'")
    need(t.gradient_clip_val is None or t.gradient_clip_val > 0, "trainer.gradient_clip_val",
         t.gradient_clip_val, "must be positive or null")
    need(t.num_threads is None or t.num_threads > 0, "trainer.num_threads", t.num_threads, "must be positive or null")
    need(t.limit_val_batches is None or t.limit_val_batches > 0, "trainer.limit_val_batches",
         t.limit_val_batches, "must be positive or null")
    need(f.backbone_lr_ratio > 0, "finetune.backbone_lr_ratio", f.backbone_lr_ratio, "must be positive")
    need(0 <= f.head_dropout < 1, "finetune.head_dropout", f.head_dropout, "is outside [0, 1)")
    need(g.temperature > 0, "generation.temperature", g.temperature, "must be positive")
    need(g.top_k is None or g.top_k > 0, "generation.top_k", g.top_k, "must be positive or null")
    need(g.top_p is None or 0 < g.top_p <= 1, "generation.top_p", g.top_p, "is outside (0, 1]")
    need(g.max_new_tokens > 0, "generation.max_new_tokens", g.max_new_tokens, "must be positive")
    need(cfg.objective.bleu_batches > 0, "objective.bleu_batches", cfg.objective.bleu_batches, "must be positive")
    need(g.num_prompts >= 0, "generation.num_prompts", g.num_prompts, "must not be negative")
    for key in ("dropout", "attention_dropout"):
        value = getattr(cfg.model, key)
        need(value is None or 0 <= value < 1, f"model.{key}", value, "is outside [0, 1)")


def validate(cfg: RunConfig, source: str) -> None:
    """Every check of a loaded recipe: ranges, the model config, objective against architecture."""
    check_ranges(cfg, source)
    f = cfg.finetune
    if f.from_ is None:
        model = model_config(cfg, source=source)
        allowed = ARCH_FOR[cfg.objective.name]
        if model.arch not in allowed:
            raise RecipeError(
                f"{source}: objective.name={cfg.objective.name} needs model.arch in {list(allowed)}, got {model.arch!r}"
            )
        length_key, length = data_length(cfg)
        if model.position == "learned" and length > model.max_seq_len:  # at startup, not at the first batch
            raise RecipeError(f"{source}: {length_key}={length} exceeds model.max_seq_len={model.max_seq_len}, "
                              f"the size of the learned position table")


def data_length(cfg: RunConfig) -> tuple[str, int]:
    """(key, value) of the longest sequence the objective feeds the model."""
    d, name = cfg.data, cfg.objective.name
    if name == "classify":
        return "data.max_length", d.max_length
    if name == "seq2seq":
        return max(("data.max_length", d.max_length), ("data.max_target_length", d.max_target_length),
                   key=lambda item: item[1])
    return "data.block_size", d.block_size


def model_overrides(cfg: RunConfig) -> dict[str, Any]:
    """The model fields the recipe sets explicitly (None means: keep the preset's or source's value)."""
    return {k: v for k, v in dataclasses.asdict(cfg.model).items() if k != "preset" and v is not None}


def model_config(cfg: RunConfig, vocab_size: int | None = None, source: str = "recipe") -> TransformerConfig:
    """preset + overrides -> TransformerConfig. vocab_size (the trained or loaded tokenizer's)
    fills model.vocab_size when the recipe leaves it unset; before the tokenizer exists,
    tokenizer.vocab_size stands in. Core ConfigErrors become RecipeErrors."""
    values = model_overrides(cfg)
    if "vocab_size" not in values:
        values["vocab_size"] = vocab_size or cfg.tokenizer.vocab_size
    try:
        if cfg.model.preset is not None:
            return preset(cfg.model.preset, **values)
        missing = [f.name for f in dataclasses.fields(TransformerConfig)
                   if f.default is dataclasses.MISSING and f.name not in values]
        if missing:
            raise RecipeError(
                f"{source}: missing value for model.{missing[0]} (set model.preset, or all of "
                f"{', '.join('model.' + m for m in missing)})"
            )
        return TransformerConfig(**values)
    except ConfigError as error:
        raise RecipeError(f"{source}: {error}") from None


# ----------------------------------------------------------------------------- saving


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain nested dict with public key names (`finetune.from`), as written to config.yaml."""
    tree = _rename(dataclasses.asdict(cfg), {v: k for k, v in _ALIASES.items()})
    tree["model"] = {k: v for k, v in tree["model"].items() if v is not None}  # unset overrides
    return tree


def to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def save_config(cfg: RunConfig, path: str | os.PathLike) -> None:
    Path(path).write_text(to_yaml(cfg))
