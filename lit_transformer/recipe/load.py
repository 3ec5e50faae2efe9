"""Reading recipes: YAML merged onto the typed schema (schema.py), file by file along the
`extends:` chain, then `key=value` overrides; the result is plain dataclasses, so nothing past
`load_recipe` sees a DictConfig. Every failure is one `RecipeError` whose one-line message
names the file, the full dotted key and the closest valid key.

`load_recipe` also builds the model config, once: the preset, the recipe's overrides and the
vocabulary (model.vocab_size, else the size of tokenizer.path's tokenizer, else
tokenizer.vocab_size, the size a trained tokenizer is capped at). It checks it against the
objective's needs from the registry and writes every field back into the `model` section, so
the section alone determines the model and config.yaml records it whole. A fine-tuning recipe's
model section stays a set of overrides on finetune.from's config (`model_overrides`). A recipe
with `auto` values (recipe/auto_rules.py) is checked here on a stand-in model and completed when the
run starts (run/resolve.py), as is trainer.precision where the recipe leaves it null (the
objective's default depends on the machine, which this layer does not ask about).

Every command reads recipes here: pretrain, finetune, prepare and info alike. Nothing here
imports torch or Lightning.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf import errors as oc_errors

from lit_transformer.errors import DataError, RecipeError, closest, first_line
from lit_transformer.model.config import ConfigError
from lit_transformer.recipe import auto_rules, registry, tasks
from lit_transformer.recipe.catalog import resolve_recipe
from lit_transformer.recipe.entries import build_entry, list_entries, literal_of
from lit_transformer.recipe.eval_schema import EvalConfig, eval_entries
from lit_transformer.recipe.model_section import check_fits, complete_model, stand_in_model
from lit_transformer.recipe.schema import (
    ALIASES,
    FinetuneConfig,
    LoggerConfig,
    ModelSection,
    ObjectiveConfig,
    OptimConfig,
    RunConfig,
    RunSection,
    SampleGenerationConfig,
    TaskConfig,
    TrainerConfig,
    WandbConfig,
    all_keys,
    field_type,
    is_list_type,
    rename,
    sections,
    to_internal,
    to_public,
)

__all__ = [  # the schema's sections are re-exported: `from lit_transformer.recipe.load import RunConfig`
    "FinetuneConfig",
    "SampleGenerationConfig",
    "LoggerConfig",
    "ModelSection",
    "ObjectiveConfig",
    "OptimConfig",
    "RecipeError",
    "RunConfig",
    "RunSection",
    "TrainerConfig",
    "WandbConfig",
    "all_keys",
    "load_recipe",
    "load_suite",
    "save_config",
    "to_dict",
    "to_yaml",
]


def load_recipe(path: str | os.PathLike, overrides: typing.Sequence[str] = ()) -> RunConfig:
    """Read a recipe (following `extends:`), apply `key=value` overrides, validate, build the
    model config, and return plain dataclasses. Every problem is a RecipeError naming the file
    and the key. `path` may also be a shipped recipe's name (recipe/catalog.py)."""
    path = resolve_recipe(path)
    merged = OmegaConf.structured(RunConfig)
    for source, tree in _chain(path, []):
        merged = _merge(merged, tree, source)
    if overrides:
        merged = _merge(merged, _parse_overrides(overrides), "command line")
    _name_the_mixture(merged, str(path))
    try:
        cfg: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except oc_errors.OmegaConfBaseException as error:
        raise _translate(error, str(path)) from None
    except (DataError, ConfigError, RecipeError) as error:  # the sections' own __post_init__ checks
        raise RecipeError(f"{path}: {first_line(error)}") from None
    try:
        registry.spec(cfg.objective.name)  # an unknown objective, named with the file
    except RecipeError as error:
        raise RecipeError(f"{path}: {error}") from None
    if cfg.run.dir is None:
        cfg.run.dir = str(Path("runs") / path.stem)
    for token in tasks.mode_tokens(cfg):  # the tokenizer gets the mixture's mode tokens as special tokens
        if token not in cfg.tokenizer.extra_special_tokens:
            cfg.tokenizer.extra_special_tokens.append(token)
    auto_rules.check(cfg, str(path))
    if cfg.finetune.from_ is not None:
        return cfg
    if auto_rules.auto_keys(cfg):  # resolved when the run starts (run/resolve.py): checked now on a stand-in
        check_fits(cfg, stand_in_model(cfg, str(path)), str(path))
        return cfg
    return complete_model(cfg, str(path))


