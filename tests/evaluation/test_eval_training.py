"""The recipe's eval section in a training run: it changes nothing about training, its numbers
reach the CSV logs and metrics.json, and `evaluate` gives the same numbers on the same weights.

The runs train with dropout and without StepSeed's reseed of torch's generator before every
batch, so that an evaluation that left a module in eval mode or took numbers from a random
stream would change the dropout masks, and so the losses, of every step after it. None of the
evaluations here draws random numbers, so the run's `text` entry is wrapped in one that does (as
a sampling decoder or a shuffled probe would): run_suite must give the streams back as they were."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import RECIPES, SMALL, losses
from safetensors.torch import load_file

from lit_transformer.commands.evaluate import evaluate_suite
from lit_transformer.commands.train import train
from lit_transformer.evaluation import heldout, suite
from lit_transformer.recipe.load import load_recipe
from lit_transformer.training.callbacks import StepSeed
from lit_transformer.training.rundir import read_metrics

pytestmark = pytest.mark.slow

# one entry of each kind that reads the embedded data, and minimal pairs from a file (PAIRS) scored
# both ways, as the mixture trained both (its mlm task); small, so the test stays tiny
SUITE = """
eval:
  - {name: text, kind: heldout, embedded: stdlib_text, max_examples: 8}
  - {name: docstrings, kind: classify, embedded: docstring_package, max_examples: 48}
  - {name: next_line, kind: choice, embedded: next_line, max_examples: 12}
  - {name: names, kind: choice, embedded: docstring_function, max_examples: 12, every_n_steps: 10}
  - {name: grammar, kind: pairs, files: PAIRS, group_column: UID}
  - {name: grammar_masked, kind: pairs, files: PAIRS, scoring: masked}
  - {name: pll, kind: heldout, embedded: stdlib_text, scoring: masked, max_examples: 2}
"""
EVAL_NAMES = ("text", "docstrings", "next_line", "names", "grammar", "grammar_masked", "pll")
PAIRS = [
    ("def load(path):", "def (path) load:", "def"),
    ("return self.value", "self return .value", "return"),
    ("for item in items:", "for in item items:", "for"),
    ("import os", "os import", "import"),
]


def unilm_run(tmp_path: Path, name: str, with_eval: bool) -> Path:
    recipe = tmp_path / f"{name}.yaml"
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"sentence_good": g, "sentence_bad": b, "UID": u}) + "\n" for g, b, u in PAIRS))
    suite_text = SUITE.replace("PAIRS", str(pairs))
    recipe.write_text(f"extends: {RECIPES / 'tiny-unilm.yaml'}\n" + (suite_text if with_eval else ""))
    run_dir = tmp_path / name
    small = [a for a in SMALL if a != "eval=[]"] if with_eval else SMALL  # SMALL turns the recipes' own off
    overrides = [*small, "tokenizer.vocab_size=400", "model.dropout=0.1", "trainer.keep_checkpoints=2"]
    train(load_recipe(recipe, [*overrides, f"run.dir={run_dir}"]), progress_bar=False)
    return run_dir


class Drawing:
    """A held-out evaluation that first draws from torch's, numpy's and Python's generators."""

    def __init__(self, entry, cfg):
        self.inner = heldout.build(entry, cfg)
        self.entry = self.inner.entry

    def __call__(self, target):
        torch.rand(1), np.random.rand(), random.random()
        return self.inner(target)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval-training")
    with pytest.MonkeyPatch.context() as patch:
        # the reseed would hide an evaluation that draws from torch's generator
        patch.setattr(StepSeed, "on_train_batch_start", lambda *args: None)
        patch.setitem(suite.KINDS, "heldout", Drawing)
        return unilm_run(tmp, "plain", False), unilm_run(tmp, "evaluated", True)


