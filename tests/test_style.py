"""One style for the whole tree: ruff's lint rules and formatter (configured in pyproject.toml),
run over the repository as `ruff check .` and `ruff format --check .` would be."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def ruff(*args: str) -> subprocess.CompletedProcess:
    # ruff is in the dev extra that the test command installs: missing, it is an install defect
    exe = shutil.which("ruff") or pytest.fail("ruff is not installed: pip install -e '.[dev]'")
    return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_check_is_clean():
    done = ruff("check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_ruff_format_leaves_every_file_unchanged():
    done = ruff("format", "--no-cache", "--check", ".")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_style_check_sees_a_violation(tmp_path):
    """The checks above can fail: an unsorted, unused, relative import is reported under this
    project's configuration."""
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nimport os\nfrom .x import y\n")
    done = ruff("check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(bad))
    assert done.returncode == 1
    assert all(code in done.stdout for code in ("F401", "I001", "TID252")), done.stdout
