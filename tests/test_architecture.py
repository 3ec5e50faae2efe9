"""The package's shape: layers that import only downwards, no import cycle (function-level
imports included), one objective registry, and a command line that answers without Lightning."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lit_transformer.recipe import registry

PACKAGE = Path(__file__).resolve().parent.parent / "lit_transformer"

# Bottom to top, one folder (or leaf module) a name; a module may import from its own layer and
# the layers below it.
LAYERS = [
    # the core, the data pipeline, and the shared leaves: errors, lazy exports, the machine's
    # probes (bf16 matrix units, GPUs, threads) and the constants torch-free and torch code share
    {"model", "data", "errors", "lazy", "machine", "constants"},
    {"recipe"},  # the schema, reading recipes, the objective registry, mixtures of tasks
    {"training"},  # trainer factory, callbacks, DDP/FSDP2, checkpoints, run directories, start-up checks
    {"objectives"},
    {"evaluation"},  # named evaluations (the recipe's eval section), in training and by `evaluate`
    {"run"},  # the resolver (one frozen resolved run) and the model sources commands load
    {"commands"},  # the command line and each command's work
    {"__init__"},
]
# What the bottom layers may import besides themselves: the leaves every layer shares.
SHARED_LEAVES = {
    "lit_transformer.errors",
    "lit_transformer.lazy",
    "lit_transformer.machine",
    "lit_transformer.constants",
}
# What a layer may not import although it sits above it: a recipe means the same on every machine
# (the resolver, run/resolve.py, asks the machine and applies the recipe's rules to the answer).
NOT_IMPORTED = {"recipe": {"machine"}}


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, from every import statement in the file
    (module level and inside functions alike), resolved to the module or package imported."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                # `from pkg import sub` imports the submodule; `from pkg import name`, the package
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    return next(i for i, names in enumerate(LAYERS) if top in names)


def test_the_graph_sees_function_level_imports_and_cycles(tmp_path):
    """The checker itself: a cycle made only of an import inside a function is found."""
    package = tmp_path / "lit_transformer"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from . import b\n")
    (package / "a.py").write_text("from .sub.b import f\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..a import g\n")
    graph = import_graph(package)
    assert graph["lit_transformer.sub.b"] == {"lit_transformer.a"}
    assert cycles(graph) == [["lit_transformer.a", "lit_transformer.sub.b"]]


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_layers_import_only_downwards():
    graph = import_graph()
    every = {module.split(".")[1] for module in graph if "." in module} | {"__init__"}
    assert every <= set().union(*LAYERS), f"modules missing from LAYERS: {every - set().union(*LAYERS)}"
    assert upward_imports(graph) == []


@pytest.mark.parametrize("bottom", ["model", "data", "errors", "lazy", "machine", "constants"])
def test_the_bottom_imports_nothing_from_above(bottom):
    graph = import_graph()
    prefix = f"lit_transformer.{bottom}"
    outside = {
        (a, b)
        for a, targets in graph.items()
        if a == prefix or a.startswith(prefix + ".")
        for b in targets
        if not (b == prefix or b.startswith(prefix + ".")) and b not in SHARED_LEAVES
    }
    assert outside == set()
    if bottom in ("errors", "lazy", "machine", "constants"):  # the shared leaves import nothing at all from the package
        assert graph[prefix] == set()


def allowed_imports(top: str) -> set[str]:
    """The folders and leaf modules that `top` (a name in LAYERS) may import: the shared leaves
    for the bottom layer, else every name of its own layer and the layers below it."""
    if top in LAYERS[0]:
        return {leaf.rpartition(".")[2] for leaf in SHARED_LEAVES} - {top}
    below = set().union(*LAYERS[: layer_of(f"lit_transformer.{top}") + 1]) - {top, "__init__"}
    return below - NOT_IMPORTED.get(top, set())


# The sentence of a folder's docstring that says what it may import: from "Imports" at the start
# of a line to the first ";", ":" or full stop; the names are the backquoted ones in it, a folder
# with its trailing slash (`model/`).
IMPORTS_SENTENCE = re.compile(r"^Imports\b(.*?)(?:[;:]|\.(?:\s|$))", re.MULTILINE | re.DOTALL)


def docstring_disagreements(root: Path = PACKAGE) -> dict[str, str]:
    """{folder: what is wrong} for each folder of `root` whose __init__ docstring has no "Imports
    ..." sentence, or one whose names differ from allowed_imports."""
    wrong = {}
    for init in sorted(root.glob("*/__init__.py")):
        top = init.parent.name
        if top not in set().union(*LAYERS):
            wrong[top] = "not in LAYERS"
            continue
        sentence = IMPORTS_SENTENCE.search(ast.get_docstring(ast.parse(init.read_text())) or "")
        if sentence is None:
            wrong[top] = 'no "Imports ..." sentence in the docstring'
            continue
        said = {name.rstrip("/") for name in re.findall(r"`([^`]+)`", sentence.group(1))}
        if said != allowed_imports(top):
            wrong[top] = f"says {sorted(said)}, LAYERS allows {sorted(allowed_imports(top))}"
    return wrong


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) for each import of a higher layer than the importer's."""
    return sorted((a, b) for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))


