"""Named evaluations: heldout reads one split (the run's own, or a file) without tokenising
training text and computes what training logs; translate decodes and scores; run_suite leaves
training as it found it (RNG streams, train mode) and honours every_n_steps."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import RECIPES, TINY_RUN, seeded_model, tiny_config

from lit_transformer.commands.evaluate import ModelData
from lit_transformer.commands.train import train
from lit_transformer.data.data_config import CAPS, DataConfig
from lit_transformer.data.sources.stdlib import corpus_split, seq2seq_examples
from lit_transformer.data.tokens import prepare
from lit_transformer.data.tokens.tokenizer import SpecialTokens, load_tokenizer
from lit_transformer.errors import RunError
from lit_transformer.evaluation import heldout, translate
from lit_transformer.evaluation.eval_target import EvalTarget
from lit_transformer.evaluation.suite import due, run_suite
from lit_transformer.recipe.eval_schema import EvalConfig
from lit_transformer.recipe.load import load_recipe
from lit_transformer.recipe.tasks import data_plan
from lit_transformer.run.loading import load_for_evaluation, resolve_source
from lit_transformer.run.resolve import evaluation_run

QUICK = [*TINY_RUN, "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.checkpoint_every_n_steps=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A clm, a seq2seq and a UniLM mixture run of two steps each; {name: run dir}."""
    root = tmp_path_factory.mktemp("eval_runs")
    mp = pytest.MonkeyPatch()
    mp.setenv("LIT_TRANSFORMER_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    extra = {
        "tiny-clm": [],
        "tiny-seq2seq": ["data.max_length=24", "data.max_target_length=8", "model.max_seq_len=32"],
        "tiny-unilm": ["model.d_ff=40", "model.n_heads=2"],
    }
    out = {}
    try:
        for name, more in extra.items():
            cfg = load_recipe(RECIPES / f"{name}.yaml", [*QUICK, *more, f"run.dir={root / name}"])
            train(cfg, progress_bar=False)
            out[name] = root / name
        yield out
    finally:
        torch.set_num_threads(threads)
        mp.undo()


def target_of(run: Path) -> tuple[EvalTarget, object]:
    """The run's final model as an EvalTarget, and the run's config with its tokenizer (evaluate's)."""
    source = resolve_source(str(run))
    cfg = evaluation_run(source, str(run))
    tokenizer = load_tokenizer(source.tokenizer)
    special = SpecialTokens.from_tokenizer(tokenizer)
    module = load_for_evaluation(source, cfg, ModelData(tokenizer, special))
    return EvalTarget(model=module.model, tokenizer=tokenizer, special=special, cfg=cfg, module=module), cfg


def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "held.py"
    path.write_text(corpus_split("validation")[0][1].read_text()[:6000])
    return path


def final_metrics(run: Path, prefix: str) -> dict[str, float]:
    """Training's final metrics under `prefix` (val/, test/), named as heldout names them."""
    metrics = json.loads((run / "metrics.json").read_text())
    out = {}
    for key, value in metrics.items():
        if key.startswith(prefix):
            *task, name = key.removeprefix(prefix).split("/")
            out["/".join([*task, heldout.EVALUATE_NAMES.get(name, name)])] = value
    return out


@pytest.fixture
def tokenised(monkeypatch) -> list[str]:
    """The splits written to the token cache from now on (a cache hit writes nothing)."""
    written: list[str] = []
    write = prepare._write_split

    def recording(root, key, source, *args):
        written.append(source.split)
        return write(root, key, source, *args)

    monkeypatch.setattr(prepare, "_write_split", recording)
    return written


