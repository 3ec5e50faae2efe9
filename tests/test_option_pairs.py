"""The option table (tests/option_pairs.py) covers every valid pair; its refusal rows and its
single-process rows, each stopped, resumed and followed by the commands that apply."""

from __future__ import annotations

import itertools
from dataclasses import astuple

import pytest
import torch
from helpers import RECIPES, capped_recipe
from option_pairs import (
    AXES,
    EXCLUDED,
    MEANINGLESS,
    REFUSED,
    ROWS,
    RUNS,
    STEPS,
    Row,
    assert_evaluations_ran,
    check_run,
    declared_eval,
    follow_up,
    one_error_line,
    pretrain_args,
    stop_and_resume,
)

from lit_transformer.commands.cli import main
from lit_transformer.recipe.load import load_recipe, save_config

# ----------------------------------------------------------------------------- the table


def _pairs(row: Row) -> set[tuple]:
    values = dict(zip(AXES, astuple(row)))
    return {(a, values[a], b, values[b]) for a, b in itertools.combinations(AXES, 2)}


def _excluded(pair: tuple) -> bool:
    a, x, b, y = pair
    return any(p in REFUSED | MEANINGLESS | EXCLUDED for p in (pair, (b, y, a, x)))


def test_the_table_covers_every_valid_pair():
    every = {(a, x, b, y) for a, b in itertools.combinations(AXES, 2) for x in AXES[a] for y in AXES[b]}
    for row in ROWS:
        assert all(value in AXES[axis] for axis, value in zip(AXES, astuple(row))), row
    covered = set().union(*(_pairs(row) for row in RUNS))
    missing = sorted(p for p in every - covered if not _excluded(p))
    assert not missing, missing
    for row in RUNS:  # a running row holds no refused or meaningless pair
        assert not [p for p in _pairs(row) if _excluded(p)], row
    for row in ROWS:
        if row.refuses is not None:  # a refusal row holds exactly one refused pair
            assert len([p for p in _pairs(row) if _excluded(p)]) == 1, row
    refused = {p for row in ROWS if row.refuses is not None for p in _pairs(row) if _excluded(p)}
    assert refused == REFUSED, REFUSED - refused
    # the ddp and fsdp compile rows repeat a single-process compile row's graph (see the docstring)
    graph = lambda r: (r.objective, r.attention, r.precision, r.checkpointing, r.generation)  # noqa: E731
    single = [graph(r) for r in RUNS if r.compile == "on" and r.strategy == "single"]
    assert all(graph(r) in single for r in RUNS if r.compile == "on" and r.strategy != "single")


def test_each_recipe_declares_the_eval_section_it_loads_and_the_matrices_run(tmp_path):
    """declared_eval (the matrices' expectation, read from the YAML) agrees with load_recipe on
    every recipe, capped_recipe keeps every entry, and the table's LM recipes ship a section, so
    that "every evaluation ran" is never a loop over nothing."""
    for path in sorted(RECIPES.glob("*.yaml")):
        names = declared_eval(path)
        assert [e.name for e in load_recipe(path).eval] == names, path.name
        assert [e.name for e in load_recipe(capped_recipe(path, tmp_path / path.stem)).eval] == names, path.name
    shipping = {o for o in AXES["objective"] if declared_eval(RECIPES / f"tiny-{o}.yaml")}
    assert shipping == {"mlm", "clm", "span"}, shipping


def test_a_run_with_a_trimmed_eval_section_fails_the_check(tmp_path):
    recipe = RECIPES / "tiny-clm.yaml"
    for trimmed in (["eval=[]"], ["eval=[{name: names, kind: choice, embedded: docstring_function}]"]):
        save_config(load_recipe(recipe, trimmed), tmp_path / "config.yaml")
        with pytest.raises(AssertionError, match="tiny-clm.yaml"):
            assert_evaluations_ran(recipe, tmp_path, [0, STEPS])


# ----------------------------------------------------------------------------- running


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread", "private_cache")
@pytest.mark.parametrize("row", [r for r in ROWS if r.refuses is not None], ids=lambda r: r.id)
def test_refusal_row(row, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(pretrain_args(row, run_dir, f"trainer.max_steps={STEPS}")) == 2
    assert row.refuses in one_error_line(capsys)
    assert not run_dir.exists()  # refused before anything is written: the corrected run may use the directory


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread", "private_cache")
@pytest.mark.parametrize("row", [r for r in RUNS if r.strategy == "single"], ids=lambda r: r.id)
def test_single_process_row(row, tmp_path, capsys):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # earlier rows' graphs must not count, nor fill dynamo's recompile limit
    counters.clear()
    run_dir = tmp_path / "run"
    for args in stop_and_resume(row, run_dir):
        assert main(args) == 0
    assert (counters["stats"]["unique_graphs"] > 0) == (row.compile == "on")  # compiled, or not at all
    check_run(row, run_dir)
    follow_up(row, run_dir, tmp_path, capsys)