# ----------------------------------------------------------------------------- reading


def _chain(path: Path, seen: list[Path]) -> list[tuple[str, dict]]:
    """[(file, tree)] from the farthest ancestor to `path` itself."""
    resolved = path.resolve()
    if resolved in seen:
        cycle = " -> ".join(str(p) for p in [*seen, resolved])
        raise RecipeError(f"{path}: extends cycle: {cycle}")
    if not path.is_file():
        where = f"{seen[-1]}: extends " if seen else ""
        raise RecipeError(f"{where}{path}: no such recipe file")
    tree = read_yaml(path)
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
    chain.append((str(path), _listify(rename(tree, ALIASES))))
    return chain


def read_yaml(path: Path) -> Any:
    """A YAML file's tree; malformed YAML or a key given twice is one line naming the file and place."""
    try:
        return yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise RecipeError(f"{path}:{at}: malformed YAML: {problem}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, except that a key given twice in one mapping is an error (PyYAML keeps the
    last silently, which would drop half of a section written twice)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _listify(tree: Any, path: tuple[str, ...] = ()) -> Any:
    """A single value where the schema wants a list becomes a list of one:
    `data.train_files=corpus.txt` means [corpus.txt]."""
    if isinstance(tree, dict):
        return {k: _listify(v, (*path, k)) if isinstance(k, str) else v for k, v in tree.items()}
    if path and tree is not None and not isinstance(tree, (list, dict)) and is_list_type(field_type(list(path))):
        return [tree]
    return tree


def _parse_overrides(overrides: typing.Sequence[str]) -> Any:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise RecipeError(f"command line: override {item!r} is not key=value")
    fixed = [to_internal(k) + "=" + v for k, v in (item.split("=", 1) for item in overrides)]
    try:
        tree = OmegaConf.to_container(OmegaConf.from_dotlist(fixed))
    except Exception as error:  # OmegaConf's own errors, and its grammar's parse errors
        raise RecipeError(f"command line: cannot parse overrides {list(overrides)}: {first_line(error)}") from None
    return _listify(tree)


def _name_the_mixture(merged: Any, source: str) -> None:
    """A recipe that lists tasks trains the registry's mixture objective; naming another
    objective beside the tasks is an error (which one would it train?)."""
    if not merged.tasks:
        return
    if OmegaConf.is_missing(merged.objective, "name"):
        merged.objective.name = registry.MIXTURE
    elif merged.objective.name != registry.MIXTURE:
        raise RecipeError(
            f"{source}: objective.name={merged.objective.name} and tasks are both set: a recipe names "
            "one objective or lists tasks (a mixture of one task is the same run)"
        )


def _check_tasks(tree: Any, source: str) -> None:
    """Each entry of a `tasks:` list against TaskConfig, so that an error names the task (OmegaConf
    reports a key inside a list without its index)."""
    if not isinstance(tree, dict) or "tasks" not in tree:
        return
    keys = [k.split(".", 1)[1] for k in all_keys(TaskConfig, "task.")]
    example, what = "[{name: clm, objective: clm}]", "a task is a mapping with name and objective"
    for where, entry in list_entries(tree["tasks"], source, "tasks", example, what):
        build_entry(
            TaskConfig, entry, source, where, keys, public=to_public, checks=(DataError, ConfigError, RecipeError)
        )


def _check_eval(tree: Any, source: str) -> None:
    """Each entry of an `eval:` list, as _check_tasks checks tasks (recipe/eval_schema.py)."""
    if isinstance(tree, dict) and "eval" in tree:
        eval_entries(tree["eval"], source)


