"""`lit-transformer recipes`: the shipped recipes, one line each: name, objective, architecture,
model size and the first line of the recipe's header comment.

Each recipe's YAML is read along its `extends:` chain and nothing is built, so the list answers
at once: the sizes are the recipe's own words (a preset, d_model x n_layers, `auto`, or the
model it fine-tunes); `lit-transformer info NAME` counts parameters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lit_transformer.errors import RecipeError
from lit_transformer.model.config import preset
from lit_transformer.recipe.catalog import shipped_recipes
from lit_transformer.recipe.load import read_yaml

COLUMNS = ("name", "objective", "arch", "model", "description")


def list_recipes(as_json: bool = False) -> str:
    """The shipped recipes as an aligned table, or (as_json) a JSON list of objects with the
    table's columns and each recipe's file."""
    rows = [describe(name, path) for name, path in shipped_recipes().items()]
    if as_json:
        return json.dumps(rows)
    widths = [max(len(column), *(len(row[column]) for row in rows)) for column in COLUMNS[:-1]]
    lines = ["  ".join(f"{row[c]:<{w}}" for c, w in zip(COLUMNS, widths)) + "  " + row["description"] for row in rows]
    header = "  ".join(f"{c:<{w}}" for c, w in zip(COLUMNS, widths)) + "  description"
    return "\n".join([header, *lines])


def describe(name: str, path: Path) -> dict[str, str]:
    """One recipe's row, from its YAML (the `extends:` chain merged, later files winning)."""
    tree = _merged(path, ())
    model = tree.get("model") or {}
    objective = (tree.get("objective") or {}).get("name")
    tasks = tree.get("tasks") or []
    if objective is None and tasks:  # a mixture: its tasks' objectives, in order of first use
        objectives = dict.fromkeys(str(task.get("objective")) for task in tasks)
        objective = f"mixture ({', '.join(objectives)})"
    source = (tree.get("finetune") or {}).get("from")
    if source is not None:
        size = f"from {source}"
    elif model.get("preset") is not None:
        size = str(model["preset"])
    elif model.get("size") is not None:
        size = f"size {model['size']}"
    else:
        size = f"d_model {model.get('d_model', '?')} x {model.get('n_layers', '?')} layers"
    return {
        "name": name,
        "objective": str(objective),
        "arch": str(model.get("arch") or (preset(model["preset"]).arch if model.get("preset") else "-")),
        "model": size,
        "description": _header(path),
        "path": str(path),
    }


def _merged(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    """The recipe's tree with its ancestors' underneath, merged section by section as
    recipe/load.py merges them (a list replaces the inherited one)."""
    if path in seen:
        raise RecipeError(f"{path}: extends cycle: {' -> '.join(str(p) for p in [*seen, path])}")
    tree = read_yaml(path) or {}
    parents = tree.pop("extends", None) or []
    merged: dict[str, Any] = {}
    for parent in [parents] if isinstance(parents, str) else parents:
        _update(merged, _merged(path.parent / parent, (*seen, path)))
    _update(merged, tree)
    return merged


def _update(base: dict[str, Any], tree: dict[str, Any]) -> None:
    for key, value in tree.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _update(base[key], value)
        else:
            base[key] = value


def _header(path: Path) -> str:
    """The first line of the comment the recipe opens with ('' when it has none)."""
    first = path.read_text().lstrip().splitlines()[:1]
    return first[0].lstrip("#").strip() if first and first[0].startswith("#") else ""
