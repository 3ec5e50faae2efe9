"""Multi-task pretraining end to end: a mixture of one task is the single objective, a resumed
mixture continues exactly, and one mixture checkpoint serves evaluate (per task), generate,
export and finetune (a decoder classifying through its bidirectional mode)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from helpers import (
    KEYWORD_FINETUNE,
    RECIPES,
    TINY_RUN,
    StopAt,
    assert_learned_keywords,
    assert_tuned_from,
    keyword_task,
)
from lightning.pytorch.callbacks import Callback

from lit_transformer.commands.cli import main
from lit_transformer.commands.train import train
from lit_transformer.recipe.load import RecipeError, load_recipe

pytestmark = pytest.mark.slow

# tiny and deterministic: no dropout, validation every 3 steps on 2 batches; blocks, model and
# vocabulary a little larger than TINY_RUN's
COMMON = [
    *TINY_RUN,
    "tokenizer.vocab_size=400",
    "tokenizer.max_train_bytes=200000",
    "data.max_train_bytes=200000",
    "data.max_val_bytes=30000",
    "data.block_size=48",
    "data.batch_size=4",
    "model.d_model=32",
    "model.d_ff=64",
    "model.n_layers=2",
    "model.dropout=0.0",
    "optim.warmup_steps=0",
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.checkpoint_every_n_steps=3",
]


class Record(Callback):
    """The loss and task of every training batch (per-row mixing: the task of every row)."""

    def __init__(self):
        self.steps: list[tuple[int, float, int | tuple | None]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        task = int(batch["task"]) if "task" in batch else None
        if "row_task" in batch:
            task = tuple(batch["row_task"].tolist())
        self.steps.append((trainer.global_step, float(outputs["loss"]), task))


class LogCalls(Callback):
    """(global step, name) of every `self.log` the objective makes while training."""

    def __init__(self):
        self.calls: list[tuple[int, str]] = []

    def setup(self, trainer, pl_module, stage):
        log = pl_module.log

        def spy(name, *args, **kwargs):
            if trainer.training:
                self.calls.append((trainer.global_step, name))
            return log(name, *args, **kwargs)

        pl_module.log = spy


def assert_step_metrics_on_logging_steps_only(
    calls: list[tuple[int, str]], every: int, tasks_of_step: dict[int, list[str]], tasks: list[str]
) -> None:
    """Lightning writes a training step's metrics every `every` optimizer steps and drops the rest:
    between those steps only the progress bar's train/loss is logged (objective_base.writes_step_metrics),
    and a logging step logs every task that trained since the last one (tasks_of_step: step -> tasks)."""
    # the Throughput callback logs at the end of a step, global_step already counting it: left out
    calls = [(s, name) for s, name in calls if name not in ("train/tokens_per_s", "train/tokens_seen", "train/mfu")]
    steps = sorted({step for step, _ in calls})
    assert len(steps) >= 2 * every
    for step in steps:
        names = {name for s, name in calls if s == step}
        if (step + 1) % every:
            assert names == {"train/loss"}, (step, names)
            continue
        assert {"train/lr", "train/grad_norm", *(f"train/{t}/step_share" for t in tasks)} <= names, (step, names)
        trained = {t for s in range(step + 1 - every, step + 1) for t in tasks_of_step[s]}
        assert {n for n in names if n.endswith("/loss")} - {"train/loss"} == {f"train/{t}/loss" for t in trained}


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LIT_TRANSFORMER_CACHE", str(tmp_path_factory.getbasetemp() / "multitask-cache"))


def _mixture_of(tmp_path: Path, recipe: str, objective: str) -> Path:
    path = tmp_path / f"one-{objective}.yaml"
    path.write_text(
        f"extends: {RECIPES / recipe}.yaml\nobjective: {{name: mixture}}\n"
        f"tasks: [{{name: only, objective: {objective}}}]\n"
    )
    return path


@pytest.mark.parametrize("recipe, objective", [("tiny-clm", "clm"), ("tiny-span", "span"), ("tiny-mlm", "mlm")])
def test_a_mixture_of_one_task_reproduces_the_single_objective(tmp_path, recipe, objective):
    single, mixture = Record(), Record()
    train(
        load_recipe(RECIPES / f"{recipe}.yaml", [*COMMON, f"run.dir={tmp_path / 'single'}"]),
        callbacks=[single],
        progress_bar=False,
    )
    cfg = load_recipe(_mixture_of(tmp_path, recipe, objective), [*COMMON, f"run.dir={tmp_path / 'mixture'}"])
    assert cfg.objective.name == "mixture" and len(cfg.tasks) == 1
    train(cfg, callbacks=[mixture], progress_bar=False)
    assert len(single.steps) == 6
    assert [loss for _, loss, _ in mixture.steps] == [loss for _, loss, _ in single.steps]
    metrics = json.loads((tmp_path / "mixture" / "metrics.json").read_text())
    reference = json.loads((tmp_path / "single" / "metrics.json").read_text())
    assert metrics["val/only/loss"] == pytest.approx(reference["val/loss"], abs=1e-6)


# tiny-gptbert: per-row mixing, and an mntp mask rate that falls with the step (0.30 -> 0.15 over the 6)
@pytest.mark.parametrize("recipe", ["tiny-unilm", "tiny-gptbert"])
def test_a_resumed_mixture_continues_exactly(tmp_path, recipe):
    args = [*COMMON, "trainer.checkpoint_every_n_steps=1", "trainer.log_every_n_steps=2"]
    straight, logs = Record(), LogCalls()
    train(
        load_recipe(RECIPES / f"{recipe}.yaml", [*args, f"run.dir={tmp_path / 'straight'}"]),
        callbacks=[straight, logs],
        progress_bar=False,
    )
    tasks = {"tiny-unilm": ["mlm", "clm", "prefix_lm"], "tiny-gptbert": ["clm", "mntp"]}[recipe]
    # gptbert's steps train every task's rows; unilm's one task each
    trained = {step - 1: tasks if isinstance(task, tuple) else [tasks[task]] for step, _, task in straight.steps}
    assert_step_metrics_on_logging_steps_only(logs.calls, 2, trained, tasks)
    first, second = Record(), Record()
    resumed = [*args, f"run.dir={tmp_path / 'resumed'}"]
    train(load_recipe(RECIPES / f"{recipe}.yaml", resumed), callbacks=[first, StopAt(3)], progress_bar=False)
    train(load_recipe(RECIPES / f"{recipe}.yaml", [*resumed, "resume=auto"]), callbacks=[second], progress_bar=False)
    assert [s[2] for s in first.steps] + [s[2] for s in second.steps] == [s[2] for s in straight.steps]
    # both tasks train: in the draws of steps (unilm), in the rows of every batch (gptbert: 3 causal, 1 masked)
    seen = {task for step in straight.steps for task in (step[2] if isinstance(step[2], tuple) else (step[2],))}
    assert len(seen) > 1, straight.steps
    assert [s[1] for s in first.steps + second.steps] == pytest.approx([s[1] for s in straight.steps], abs=1e-6)


@pytest.fixture(scope="module")
def unilm(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("unilm") / "run"
    cache = tmp_path_factory.getbasetemp() / "multitask-cache"
    import os

    before = os.environ.get("LIT_TRANSFORMER_CACHE")
    os.environ["LIT_TRANSFORMER_CACHE"] = str(cache)
    try:
        train(
            load_recipe(RECIPES / "tiny-unilm.yaml", [*COMMON, "trainer.max_steps=9", f"run.dir={run}"]),
            progress_bar=False,
        )
    finally:
        if before is None:
            os.environ.pop("LIT_TRANSFORMER_CACHE")
        else:
            os.environ["LIT_TRANSFORMER_CACHE"] = before
    return run


def test_every_task_is_logged_and_kept_in_metrics(unilm):
    metrics = json.loads((unilm / "metrics.json").read_text())
    for task in ("mlm", "clm", "prefix_lm"):
        assert metrics[f"val/{task}/loss"] > 0
        # bits per byte where the loss predicts the text in order, not for masked tokens
        assert (f"val/{task}/bpb" in metrics) == (task != "mlm")
    assert 0 < metrics["val/mlm/masked_accuracy"] <= 1
    with open(unilm / "csv" / "version_0" / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    shares = [r for r in rows if r.get("train/clm/step_share")]
    last = shares[-1]
    total = sum(float(last[f"train/{t}/step_share"]) for t in ("mlm", "clm", "prefix_lm"))
    assert total == pytest.approx(1.0)
    assert any(r.get("train/mlm/accuracy") for r in rows) and any(r.get("train/prefix_lm/bpb") for r in rows)
    assert not any(r.get("train/mlm/bpb") for r in rows)


def test_evaluate_reports_every_task_or_one(unilm, capsys):
    assert main(["evaluate", str(unilm), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    out = {k.removeprefix("eval/validation/"): v for k, v in printed.items() if k.startswith("eval/validation/")}
    metrics = json.loads((unilm / "metrics.json").read_text())
    assert printed["objective"] == "mixture"
    assert out["clm/bits_per_byte"] > 0 and out["mlm/accuracy"] >= 0 and "prefix_lm/perplexity" in out
    assert "prefix_lm/bits_per_byte" in out and "mlm/bits_per_byte" not in out
    # the whole validation split, where training's validation saw 2 batches: same kind of number
    assert abs(out["clm/loss"] - metrics["val/clm/loss"]) < 0.5
    assert main(["evaluate", str(unilm), "--json", "--task", "clm", "--max-batches", "2"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert {k for k in one if k.startswith("eval/")} == {
        f"eval/validation/{name}" for name in ("loss", "perplexity", "bits_per_byte", "seconds")
    }
    assert one["eval/validation/loss"] == pytest.approx(metrics["val/clm/loss"], abs=1e-5)  # the same 2 batches
    assert main(["evaluate", str(unilm), "--task", "cml"]) == 2
    assert "did you mean" in capsys.readouterr().err


def test_generate_and_export_read_the_mixture(unilm, tmp_path, capsys):
    args = ["generate", str(unilm), "--prompt", "def main(", "--greedy", "--max-new-tokens", "8", "--continuation-only"]
    assert main(args) == 0
    causal = capsys.readouterr().out
    assert main([*args, "--bidirectional-prompt"]) == 0
    assert capsys.readouterr().out.strip() != "" and causal.strip() != ""
    assert main(["export", str(unilm), str(tmp_path / "hf")]) == 0
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    from lit_transformer.run.loading import load_language_model, resolve_source

    ours = load_language_model(resolve_source(str(unilm))).eval()
    ids = torch.randint(5, 300, (3, 7))
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, ours(ids), atol=1e-4)


def test_finetune_classifies_through_the_bidirectional_mode(unilm, tmp_path):
    out = tmp_path / "classify"
    cfg = load_recipe(
        RECIPES / "tiny-classify-from-pretrained.yaml",
        [
            f"finetune.from={unilm}",
            *keyword_task(tmp_path / "keywords"),
            *KEYWORD_FINETUNE,
            "logger.wandb.mode=disabled",
            "trainer.accelerator=cpu",
            f"run.dir={out}",
        ],
    )
    metrics = train(cfg, progress_bar=False)
    assert_learned_keywords(metrics)
    assert_tuned_from(unilm, out)
    assert "attention: bidirectional" in (out / "config.yaml").read_text()
    assert json.loads((out / "classifier.json").read_text())["attention"] == "bidirectional"


def test_ul2_trains_every_denoiser_and_generates_with_a_mode_token(tmp_path, capsys):
    run = tmp_path / "ul2"
    cfg = load_recipe(RECIPES / "tiny-ul2.yaml", [*COMMON, "data.block_size=64", f"run.dir={run}"])
    assert cfg.tokenizer.extra_special_tokens == ["[NLU]", "[NLG]", "[S2S]"]
    train(cfg, progress_bar=False)
    metrics = json.loads((run / "metrics.json").read_text())
    assert {k.split("/")[1] for k in metrics if k.endswith("/loss")} == {t.name for t in cfg.tasks}
    assert (
        main(
            [
                "generate",
                str(run),
                "--prompt",
                "import os",
                "--greedy",
                "--max-new-tokens",
                "5",
                "--mode-token",
                "[S2S]",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "x", "--mode-token", "[XYZ]"]) == 2
    assert "[XYZ]" in capsys.readouterr().err


def test_bad_mixtures_are_one_line_errors(tmp_path):
    def recipe(body: str) -> Path:
        path = tmp_path / "r.yaml"
        path.write_text(f"extends: {RECIPES / 'tiny-unilm.yaml'}\n{body}\n")
        return path

    with pytest.raises(RecipeError, match=r"tasks\[0\] \(a\): unknown key objectve \(did you mean `objective`\?\)"):
        load_recipe(recipe("tasks: [{name: a, objectve: clm}]"))
    with pytest.raises(RecipeError, match="used twice"):
        load_recipe(recipe("tasks: [{name: a, objective: clm}, {name: a, objective: mlm}]"))
    with pytest.raises(RecipeError, match=r"tasks\.a\.objective=span needs model\.arch in \['encoder_decoder'\]"):
        load_recipe(recipe("tasks: [{name: a, objective: span}]"))
    with pytest.raises(RecipeError, match="noise_density applies to objective span, not clm"):
        load_recipe(recipe("tasks: [{name: a, objective: clm, noise_density: 0.3}]"))
    with pytest.raises(RecipeError, match="objective.name=clm and tasks are both set"):
        load_recipe(recipe("objective: {name: clm}"))
    with pytest.raises(RecipeError, match=r"unknown key data\.block_sise"):
        load_recipe(recipe("tasks: [{name: a, objective: clm, data: {block_sise: 3}}]"))


def test_t5_style_mixture_of_span_corruption_and_a_supervised_task(tmp_path, capsys):
    """Raffel et al. 2020, 3.5: unsupervised span corruption on the corpus beside a supervised
    seq2seq task on its own data (the embedded docstring -> name pairs), examples-proportional."""
    recipe = tmp_path / "t5-mixture.yaml"
    recipe.write_text(
        f"extends: {RECIPES / 'tiny-span.yaml'}\nobjective: {{name: mixture}}\n"
        "mixture: {rates: proportional, cap: 500}\n"
        "tasks:\n  - {name: span, objective: span}\n"
        "  - {name: summary, objective: seq2seq, data: {max_length: 48, max_target_length: 16}}\n"
    )
    run = tmp_path / "run"
    record = Record()
    train(load_recipe(recipe, [*COMMON, f"run.dir={run}"]), callbacks=[record], progress_bar=False)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["val/span/loss"] > 0 and metrics["val/summary/token_accuracy"] >= 0
    assert main(["evaluate", str(run), "--json", "--task", "summary", "--max-batches", "1"]) == 0
    assert "eval/validation/accuracy" in json.loads(capsys.readouterr().out)


def test_prepare_fills_every_tasks_cache(tmp_path, capsys):
    run = tmp_path / "prepared"
    assert main(["prepare", str(RECIPES / "tiny-ul2.yaml"), *COMMON, "data.block_size=64", f"run.dir={run}"]) == 0
    out = capsys.readouterr().out
    assert (run / "tokenizer.json").is_file() and (run / "config.yaml").is_file()
    for task in ("r_3_15", "x_64_50", "s_prefix"):
        assert any(line.startswith(task) and "train" in line for line in out.splitlines()), out