def test_heldout_plan_replaces_every_source_key(tmp_path):
    """A heldout file set is read whole and alone: the run's file lists, hub, caps and streaming
    give way to the entry's files, and every mixture task reads the entry's set (none of its own
    DataConfig.SOURCE_KEYS), keeping its other settings; the run's config is left as it was."""
    assert set(DataConfig.SOURCE_KEYS) <= {f.name for f in dataclasses.fields(DataConfig)}
    cfg = load_recipe(RECIPES / "tiny-unilm.yaml", [f"run.dir={tmp_path / 'run'}"])
    own = {key: ["own.txt"] for key in DataConfig.FILE_KEYS}
    caps = dict.fromkeys(CAPS, 5)
    data = dataclasses.replace(cfg.data, **own, **caps, hub_name="hub", streaming=True)
    per_task = {**own, **caps, "hub_name": "hub", "streaming": True, "num_workers": 1}
    assert set(per_task) == set(DataConfig.SOURCE_KEYS)
    tasks = [dataclasses.replace(t, data=dataclasses.replace(t.data, **per_task)) for t in cfg.tasks]
    tasks[0] = dataclasses.replace(tasks[0], data=dataclasses.replace(tasks[0].data, mlm_probability=0.2))
    cfg = dataclasses.replace(cfg, data=data, tasks=tasks)
    before = copy.deepcopy(cfg)
    entry = EvalConfig(name="held", kind="heldout", files=["held.txt"])
    plan = heldout.heldout_plan(entry, cfg)
    out = plan.data
    assert out.train_files == out.val_files == ["held.txt"]  # the training side is never read
    assert all(getattr(out, key) == [] for key in DataConfig.FILE_KEYS if key not in ("train_files", "val_files"))
    assert out.hub_name is None and not out.streaming and all(getattr(out, key) is None for key in CAPS)
    for task in plan.tasks:
        assert all(getattr(task.data, key) == getattr(out, key) for key in DataConfig.SOURCE_KEYS), task.name
    assert plan.tasks[0].data.mlm_probability == 0.2  # the task's own settings stay
    assert cfg == before
    pairs = heldout.heldout_plan(dataclasses.replace(entry, target_files=["held.tgt"]), cfg).data
    assert (pairs.train_files, pairs.val_source_files, pairs.val_target_files) == ([], ["held.txt"], ["held.tgt"])
    own_split = dataclasses.replace(entry, files=[], split="validation")
    assert heldout.heldout_plan(own_split, cfg) == data_plan(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-clm", "tiny-unilm"])
def test_heldout_of_the_runs_split_is_what_training_logged(name, runs, tmp_path, tokenised):
    target, cfg = target_of(runs[name])
    # a cache of its own: the split is tokenised again, and nothing else is
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, cache_dir=str(tmp_path / "cache")))
    two_batches = 2 * (cfg.data.eval_batch_size or cfg.data.batch_size)  # as trainer.limit_val_batches=2
    entry = EvalConfig(name="val", kind="heldout", split="validation", max_examples=two_batches)
    metrics = heldout.build(entry, cfg)(target)
    # one split per pipeline: UniLM's clm and prefix_lm tasks read the same clm blocks
    assert tokenised == ["validation"] * (2 if name == "tiny-unilm" else 1)
    expected = final_metrics(runs[name], "val/")  # the same weights on the same 2 batches
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5), key


@pytest.mark.slow
def test_heldout_of_a_file(runs, tmp_path, tokenised):
    target, cfg = target_of(runs["tiny-clm"])
    path = text_file(tmp_path)
    entry = EvalConfig(name="held", kind="heldout", files=[str(path)])
    metrics = heldout.build(entry, cfg)(target)
    assert set(metrics) == {"loss", "perplexity", "bits_per_byte"} and 0 < metrics["loss"] < 10
    assert tokenised == ["validation"]  # the file, read as the validation split; its training side never
    own = heldout.build(EvalConfig(name="val", kind="heldout", split="validation"), cfg)(target)
    assert metrics["loss"] != pytest.approx(own["loss"])  # other text
    # the run's own bytes per token come back: validation after the evaluation is unchanged
    assert target.module.bytes_per_token == 1.0  # evaluate's stand-in (ModelData)
    capped = heldout.build(dataclasses.replace(entry, max_examples=1), cfg)(target)
    assert capped["loss"] != pytest.approx(metrics["loss"])  # one batch of 3 blocks, not the file's
    with pytest.raises(RunError, match="eval.held: a heldout evaluation computes the objective's loss"):
        heldout.build(entry, cfg)(dataclasses.replace(target, module=None))
    with pytest.raises(RunError, match=r"eval.held.files: no such file or directory"):
        heldout.build(dataclasses.replace(entry, files=[str(tmp_path / "none.txt")]), cfg)
    with pytest.raises(RunError, match=r"eval.test: the run's data has no test split \(the recipe names no"):
        heldout.build(EvalConfig(name="test", kind="heldout", split="test"), cfg)
    with pytest.raises(RunError, match=r"eval.val.task=clm: a clm run is one objective, not a mixture"):
        heldout.build(EvalConfig(name="val", kind="heldout", split="validation", task="clm"), cfg)


@pytest.mark.slow
def test_heldout_of_a_mixture_reports_every_task_or_one(runs, tmp_path):
    target, cfg = target_of(runs["tiny-unilm"])
    entry = EvalConfig(name="held", kind="heldout", files=[str(text_file(tmp_path))])
    metrics = heldout.build(entry, cfg)(target)
    assert {"mlm/loss", "clm/loss", "clm/bits_per_byte", "prefix_lm/loss"} <= set(metrics)
    assert "mlm/bits_per_byte" not in metrics  # a masked loss is no bits per byte
    one = heldout.build(dataclasses.replace(entry, task="clm"), cfg)(target)
    assert one == {k.removeprefix("clm/"): v for k, v in metrics.items() if k.startswith("clm/")}
    with pytest.raises(RunError, match=r"eval.held.task=cml: the mixture's tasks are .*did you mean"):
        heldout.build(dataclasses.replace(entry, task="cml"), cfg)


