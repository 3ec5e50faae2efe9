"""The recipe's `eval` section and suite files: one-line errors naming the file, the entry and
the key; a saved config.yaml keeps the section."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import RECIPES

from lit_transformer.recipe.eval_schema import EvalConfig
from lit_transformer.recipe.load import RecipeError, load_recipe, load_suite, save_config


def recipe(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(f"extends: {RECIPES / 'tiny-clm.yaml'}\n{body}")
    return path


def error_of(tmp_path: Path, body: str) -> str:
    path = recipe(tmp_path, body)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: "), message
    return message


def test_unknown_kind_lists_the_kinds(tmp_path):
    message = error_of(tmp_path, "eval:\n  - {name: held, kind: heldot, files: a.txt}\n")
    kinds = "['heldout', 'classify', 'choice', 'pairs', 'translate']"
    assert f"eval[0] (held): kind='heldot' is not one of {kinds}" in message
    assert "(did you mean `heldout`?)" in message


def test_unknown_key_names_the_entry_and_the_closest_key(tmp_path):
    body = "eval:\n  - {name: ok, kind: heldout, files: a.txt}\n  - {name: t, kind: translate, filez: a.txt}\n"
    assert error_of(tmp_path, body).endswith("eval[1] (t): unknown key filez (did you mean `files`?)")


def test_a_key_of_another_kind_is_refused(tmp_path):
    message = error_of(tmp_path, "eval:\n  - {name: held, kind: heldout, files: a.txt, num_beams: 4}\n")
    assert message.endswith(
        "eval[0] (held): num_beams: a heldout evaluation does not read num_beams (it is for translate)"
    )


def test_heldout_reads_no_mode_token(tmp_path):
    """heldout's rows go through the objective's collators, which put each task's token already."""
    message = error_of(tmp_path, "eval:\n  - {name: held, kind: heldout, files: a.txt, mode_token: '[NLU]'}\n")
    assert message.endswith(
        "eval[0] (held): mode_token: a heldout evaluation does not read mode_token "
        "(it is for classify, choice, pairs, translate)"
    )


def test_tiny_ul2_evaluates_with_its_mode_tokens():
    cfg = load_recipe(RECIPES / "tiny-ul2.yaml")
    assert [(e.name, e.kind, e.mode_token) for e in cfg.eval] == [
        ("docstrings", "classify", "[NLU]"),
        ("names", "choice", "[S2S]"),
        ("next_line", "choice", "[S2S]"),
    ]
    assert {e.mode_token for e in cfg.eval} <= set(cfg.tokenizer.extra_special_tokens)


def test_names_are_unique(tmp_path):
    body = "eval:\n  - {name: a, kind: heldout, files: x.txt}\n  - {name: a, kind: heldout, embedded: stdlib_text}\n"
    assert "eval[1] (a): the name 'a' is also eval[0]'s" in error_of(tmp_path, body)


def test_files_are_required_unless_embedded_or_the_runs_split(tmp_path):
    message = error_of(tmp_path, "eval:\n  - {name: held, kind: heldout}\n")
    assert message.endswith(
        "eval[0] (held): a heldout evaluation needs files (or embedded: a built-in set or split: the run's own)"
    )
    message = error_of(tmp_path, "eval:\n  - {name: c, kind: choice}\n")  # choice reads no split
    assert message.endswith("eval[0] (c): a choice evaluation needs files (or embedded: a built-in set)")
    assert "missing value for name" in error_of(tmp_path, "eval:\n  - {kind: heldout, files: a.txt}\n")
    message = error_of(tmp_path, "eval:\n  - {name: h, kind: heldout, embedded: next_line}\n")
    assert message.endswith("eval[0] (h): embedded='next_line' is a choice set, not heldout")


def test_the_runs_own_split_takes_no_files(tmp_path):
    cfg = load_recipe(recipe(tmp_path, "eval:\n  - {name: val, kind: heldout, split: validation, task: clm}\n"))
    assert cfg.eval[0] == EvalConfig(name="val", kind="heldout", split="validation", task="clm")
    message = error_of(tmp_path, "eval:\n  - {name: val, kind: heldout, split: validation, files: a.txt}\n")
    assert message.endswith("eval[0] (val): split='validation' reads the run's own data; it takes no files")
    assert "split='train' is not one of ['validation', 'test']" in error_of(
        tmp_path, "eval:\n  - {name: val, kind: translate, split: train}\n"
    )
    message = error_of(tmp_path, "eval:\n  - {name: p, kind: choice, split: test}\n")
    assert message.endswith(
        "eval[0] (p): split: a choice evaluation does not read split (it is for heldout, translate)"
    )
    message = error_of(tmp_path, "eval:\n  - {name: t, kind: translate, split: test, task: clm}\n")
    assert message.endswith("eval[0] (t): task: a translate evaluation does not read task (it is for heldout)")


