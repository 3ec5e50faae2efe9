"""Named evaluations in distributed training: 2 CPU processes (gloo) under DDP and FSDP2 against one
process with the same global batch, on a UniLM mixture with one entry of each kind a decoder
takes (classify linear and finetune first, as the shipped recipes order them, then choice,
heldout and translate).

Every rank runs every evaluation on gathered weights and keeps rank 0's numbers: the runs must
finish (no rank waits on a collective the other skips), every rank must hold the same numbers,
and those numbers must be the one-process run's, since the training is the same up to float
round-off. As in test_distributed.py, data.batch_size is per device (2 x 3 = 6) and both ranks of
the 2-process job are forked by the launcher (tests/launcher.py), which sets LOCAL_RANK.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import ONE_RANK, RECIPES, TINY_RUN, two_rank_job
from safetensors.torch import load_file

from lit_transformer.commands.train import train
from lit_transformer.data.sources.stdlib import seq2seq_examples
from lit_transformer.recipe.load import load_recipe
from lit_transformer.training.rundir import read_metrics

pytestmark = pytest.mark.distributed

STEPS = 3
# The classify probe first: before the first training step it calls a part of the model (the
# backbone), not the model itself, which under FSDP2 once made a Block its own root and crashed
# the step (every shipped tiny recipe's eval section starts so). heldout: 6 rows are one
# evaluation batch of the one-process run and two of each rank's (3 rows), the same rows either
# way. classify: 48 train and 48 dev rows of the 8-package task. translate: greedy decoding of 4
# docstring -> signature pairs (a UniLM decoder writes its continuation).
SUITE = """
eval:
  - {name: probe, kind: classify, embedded: docstring_package, max_examples: 48}
  - {name: tuned, kind: classify, embedded: docstring_package, max_examples: 48, mode: finetune, steps: 3}
  - {name: next_line, kind: choice, embedded: next_line, max_examples: 12}
  - {name: text, kind: heldout, embedded: stdlib_text, max_examples: 6}
  - {name: mt, kind: translate, files: SOURCE, target_files: TARGET, max_examples: 4, max_new_tokens: 4}
"""
# TINY_RUN without its "eval=[]" (the recipe file gives the eval section), deterministic as in
# test_distributed.py (no dropout; a high learning rate without warmup shows a wrong update);
# validation at step 2 only, so the evaluations run at steps 0 and 2 and on the final weights (3)
COMMON = [
    *(a for a in TINY_RUN if a != "eval=[]"),
    "data.max_length=24",
    "model.dropout=0.0",
    "finetune.head_dropout=0.0",
    "optim.lr=1e-2",
    "optim.warmup_steps=0",
    f"trainer.max_steps={STEPS}",
    "trainer.limit_val_batches=1",
    "trainer.val_check_interval=2",
]
EVAL_STEPS = [0, 2, 3]

# Per rank: each step's loss, the evaluation numbers the rank holds before each step (those of
# the evaluations after the previous validation) and what train() returned (metrics.json's values).
_RECORD = r"""
import json
from pathlib import Path

from lightning.pytorch.callbacks import Callback