@pytest.mark.slow
def test_translate_scores_files_and_the_runs_split(runs, tmp_path):
    pairs = seq2seq_examples()["test"][:9]
    (tmp_path / "src.txt").write_text("".join(p["source"] + "\n" for p in pairs))
    (tmp_path / "ref.txt").write_text("".join(p["target"] + "\n" for p in pairs))
    target, cfg = target_of(runs["tiny-seq2seq"])
    entry = EvalConfig(
        name="mt",
        kind="translate",
        files=[str(tmp_path / "src.txt")],
        target_files=[str(tmp_path / "ref.txt")],
        num_beams=2,
        max_new_tokens=6,
    )
    evaluation = translate.build(entry, cfg)
    dtype = next(target.model.parameters()).dtype
    metrics = evaluation(target)
    assert next(target.model.parameters()).dtype == dtype  # decoded in place, not cast
    assert metrics["sentences"] == 9.0 and set(metrics) == {"bleu", "chrf", "sentences"}
    assert evaluation.details["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert evaluation.details["dtype"] == "float32" and evaluation.details["device"] == "cpu"
    # evaluate's flags: a float32 copy on the CPU decodes the same text, in batches of any size
    evaluation.decode_with(batch_size=2, batch_tokens=None, dtype="float32", device="cpu", progress_bar=False)
    assert evaluation(target) == metrics
    own = translate.build(EvalConfig(name="val", kind="translate", split="validation", max_examples=5), cfg)
    assert own(target)["sentences"] == 5.0
    (tmp_path / "short.txt").write_text("one line\n")
    with pytest.raises(RunError, match="has 9 lines but its target_files .*short.txt has 1"):
        translate.build(dataclasses.replace(entry, target_files=[str(tmp_path / "short.txt")]), cfg)
    with pytest.raises(RunError, match=r"eval.mt.target_files: no such file or directory: .*none.txt"):
        translate.build(dataclasses.replace(entry, target_files=[str(tmp_path / "none.txt")]), cfg)
    clm_target, clm_cfg = target_of(runs["tiny-clm"])
    mlm_cfg = dataclasses.replace(clm_cfg, objective=dataclasses.replace(clm_cfg.objective, name="mlm"))
    with pytest.raises(RunError, match="kind translate needs a model that writes text.*a mlm decoder model does not"):
        translate.build(entry, mlm_cfg)
    with pytest.raises(RunError, match=r"eval.val.split=validation: the split of this clm run holds no sentence pairs"):
        translate.build(EvalConfig(name="val", kind="translate", split="validation"), clm_cfg)


# ----------------------------------------------------------------------------- run_suite


class Noisy:
    """An evaluation that draws from every RNG stream and puts the model in train mode."""

    def __init__(self, name: str, every_n_steps: int | None = None):
        self.entry = EvalConfig(name=name, kind="heldout", files=["unused.txt"], every_n_steps=every_n_steps)
        self.calls = 0

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        self.calls += 1
        assert not target.model.training and not torch.is_grad_enabled()
        target.model.train()
        return {"draw": float(torch.rand(()) + np.random.rand() + random.random())}


def frozen(model: torch.nn.Module) -> torch.nn.Module:
    return list(model.modules())[1]


def bare_target() -> EvalTarget:
    model = seeded_model(tiny_config("decoder"))
    model.train()
    frozen(model).eval()  # a frozen submodule keeps its own mode
    return EvalTarget(model=model, tokenizer=None, special=None, cfg=None)  # type: ignore[arg-type]


def test_run_suite_restores_rng_streams_and_modes():
    target = bare_target()
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    without = (torch.rand(4), np.random.rand(), random.random())
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    out = run_suite([Noisy("a"), Noisy("b")], target, step=10)
    assert torch.equal(torch.rand(4), without[0])
    assert np.random.rand() == without[1] and random.random() == without[2]
    assert set(out) == {"eval/a/draw", "eval/a/seconds", "eval/b/draw", "eval/b/seconds"}
    assert out["eval/a/seconds"] > 0
    assert target.model.training and not frozen(target.model).training


def test_every_n_steps_and_the_final_run():
    target = bare_target()
    every, always = Noisy("every", every_n_steps=4), Noisy("always")
    assert not due(every, 6, False) and due(every, 8, False) and due(every, 6, True) and due(always, 6, False)
    assert set(run_suite([every, always], target, step=6)) == {"eval/always/draw", "eval/always/seconds"}
    assert "eval/every/draw" in run_suite([every, always], target, step=6, final=True)
    assert "eval/every/draw" in run_suite([every, always], target, step=8)
    assert every.calls == 2 and always.calls == 3


def test_an_evaluation_that_raises_still_restores():
    target = bare_target()

    class Broken(Noisy):
        def __call__(self, target):
            torch.rand(5)
            target.model.train()
            raise RunError("broken")

    state = torch.get_rng_state()
    with pytest.raises(RunError, match="broken"):
        run_suite([Broken("x")], target)
    assert torch.equal(torch.get_rng_state(), state)
    assert not frozen(target.model).training