def test_the_checkers_find_a_wrong_docstring_and_an_upward_import(tmp_path):
    """The checkers themselves: a folder docstring that leaves out a layer it may import, one
    that names a layer above it, one with no "Imports" sentence, and a model module that imports
    from recipe/ are each found; a docstring that names exactly what LAYERS allows passes."""
    package = tmp_path / "lit_transformer"

    def folder(name: str, doc: str, **modules: str) -> None:
        (package / name).mkdir(parents=True)
        (package / name / "__init__.py").write_text(f'"""{doc}"""\n')
        for module, text in modules.items():
            (package / name / f"{module}.py").write_text(text)

    def names(top: str) -> str:
        return ", ".join(f"`{n}/`" if (PACKAGE / n).is_dir() else f"`{n}`" for n in sorted(allowed_imports(top)))

    package.mkdir()
    (package / "__init__.py").write_text("")
    folder("model", f"The core.\n\nImports {names('model')}: no Lightning.", layers="from ..recipe import schema\n")
    folder("recipe", f"Recipes.\n\nImports {names('recipe')}; no torch.", schema="")
    folder("training", f"Training.\n\nImports {names('training')}, `objectives/`.")
    folder("objectives", "Objectives.\n\nImports `model/` and `data/`.")  # leaves out layers it may import
    folder("commands", "Commands. May import every layer below.")  # no "Imports" sentence
    assert docstring_disagreements(package).keys() == {"training", "objectives", "commands"}
    assert "objectives" in docstring_disagreements(package)["training"]
    assert upward_imports(import_graph(package)) == [("lit_transformer.model.layers", "lit_transformer.recipe.schema")]


def test_every_folder_says_what_it_may_import_as_layers_allows():
    """Each folder's __init__ docstring names, in its "Imports ..." sentence, exactly the folders
    and leaf modules that LAYERS lets it import."""
    assert docstring_disagreements() == {}


def test_no_layer_imports_what_it_must_not():
    graph = import_graph()
    found = {
        (a, b)
        for a, targets in graph.items()
        for b in targets
        if "." in a and b.split(".")[1] in NOT_IMPORTED.get(a.split(".")[1], set())
    }
    assert found == set()


def test_the_recipe_layer_imports_no_torch_even_inside_functions():
    """Reading a recipe never needs torch or Lightning: no module the recipe layer reaches
    (function-level imports included) imports them. Data modules are built in data/."""
    graph = import_graph()
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    reached, todo = set(), [m for m in graph if m.startswith("lit_transformer.recipe")]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(graph[name])
    heavy = {}
    for name in sorted(reached):
        for node in ast.walk(ast.parse(modules[name].read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            found = {n.split(".")[0] for n in names} & {"torch", "lightning", "torchmetrics"}
            if found:
                heavy[name] = sorted(found)
    assert heavy == {}


# ----------------------------------------------------------------------------- the registry


def test_every_objective_has_a_registered_class_and_a_data_kind():
    from lit_transformer.data.data_config import OBJECTIVES as DATA_KINDS
    from lit_transformer.objectives import ObjectiveBase, objective_class

    for name, spec in registry.SPECS.items():
        cls = objective_class(name)
        assert issubclass(cls, ObjectiveBase) and name in cls.objective_names
        # a mixture's tasks each have their own data kind (tasks.TASK_OBJECTIVES' pipelines)
        assert spec.data in (*DATA_KINDS, registry.MIXTURE)
        assert set(spec.archs) <= {"encoder", "decoder", "encoder_decoder"}
    assert set(registry.DEFAULT_FOR_ARCH.values()) <= set(registry.SPECS)


def test_unknown_objectives_are_one_line_errors():
    from lit_transformer.errors import RecipeError

    with pytest.raises(RecipeError, match=r"objective\.name='clmm' is not one of .* \(did you mean `clm`\?\)"):
        registry.spec("clmm")
    with pytest.raises(RecipeError):
        registry.implements("nope")


def test_no_module_branches_on_an_objective_name():
    """Objectives are found through the registry: outside registry.py and objectives/, no
    comparison or dict key names an objective."""
    names = set(registry.SPECS)
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "registry.py" or "objectives" in path.parts or "data" in path.parts:
            continue  # the data pipeline keys its collators on its own data kinds
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                constants = [c for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
                constants += [
                    e
                    for c in node.comparators
                    if isinstance(c, (ast.Tuple, ast.List, ast.Set))
                    for e in c.elts
                    if isinstance(e, ast.Constant)
                ]
                if any(c.value in names for c in constants):
                    offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


# ----------------------------------------------------------------------------- the command line

_PROBE = r"""
import json, sys, time
start = time.perf_counter()
from lit_transformer.commands.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
heavy = sorted(m for m in ("lightning", "lightning.pytorch", "torch") if m in sys.modules)
print("\nPROBE", json.dumps({"code": code, "heavy": heavy, "seconds": time.perf_counter() - start}), file=sys.stderr)
"""


@pytest.mark.parametrize(
    "argv, allowed",
    [
        (["--help"], []),
        (["pretrain", "--help"], []),
        (["evaluate", "--help"], []),
        (["info", "gpt2-small"], []),
        (["info", "recipes/tiny-clm.yaml", "--json"], []),
        (["pretrain", "recipes/tiny-clm.yaml", "--print-config"], []),
    ],
)
def test_help_info_and_print_config_import_neither_lightning_nor_torch(argv, allowed):
    root = PACKAGE.parent
    done = subprocess.run([sys.executable, "-c", _PROBE, *argv], cwd=root, capture_output=True, text=True, timeout=120)
    line = [x for x in done.stderr.splitlines() if x.startswith("PROBE ")][-1]
    probe = json.loads(line[len("PROBE ") :])
    assert probe["code"] in (0, None), done.stderr
    assert probe["heavy"] == allowed, f"{argv} imported {probe['heavy']}"
    if argv[0] == "info" and "--json" in argv:
        assert json.loads(done.stdout)["arch"] == "decoder"