class Record(Callback):
    def __init__(self, out):
        self.out, self.losses, self.held = Path(out), [], {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        named = [c for c in trainer.callbacks if type(c).__name__ == "NamedEvaluations"]
        if named:
            self.held[trainer.global_step] = dict(named[0].latest)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def write(self, rank, returned):
        self.out.mkdir(parents=True, exist_ok=True)
        record = {"losses": self.losses, "held": self.held, "returned": returned}
        (self.out / f"rank{rank}.json").write_text(json.dumps(record))
"""

_SCRIPT = (
    _RECORD
    + r"""
import os
import sys

from lit_transformer.commands.train import train
from lit_transformer.data.sources.stdlib import seq2seq_examples
from lit_transformer.recipe.load import load_recipe
from helpers import TWO_RANKS  # tests/ is on the scripts' path (helpers.job_env)

root, recipe, common = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
rank = int(os.environ["LOCAL_RANK"])  # set in each rank, as Lightning's launcher and torchrun set it
for strategy, two in TWO_RANKS.items():
    out = root / strategy
    runs = {"evaluated": (recipe, common)}
    if strategy == "ddp":  # the same training without the eval section
        runs["plain"] = (recipe, [*common, "eval=[]"])
    for name, (path, args) in runs.items():
        record = Record(out / name / "record")
        cfg = load_recipe(path, [*args, *two, f"run.dir={out / name}"])
        record.write(rank, train(cfg, callbacks=[record], progress_bar=False))
"""
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path]:
    """(the recipe with the eval section, the token cache shared by every run)."""
    tmp = tmp_path_factory.mktemp("eval-distributed")
    pairs = seq2seq_examples()["test"][:4]
    (tmp / "source.txt").write_text("".join(p["source"] + "\n" for p in pairs))
    (tmp / "target.txt").write_text("".join(p["target"] + "\n" for p in pairs))
    suite = SUITE.replace("SOURCE", str(tmp / "source.txt")).replace("TARGET", str(tmp / "target.txt"))
    recipe = tmp / "evaluated.yaml"
    recipe.write_text(f"extends: {RECIPES / 'tiny-unilm.yaml'}\n{suite}")
    return recipe, tmp / "cache"


@pytest.fixture(scope="module")
def single(tmp_path_factory, setup, launcher) -> Path:
    """One process, batch 6: the reference (the launcher imports meanwhile)."""
    recipe, cache = setup
    out = tmp_path_factory.mktemp("single")
    namespace: dict = {}
    exec(_RECORD, namespace)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LIT_TRANSFORMER_CACHE", str(cache))
        record = namespace["Record"](out / "evaluated" / "record")
        cfg = load_recipe(recipe, [*COMMON, *ONE_RANK, f"run.dir={out / 'evaluated'}"])
        record.write(0, train(cfg, callbacks=[record], progress_bar=False))
    return out


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, single, setup, launcher) -> dict[str, Path]:
    """The ddp runs and then the fsdp run, in one 2-process job: {strategy: its folder}."""
    recipe, cache = setup
    args = [str(recipe), json.dumps(COMMON)]
    return two_rank_job(launcher, tmp_path_factory.mktemp("two"), _SCRIPT, args, cache, timeout=500)


@pytest.fixture(scope="module")
def ddp(two_processes) -> Path:
    return two_processes["ddp"]


@pytest.fixture(scope="module")
def fsdp(two_processes) -> Path:
    return two_processes["fsdp"]


def _records(run: Path, ranks: int) -> list[dict]:
    return [json.loads((run / "record" / f"rank{r}.json").read_text()) for r in range(ranks)]


def _numbers(record: dict) -> dict[int, dict[str, float]]:
    """{step: the evaluation numbers of that step}: steps 0 and 2 as held before the steps that
    follow them, the final step's as train() returned them; wall times left out (they differ
    between runs)."""
    held = {int(step): values for step, values in record["held"].items()}
    assert held[1] == held[0]  # no validation at step 1
    steps = {0: held[0], 2: held[2], STEPS: record["returned"]}
    return {
        s: {k: v for k, v in m.items() if k.startswith("eval/") and not k.endswith("/seconds")}
        for s, m in steps.items()
    }


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_every_rank_holds_rank_0s_numbers(request, strategy):
    run = request.getfixturevalue(strategy) / "evaluated"
    a, b = _records(run, 2)
    assert a["held"] == b["held"]  # ==, wall times included: rank 0's numbers were broadcast
    assert a["returned"] == b["returned"]
    assert sorted(int(step) for step in a["held"]) == [0, 1, 2]
    final = json.loads((run / "metrics.json").read_text())
    for key in ("eval/text/clm/loss", "eval/text/mlm/loss", "eval/probe/accuracy", "eval/tuned/accuracy"):
        assert key in final, sorted(final)
    assert final["eval/next_line/examples"] == 12.0 and final["eval/probe/examples"] == 48.0
    assert "eval/mt/bleu" in final, sorted(final)
    assert {k: v for k, v in a["returned"].items() if k.startswith("eval/")} == {
        k: v for k, v in final.items() if k.startswith("eval/")
    }
    # the CSV log (rank 0's) has every evaluation at the initial weights, the validation and the end
    rows = read_metrics(run)
    for name in ("text", "probe", "tuned", "next_line", "mt"):
        assert sorted(int(r["step"]) for r in rows if f"eval/{name}/seconds" in r) == EVAL_STEPS, name


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_evaluate_as_one(request, strategy, single):
    """Training: the global batch's loss equals the one-process run's (test_distributed.py's
    tolerance). Evaluations at each step: heldout metrics within 1e-4 relative (the weights differ
    by float32 round-off, ~1e-5 after three steps at lr 1e-2, see test_distributed.py); accuracies
    within one example, since a prediction whose two best scores are within round-off of each
    other may go either way (the linear probe's L-BFGS and the finetune probe's three steps amplify
    no more than that on 48 rows); the counts of examples exactly."""
    run = request.getfixturevalue(strategy) / "evaluated"
    (reference,) = _records(single / "evaluated", 1)
    a, b = _records(run, 2)
    got = [(x + y) / 2 for x, y in zip(a["losses"], b["losses"])]
    assert len(got) == STEPS and got == pytest.approx(reference["losses"], abs=1e-5, rel=0)
    expected_steps, got_steps = _numbers(reference), _numbers(a)
    assert sorted(got_steps) == EVAL_STEPS
    for step in EVAL_STEPS:
        expected, numbers = expected_steps[step], got_steps[step]
        assert numbers.keys() == expected.keys(), step
        for key, value in numbers.items():
            name, metric = key.split("/", 2)[1:]
            if metric == "examples":
                assert value == expected[key], (step, key)
            elif metric in ("accuracy", "acc", "acc_norm", "acc_bytes"):
                one = 1 / numbers[f"eval/{name}/examples"]
                assert abs(value - expected[key]) <= one + 1e-12, (step, key, value, expected[key])
            elif name == "text":
                assert value == pytest.approx(expected[key], rel=1e-4), (step, key)
    # three steps at lr 1e-2 moved the weights: the numbers compared are not all the initial ones
    assert expected_steps[STEPS]["eval/text/clm/loss"] != expected_steps[0]["eval/text/clm/loss"]


def test_evaluations_do_not_change_ddp_training(ddp):
    evaluated, plain = _records(ddp / "evaluated", 2), _records(ddp / "plain", 2)
    for x, y in zip(evaluated, plain):
        assert len(x["losses"]) == STEPS and x["losses"] == y["losses"]  # ==, not approx
    weights, other = load_file(ddp / "evaluated" / "model.safetensors"), load_file(ddp / "plain" / "model.safetensors")
    assert weights.keys() == other.keys() and all((weights[k] == other[k]).all() for k in weights)
    assert not plain[0]["held"] and not any(k.startswith("eval/") for k in plain[0]["returned"])