def load_suite(path: str | os.PathLike) -> list[EvalConfig]:
    """The evaluations of a suite file (`evaluate --suite FILE`): a YAML file with a top-level
    `eval:` list, as a recipe's, or a bare list; checked as a recipe's eval section is."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: no such suite file")
    tree = read_yaml(path)
    if isinstance(tree, dict):
        unknown = [k for k in tree if k != "eval"]
        if unknown:
            raise RecipeError(
                f"{path}: unknown key {unknown[0]}{closest(unknown[0], ['eval'])}: a suite file holds one `eval:` list"
            )
        tree = tree.get("eval")
    elif not isinstance(tree, list):
        raise RecipeError(f"{path}: a suite file is an `eval:` list (or a bare list of evaluations)")
    entries = eval_entries(tree, str(path))
    if not entries:
        raise RecipeError(f"{path}: the suite lists no evaluation")
    return entries


def _merge(base: Any, tree: Any, source: str) -> Any:
    _check_tasks(tree, source)
    _check_eval(tree, source)
    try:
        # unsafe_merge merges into `base` in place, where merge deep-copies it first (about 2/3 of
        # reading a recipe): load_recipe's base is its own and is replaced by the result
        return OmegaConf.unsafe_merge(base, tree)
    except oc_errors.OmegaConfBaseException as error:
        raise _translate(error, source) from None


def suggest(full_key: str) -> str:
    """' (did you mean `x`?)': the same name in another section, else the closest sibling."""
    public = to_public(full_key)
    parts = public.split(".")
    keys = all_keys()
    same_leaf = [k for k in keys if k.split(".")[-1] == parts[-1] and k != public]
    if same_leaf:
        return f" (did you mean `{same_leaf[0]}`?)"
    parent = ".".join(parts[:-1])
    siblings = [k for k in keys + sections() if k.rsplit(".", 1)[0] == parent or ("." not in k and not parent)]
    names = [k.split(".")[-1] if parent else k.split(".")[0] for k in siblings]
    match = difflib.get_close_matches(parts[-1], names, n=1, cutoff=0.5)
    if not match:
        match = difflib.get_close_matches(public, keys, n=1, cutoff=0.6)
        return f" (did you mean `{match[0]}`?)" if match else ""
    return f" (did you mean `{parent + '.' if parent else ''}{match[0]}`?)"


def _translate(error: oc_errors.OmegaConfBaseException, source: str) -> RecipeError:
    key = getattr(error, "full_key", None) or ""
    public = to_public(key)
    if isinstance(error, oc_errors.ConfigKeyError):
        return RecipeError(f"{source}: unknown key {public}{suggest(key)}")
    if isinstance(error, oc_errors.MissingMandatoryValue):
        return RecipeError(f"{source}: missing value for {public}")
    message = first_line(error)
    if "is not a ListConfig" in message:
        message = "expected a list, e.g. [a, b]"
    if "Did you mean" in message:
        message = message.split(" Did you mean")[0]
    hint = ""
    if key:
        allowed = typing.get_args(literal_of(field_type(key.split("."))))
        value = getattr(error, "value", None) if hasattr(error, "value") else None
        if allowed and value is not None:
            match = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1, cutoff=0.5)
            hint = f" (did you mean `{match[0]}`?)" if match else ""
    return RecipeError(f"{source}: {public}: {message}{hint}" if public else f"{source}: {message}")


# ----------------------------------------------------------------------------- saving


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain nested dict with public key names (`finetune.from`), as written to config.yaml."""
    tree = rename(dataclasses.asdict(cfg), {v: k for k, v in ALIASES.items()})
    tree["model"] = {k: v for k, v in tree["model"].items() if v is not None}  # unset overrides
    return tree


def to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def save_config(cfg: RunConfig, path: str | os.PathLike) -> None:
    Path(path).write_text(to_yaml(cfg))
