"""A test skips only when an optional library is not installed at all (helpers.optional), with a
reason that names the library and the extra that installs it: an ImportError inside an installed
library, or in a module of ours, fails the test instead of passing as a skip."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import re
from pathlib import Path

import pytest
from helpers import optional

TESTS = Path(__file__).resolve().parent


def test_an_absent_library_is_a_skip_naming_its_extra():
    with pytest.raises(pytest.skip.Exception) as skip:
        optional("no_such_library.sub", "eval")
    assert str(skip.value) == "no_such_library is not installed: scripts/install.sh installs it with the 'eval' extra"


def test_an_installed_library_that_fails_to_import_fails(tmp_path, monkeypatch):
    (tmp_path / "broken_library").mkdir()
    (tmp_path / "broken_library" / "__init__.py").write_text("import lit_transformer.no_such_module\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="lit_transformer.no_such_module"):
        optional("broken_library", "dev")


def test_an_installed_library_is_returned():
    import json

    assert optional("json", "dev") is json


def _skips_on_import_error(tree: ast.AST) -> list[int]:
    """Lines of `pytest.importorskip(...)` calls and of `except ImportError` handlers that skip."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "importorskip":
            lines.append(node.lineno)
        if isinstance(node, ast.ExceptHandler) and node.type is not None:
            caught = {n.id for n in ast.walk(node.type) if isinstance(n, ast.Name)}
            skips = any(isinstance(n, ast.Attribute) and n.attr == "skip" for stmt in node.body for n in ast.walk(stmt))
            if caught & {"ImportError", "ModuleNotFoundError"} and skips:
                lines.append(node.lineno)
    return lines


def test_no_test_turns_an_import_error_into_a_skip():
    found = {
        f"{path.relative_to(TESTS)}:{line}"
        for path in TESTS.rglob("*.py")
        for line in _skips_on_import_error(ast.parse(path.read_text()))
    }
    assert not found, f"use helpers.optional(library, extra) instead: {sorted(found)}"


def test_the_check_finds_both_forms():
    source = (
        "lm_eval = pytest.importorskip('lm_eval')\n"
        "try:\n    import ours\nexcept ImportError:\n    pytest.skip('ours is not available')\n"
    )
    assert _skips_on_import_error(ast.parse(source)) == [1, 4]


def _optional_libraries() -> set[tuple[str, str]]:
    """(library, extra) of every `optional("library.module", "extra")` call under tests/ (this
    file's own calls name libraries that do not exist, on purpose)."""
    found = set()
    for path in TESTS.rglob("*.py"):
        if path.name == Path(__file__).name:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "optional":
                args = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                if len(args) == 2:
                    found.add((args[0].partition(".")[0], args[1]))
    return found


def _extra_installed(extra: str) -> bool:
    """Every requirement that our installed metadata lists under `extra` is installed."""
    names = [
        re.match(r"[A-Za-z0-9_.\-]+", req).group(0)
        for req in importlib.metadata.requires("lit-transformer") or []
        if re.search(rf"extra == ['\"]{extra}['\"]", req)
    ]
    try:
        for name in names:
            importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return bool(names)


def test_an_installed_extra_turns_its_skips_into_failures():
    """A skip is for an extra nobody installed. Where the extra is installed (or in CI, which
    installs every extra the tests use: .ci/run -> scripts/test.sh -> scripts/install.sh), its
    libraries must be there: `pip install -e ".[dev,store]"` alone installs the store extra without
    litdata (pyproject.toml says why), and the store tests would pass as skips."""
    ci = bool(os.environ.get("CI"))
    missing = sorted(
        f"{library} (extra {extra!r})"
        for library, extra in _optional_libraries()
        if (ci or _extra_installed(extra)) and importlib.util.find_spec(library) is None
    )
    assert not missing, (
        f"installed without what their tests import: {missing}; install with scripts/install.sh "
        '(for litdata: pip install --no-deps "litdata==0.2.76")'
    )


def test_the_store_tests_skip_only_on_litdata():
    assert ("litdata", "store") in _optional_libraries()
