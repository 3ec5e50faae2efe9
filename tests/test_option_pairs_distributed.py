"""The option table's ddp and fsdp rows (tests/option_pairs.py): one 2-process job per strategy
trains its rows one after another; each test checks one row's run and the commands that follow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_two_ranks
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


def _two_processes(strategy: str, tmp_path_factory) -> Path:
    """Every row of the strategy, stopped and resumed, in one 2-process run (Lightning starts
    rank 1 by running the script again, so the script holds all of them)."""
    out = tmp_path_factory.mktemp(strategy)
    commands = [args for row in RUNS if row.strategy == strategy for args in stop_and_resume(row, out / row.id)]
    (out / "commands.json").write_text(json.dumps(commands))
    (out / "run.py").write_text(_SCRIPT)
    run_two_ranks(out / "run.py", [str(out / "commands.json")], tmp_path_factory.getbasetemp() / "cache", out, 600)
    return out


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> Path:
    return _two_processes("ddp", tmp_path_factory)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> Path:
    return _two_processes("fsdp", tmp_path_factory)


@pytest.mark.distributed
@pytest.mark.usefixtures("one_thread", "private_cache")
@pytest.mark.parametrize("row", [r for r in RUNS if r.strategy != "single"], ids=lambda r: r.id)
def test_two_process_row(row, request, tmp_path, capsys):
    run_dir = request.getfixturevalue(row.strategy) / row.id
    check_run(row, run_dir)
    follow_up(row, run_dir, tmp_path, capsys)