def test_pairs_and_scoring_keys(tmp_path):
    body = "eval:\n  - {name: blimp, kind: pairs, files: b.jsonl, group_column: UID, scoring: masked}\n"
    (entry,) = load_recipe(recipe(tmp_path, body)).eval
    columns = (entry.good_column, entry.bad_column, entry.group_column)
    assert columns == ("sentence_good", "sentence_bad", "UID") and entry.scoring == "masked"
    assert error_of(tmp_path, "eval:\n  - {name: p, kind: pairs}\n").endswith(
        "eval[0] (p): a pairs evaluation needs files"
    )
    message = error_of(tmp_path, "eval:\n  - {name: c, kind: choice, embedded: next_line, group_column: UID}\n")
    assert message.endswith(
        "eval[0] (c): group_column: a choice evaluation does not read group_column (it is for pairs)"
    )
    message = error_of(tmp_path, "eval:\n  - {name: t, kind: translate, split: test, scoring: masked}\n")
    assert message.endswith("scoring: a translate evaluation does not read scoring (it is for heldout, choice, pairs)")
    message = error_of(tmp_path, "eval:\n  - {name: p, kind: pairs, files: b.jsonl, scoring: pll}\n")
    assert "eval[0] (p): scoring" in message and "pll" in message
    message = error_of(tmp_path, "eval:\n  - {name: p, kind: pairs, files: b.jsonl, bad_column: sentence_good}\n")
    assert message.endswith("eval[0] (p): good_column and bad_column are both 'sentence_good'; name two columns")


def test_translate_needs_a_reference_file_per_source_file(tmp_path):
    body = "eval:\n  - {name: mt, kind: translate, files: [a.en, b.en], target_files: a.de}\n"
    assert "eval[0] (mt): target_files: 1 file(s) for 2 source file(s)" in error_of(tmp_path, body)


def test_values_are_checked_per_entry(tmp_path):
    body = "eval:\n  - {name: h, kind: heldout, files: a.txt, every_n_steps: 0}\n"
    assert error_of(tmp_path, body).endswith("eval[0] (h): every_n_steps=0 must be a positive integer")
    assert "eval: expected a list" in error_of(tmp_path, "eval: {name: h}\n")


def test_saved_config_keeps_the_section(tmp_path):
    body = (
        "eval:\n"
        "  - {name: held, kind: heldout, files: a.txt, every_n_steps: 5, max_examples: 7}\n"
        "  - {name: code, kind: heldout, embedded: stdlib_text}\n"
        "  - {name: mt, kind: translate, files: a.en, target_files: a.de, num_beams: 4}\n"
    )
    cfg = load_recipe(recipe(tmp_path, body))
    assert [e.name for e in cfg.eval] == ["held", "code", "mt"]
    assert cfg.eval[0] == EvalConfig(name="held", kind="heldout", files=["a.txt"], every_n_steps=5, max_examples=7)
    assert cfg.eval[2].target_files == ["a.de"] and cfg.eval[2].num_beams == 4
    save_config(cfg, tmp_path / "config.yaml")
    assert load_recipe(tmp_path / "config.yaml").eval == cfg.eval
    # the tiny recipes evaluate out of the box (base/tiny-eval.yaml), without mode tokens
    tiny = load_recipe(RECIPES / "tiny-clm.yaml").eval
    assert [(e.name, e.mode_token) for e in tiny] == [("docstrings", None), ("names", None), ("next_line", None)]


def test_a_suite_file_is_an_eval_list_or_a_bare_list(tmp_path):
    (tmp_path / "suite.yaml").write_text("eval:\n  - {name: held, kind: heldout, files: a.txt}\n")
    (tmp_path / "bare.yaml").write_text("- {name: held, kind: heldout, files: a.txt}\n")
    expected = [EvalConfig(name="held", kind="heldout", files=["a.txt"])]
    assert load_suite(tmp_path / "suite.yaml") == load_suite(tmp_path / "bare.yaml") == expected
    (tmp_path / "bad.yaml").write_text("eval:\n  - {name: held, kind: heldout, files: a.txt, mode: finetune}\n")
    with pytest.raises(RecipeError, match=r"bad.yaml: eval\[0\] \(held\): mode: a heldout evaluation does not read"):
        load_suite(tmp_path / "bad.yaml")
    (tmp_path / "other.yaml").write_text("evals: []\n")
    with pytest.raises(RecipeError, match=r"other.yaml: unknown key evals \(did you mean `eval`\?\)"):
        load_suite(tmp_path / "other.yaml")
    with pytest.raises(RecipeError, match="no such suite file"):
        load_suite(tmp_path / "missing.yaml")
