"""The recipes shipped with the package, and what a RECIPE argument names.

The YAML files live in recipes/ at the repository root and ship as the package
`lit_transformer.recipes` (setup.py and pyproject.toml map the folder): an editable install
reads them from the checkout, an installed wheel from its own copy. A RECIPE argument is an
existing file first, else the bare name of a shipped recipe (`tiny-clm` or `tiny-clm.yaml`),
so that `lit-transformer pretrain tiny-clm` works outside a checkout. Nothing here imports torch.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from lit_transformer.errors import RecipeError, closest

PACKAGE = "lit_transformer.recipes"
SUFFIX = ".yaml"


def recipe_folder() -> Path:
    """The shipped recipes' folder. A recipe names the files it extends relative to itself
    (`extends: base/tiny.yaml`), so the folder must be on disk, as pip installs every wheel."""
    try:
        folder = resources.files(PACKAGE)
    except ModuleNotFoundError:  # a checkout on sys.path, not installed: the recipes/ beside the package
        return Path(__file__).resolve().parents[2] / "recipes"
    if not isinstance(folder, Path):
        raise RecipeError(
            f"{PACKAGE}: the shipped recipes are inside an archive ({folder}); install the package unpacked"
        )
    return folder


def shipped_recipes() -> dict[str, Path]:
    """{name: file} for every shipped recipe, by name; base/ holds fragments, not recipes."""
    return dict(sorted((path.name.removesuffix(SUFFIX), path) for path in recipe_folder().glob(f"*{SUFFIX}")))


def resolve_recipe(arg: str | os.PathLike) -> Path:
    """The file a RECIPE argument names: an existing path wins; else a bare shipped recipe name,
    with or without `.yaml`; else a one-line error naming the argument and the closest name."""
    path = Path(arg)
    if path.is_file():
        return path
    text = os.fspath(arg)
    name = text.removesuffix(SUFFIX)
    recipes = shipped_recipes()
    if name in recipes:  # a name with a folder in it is a path, never a shipped name
        return recipes[name]
    hint = closest(Path(name).name, recipes) or "; `lit-transformer recipes` lists the shipped ones"
    raise RecipeError(f"{text}: no such recipe file, nor a shipped recipe name{hint}")
