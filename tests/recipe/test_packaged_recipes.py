"""The recipes ship inside the package: a bare name (`tiny-clm`) names a shipped recipe wherever
the command runs, an existing path wins over a name, an unknown name is one line with the closest
name, `recipes` lists them, and a built wheel carries every recipe and resolves names from its
own copy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import RECIPES

from lit_transformer.commands import info as info_command
from lit_transformer.commands.cli import main
from lit_transformer.commands.info import info
from lit_transformer.commands.recipes import list_recipes
from lit_transformer.model.config import ConfigError
from lit_transformer.recipe import catalog
from lit_transformer.recipe.catalog import resolve_recipe, shipped_recipes
from lit_transformer.recipe.load import RecipeError, load_recipe, to_yaml

ROOT = RECIPES.parent
NAMES = sorted(path.stem for path in RECIPES.glob("*.yaml"))
NO_SUCH = "no such recipe file, nor a shipped recipe name"


def test_every_recipe_is_shipped_and_a_bare_name_reads_its_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no recipe file here: only the shipped names can answer
    assert sorted(shipped_recipes()) == NAMES
    for name in NAMES:
        for arg in (name, f"{name}.yaml"):
            assert resolve_recipe(arg).read_bytes() == (RECIPES / f"{name}.yaml").read_bytes(), arg
    # a shipped recipe extends its neighbours (tiny-clm-linear -> tiny-clm -> base/tiny.yaml)
    assert to_yaml(load_recipe("tiny-clm-linear")) == to_yaml(load_recipe(RECIPES / "tiny-clm-linear.yaml"))


def test_a_checkout_on_the_path_without_an_install_reads_its_own_recipes(monkeypatch):
    def not_installed(package):
        raise ModuleNotFoundError(f"No module named {package!r}")

    monkeypatch.setattr(catalog.resources, "files", not_installed)
    assert catalog.recipe_folder() == RECIPES
    assert resolve_recipe("tiny-clm") == RECIPES / "tiny-clm.yaml"


def test_an_existing_path_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("tiny-clm.yaml").write_text(f"extends: {RECIPES / 'tiny-clm.yaml'}\ntrainer:\n  max_steps: 7\n")
    Path("tiny-mlm").write_text(f"extends: {RECIPES / 'tiny-clm.yaml'}\ntrainer:\n  max_steps: 5\n")
    assert resolve_recipe("tiny-clm.yaml") == Path("tiny-clm.yaml")
    assert load_recipe("tiny-clm.yaml").trainer.max_steps == 7
    assert load_recipe("tiny-mlm").trainer.max_steps == 5  # a file without the suffix is a path too
    assert load_recipe("tiny-clm").trainer.max_steps == load_recipe(RECIPES / "tiny-clm.yaml").trainer.max_steps != 7


@pytest.mark.parametrize(
    "arg, message",
    [
        ("tiny-clmm", f"tiny-clmm: {NO_SUCH} (did you mean `tiny-clm`?)"),
        ("recipes/tiny-mlm.yaml", f"recipes/tiny-mlm.yaml: {NO_SUCH} (did you mean `tiny-mlm`?)"),
        ("qqqq", f"qqqq: {NO_SUCH}; `lit-transformer recipes` lists the shipped ones"),
    ],
)
def test_an_unknown_recipe_is_one_line_naming_it_and_the_closest_name(arg, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # recipes/tiny-mlm.yaml is a path only inside the checkout
    with pytest.raises(RecipeError) as raised:
        load_recipe(arg)
    assert str(raised.value) == message
    assert main(["pretrain", arg]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_info_takes_a_path_then_a_preset_then_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    by_name, by_path = info("tiny-mlm.yaml"), info(str(RECIPES / "tiny-mlm.yaml"))
    assert by_name == by_path and by_name["source"] == str(RECIPES / "tiny-mlm.yaml")
    assert info("tiny-clm")["name"] == "tiny-clm"
    assert info_command.plan("tiny-clm")["seq_len"] == 128
    with pytest.raises(ConfigError, match=r"^unknown preset 'tiny-clmm' \(did you mean `tiny-clm`\?\), nor a shipped"):
        info("tiny-clmm")
    # a preset wins over a shipped recipe of the same name; an existing file wins over both
    monkeypatch.setattr(info_command, "shipped_recipes", lambda: {"gpt2-small": RECIPES / "tiny-clm.yaml"})
    assert info("gpt2-small")["source"] == "preset"
    Path("gpt2-small").write_text(f"extends: {RECIPES / 'tiny-clm.yaml'}\n")
    assert info("gpt2-small")["source"] == str(tmp_path / "gpt2-small")


def test_recipes_lists_every_shipped_recipe_from_its_yaml():
    rows = {row["name"]: row for row in json.loads(list_recipes(as_json=True))}
    assert sorted(rows) == NAMES
    assert rows["tiny-clm"] == {
        "name": "tiny-clm",
        "objective": "clm",
        "arch": "decoder",
        "model": "d_model 128 x 2 layers",
        "description": (RECIPES / "tiny-clm.yaml").read_text().splitlines()[0].removeprefix("# "),
        "path": str(RECIPES / "tiny-clm.yaml"),
    }
    assert rows["tiny-clm-linear"]["objective"] == "clm"  # from the recipe it extends
    assert rows["tiny-unilm"]["objective"] == "mixture (mlm, clm, prefix_lm)"
    assert rows["tiny-gptbert"]["objective"] == rows["gptbert-base"]["objective"] == "mixture (clm, mntp)"
    assert (rows["bert-base-mlm"]["arch"], rows["bert-base-mlm"]["model"]) == ("encoder", "bert-base")  # the preset's
    assert rows["minilm-classify"]["model"] == "from minilm"
    assert rows["speedrun-clm"]["model"] == "size auto"
    table = list_recipes().splitlines()
    assert table[0].split() == ["name", "objective", "arch", "model", "description"]
    assert [line.split()[0] for line in table[1:]] == NAMES
    assert "d_model 128 x 2 layers" in next(line for line in table if line.startswith("tiny-clm "))


def test_the_recipes_command_prints_the_list(capsys):
    assert main(["recipes"]) == 0
    assert capsys.readouterr().out == list_recipes() + "\n"
    assert main(["recipes", "--json"]) == 0
    assert [row["name"] for row in json.loads(capsys.readouterr().out)] == NAMES


def test_resolving_and_listing_import_no_torch(tmp_path):
    probe = (
        "import sys\nfrom lit_transformer.commands.recipes import list_recipes\n"
        "from lit_transformer.recipe.load import load_recipe\n"
        "list_recipes(); load_recipe('tiny-clm')\nprint(sorted(m for m in ('torch', 'lightning') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# the wheel is built from a copy of these, so that the build writes nothing into the checkout
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "lit_transformer", "recipes")


@pytest.mark.slow
def test_the_wheel_carries_every_recipe_and_resolves_names_from_its_own_copy(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    done = subprocess.run(
        [*build, "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path / "site")  # what pip install puts in site-packages, less the scripts
    recipes = {f"lit_transformer/recipes/{p.relative_to(RECIPES)}" for p in RECIPES.rglob("*.yaml")}
    assert recipes and recipes <= names
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "lit_transformer").rglob("*.py")}
    assert modules <= names, sorted(modules - names)  # setup.py's package list misses none

    probe = (
        "import json, lit_transformer\nfrom lit_transformer.recipe.catalog import resolve_recipe\n"
        "from lit_transformer.recipe.load import load_recipe, to_yaml\n"
        "print(json.dumps([lit_transformer.__file__, str(resolve_recipe('tiny-clm-linear')), "
        "to_yaml(load_recipe('tiny-clm-linear'))]))"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    package, recipe, config = json.loads(done.stdout)
    assert package == str(tmp_path / "site" / "lit_transformer" / "__init__.py")
    assert recipe == str(tmp_path / "site" / "lit_transformer" / "recipes" / "tiny-clm-linear.yaml")
    assert config == to_yaml(load_recipe(RECIPES / "tiny-clm-linear.yaml"))  # its extends chain read from the wheel
