"""A test skips only when an optional library is not installed at all (helpers.optional), with a
reason that names the library and the extra that installs it: an ImportError inside an installed
library, or in a module of ours, fails the test instead of passing as a skip."""

from __future__ import annotations

import ast
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
