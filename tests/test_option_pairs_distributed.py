"""The option table's ddp and fsdp rows (tests/option_pairs.py): one 2-process job trains them
one after another; each test checks one row's run and the commands that follow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from option_pairs import RUNS, check_run, follow_up, stop_and_resume

_SCRIPT = r"""
import json
import sys

from lit_transformer.commands.cli import main
from lit_transformer.recipe.load import load_recipe

for args in json.loads(open(sys.argv[1]).read()):
    code = main(args)
    if code != 0:
        raise SystemExit(f"exit status {code}: {' '.join(args)}")
"""


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, launcher) -> Path:
    """Every ddp row, then every fsdp row, each stopped and resumed, in one 2-process job
    (tests/launcher.py forks its ranks; each runs the script, which holds all of them)."""
    out = tmp_path_factory.mktemp("two")
    rows = [row for strategy in ("ddp", "fsdp") for row in RUNS if row.strategy == strategy]
    commands = [args for row in rows for args in stop_and_resume(row, out / row.id)]
    (out / "commands.json").write_text(json.dumps(commands))
    (out / "run.py").write_text(_SCRIPT)
    launcher.run(out / "run.py", [str(out / "commands.json")], tmp_path_factory.getbasetemp() / "cache", out, 900)
    return out


@pytest.mark.distributed
@pytest.mark.usefixtures("one_thread", "private_cache")
@pytest.mark.parametrize("row", [r for r in RUNS if r.strategy != "single"], ids=lambda r: r.id)
def test_two_process_row(row, two_processes, tmp_path, capsys):
    run_dir = two_processes / row.id
    check_run(row, run_dir)
    follow_up(row, run_dir, tmp_path, capsys)