def test_evaluations_do_not_change_training(runs):
    plain, evaluated = runs
    assert losses(plain) and losses(plain) == losses(evaluated)  # ==, not approx
    weights, other = load_file(plain / "model.safetensors"), load_file(evaluated / "model.safetensors")
    assert weights.keys() == other.keys() and all((weights[k] == other[k]).all() for k in weights)
    metrics, other_metrics = (
        json.loads((plain / "metrics.json").read_text()),
        json.loads((evaluated / "metrics.json").read_text()),
    )
    assert {k: v for k, v in other_metrics.items() if k.startswith("val/")} == metrics


def test_evaluations_are_logged_at_each_validation_and_saved_at_the_end(runs):
    _, evaluated = runs
    rows = read_metrics(evaluated)
    steps = {name: sorted(int(r["step"]) for r in rows if f"eval/{name}/seconds" in r) for name in EVAL_NAMES}
    # the initial weights (step 0), then SMALL's validations at steps 5 and 10; `names` every 10 steps only
    assert steps == {name: [0, 10] if name == "names" else [0, 5, 10] for name in EVAL_NAMES}
    final = json.loads((evaluated / "metrics.json").read_text())
    for key in ("eval/text/clm/loss", "eval/docstrings/accuracy", "eval/next_line/acc", "eval/names/acc_norm"):
        assert key in final, sorted(final)
    assert 0 <= final["eval/docstrings/accuracy"] <= 1 and final["eval/next_line/examples"] == 12
    assert final["eval/grammar/examples"] == final["eval/grammar/groups"] == 4.0 and "eval/grammar/group/def" in final
    assert final["eval/grammar_masked/examples"] == 4.0 and "eval/grammar_masked/groups" not in final
    assert final["eval/pll/pseudo_perplexity"] == pytest.approx(math.exp(-final["eval/pll/pll_per_token"]))


def test_evaluate_gives_the_in_training_numbers_on_the_same_weights(runs):
    _, evaluated = runs
    final = json.loads((evaluated / "metrics.json").read_text())
    out = evaluate_suite(str(evaluated))
    for key, value in final.items():
        if key.startswith("eval/") and not key.endswith("/seconds"):
            assert out[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_all_checkpoints_write_the_curve(runs, tmp_path):
    _, evaluated = runs
    curve = tmp_path / "curve.csv"
    out = evaluate_suite(str(evaluated), eval_names=["next_line"], all_checkpoints=True, output=str(curve))
    assert [row["step"] for row in out["checkpoints"]] == [5, 10]
    lines = curve.read_text().splitlines()
    assert lines[0].startswith("step,eval/next_line/acc") and len(lines) == 3
    # the checkpoint of the last step holds the final weights: the in-training number
    final = json.loads((evaluated / "metrics.json").read_text())
    assert out["checkpoints"][-1]["eval/next_line/acc"] == pytest.approx(final["eval/next_line/acc"])


def test_an_exported_transformers_directory_is_evaluated_as_its_run(tmp_path):
    """A decoder's choice numbers on the exported transformers directory (no run config: the
    architecture's objective and the tokenizer.json beside it) equal the run's own."""
    from lit_transformer.commands.inference import export

    suite = tmp_path / "suite.yaml"
    suite.write_text("eval:\n  - {name: next_line, kind: choice, embedded: next_line, max_examples: 12}\n")
    recipe = tmp_path / "clm.yaml"
    recipe.write_text(f"extends: {RECIPES / 'tiny-clm.yaml'}\n")
    run_dir = tmp_path / "clm"
    train(load_recipe(recipe, [*SMALL, "tokenizer.vocab_size=400", f"run.dir={run_dir}"]), progress_bar=False)
    exported = export(str(run_dir), str(tmp_path / "hf"))
    ours, theirs = evaluate_suite(str(run_dir), suite=str(suite)), evaluate_suite(str(exported), suite=str(suite))
    assert ours["eval/next_line/examples"] == 12
    for key in ("eval/next_line/acc", "eval/next_line/acc_norm"):
        assert theirs[key] == pytest.approx(ours[key]), key
