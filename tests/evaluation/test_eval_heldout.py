"""Named evaluations: heldout and translate measure what `evaluate` measures on the same files,
and run_suite leaves training as it found it (RNG streams, train mode) and honours every_n_steps."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import RECIPES, TINY_RUN, seeded_model, tiny_config

from lit_transformer.commands.inference import evaluate
from lit_transformer.commands.loading import load_for_evaluation, resolve_source
from lit_transformer.commands.train import data_module, train
from lit_transformer.data.sources.stdlib import corpus_split, seq2seq_examples
from lit_transformer.data.tokens.tokenizer import SpecialTokens, load_tokenizer
from lit_transformer.errors import RunError
from lit_transformer.evaluation import heldout, translate
from lit_transformer.evaluation.eval_target import EvalTarget
from lit_transformer.evaluation.suite import due, run_suite
from lit_transformer.recipe.eval_schema import EvalConfig
from lit_transformer.recipe.load import load_recipe

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
    """The run's final model as an EvalTarget, and the run's config with its tokenizer."""
    source = resolve_source(str(run))
    cfg = dataclasses.replace(
        source.run_config, tokenizer=dataclasses.replace(source.run_config.tokenizer, path=str(source.tokenizer))
    )
    module = load_for_evaluation(source, cfg, data_module(cfg, None))
    tokenizer = load_tokenizer(source.tokenizer)
    special = SpecialTokens.from_tokenizer(tokenizer)
    return EvalTarget(model=module.model, tokenizer=tokenizer, special=special, cfg=cfg, module=module), cfg


def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "held.py"
    path.write_text(corpus_split("validation")[0][1].read_text()[:6000])
    return path


@pytest.mark.slow
def test_heldout_equals_evaluate_on_the_same_file(runs, tmp_path):
    target, cfg = target_of(runs["tiny-clm"])
    path = text_file(tmp_path)
    entry = EvalConfig(name="held", kind="heldout", files=[str(path)])
    metrics = heldout.build(entry, cfg)(target)
    expected = evaluate(str(runs["tiny-clm"]), data=str(path), progress_bar=False)
    assert set(metrics) == {"loss", "perplexity", "bits_per_byte"}
    assert metrics["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert metrics["bits_per_byte"] == pytest.approx(expected["bits_per_byte"], rel=1e-5)
    # the run's own bytes per token come back: validation after the evaluation is unchanged
    assert target.module.bytes_per_token == pytest.approx(target_of(runs["tiny-clm"])[0].module.bytes_per_token)
    capped = heldout.build(dataclasses.replace(entry, max_examples=1), cfg)(target)
    assert capped["loss"] != pytest.approx(metrics["loss"])  # one batch of 3 blocks, not the file's
    with pytest.raises(RunError, match="eval.held: a heldout evaluation computes the objective's loss"):
        heldout.build(entry, cfg)(dataclasses.replace(target, module=None))
    with pytest.raises(RunError, match=r"eval.held.files: no such file or directory"):
        heldout.build(dataclasses.replace(entry, files=[str(tmp_path / "none.txt")]), cfg)


@pytest.mark.slow
def test_heldout_of_a_mixture_reports_every_task(runs, tmp_path):
    target, cfg = target_of(runs["tiny-unilm"])
    path = text_file(tmp_path)
    metrics = heldout.build(EvalConfig(name="held", kind="heldout", files=[str(path)]), cfg)(target)
    expected = evaluate(str(runs["tiny-unilm"]), data=str(path), progress_bar=False)
    assert {"mlm/loss", "clm/loss", "clm/bits_per_byte", "prefix_lm/loss"} <= set(metrics)
    for key, value in metrics.items():
        assert value == pytest.approx(expected[key], rel=1e-5), key


@pytest.mark.slow
def test_translate_gives_evaluates_bleu(runs, tmp_path):
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
    expected = evaluate(
        str(runs["tiny-seq2seq"]),
        data=str(tmp_path / "src.txt"),
        data_target=str(tmp_path / "ref.txt"),
        num_beams=2,
        max_new_tokens=6,
        dtype="float32",
        progress_bar=False,
    )
    assert metrics == {"bleu": expected["bleu"], "chrf": expected["chrf"], "sentences": 9.0}
    assert evaluation.signatures["bleu_signature"] == expected["bleu_signature"]
    (tmp_path / "short.txt").write_text("one line\n")
    with pytest.raises(RunError, match="has 9 lines but its target_files .*short.txt has 1"):
        translate.build(dataclasses.replace(entry, target_files=[str(tmp_path / "short.txt")]), cfg)
    with pytest.raises(RunError, match=r"eval.mt.target_files: no such file or directory: .*none.txt"):
        translate.build(dataclasses.replace(entry, target_files=[str(tmp_path / "none.txt")]), cfg)
    clm_target, clm_cfg = target_of(runs["tiny-clm"])
    mlm_cfg = dataclasses.replace(clm_cfg, objective=dataclasses.replace(clm_cfg.objective, name="mlm"))
    with pytest.raises(RunError, match="kind translate needs a model that writes text.*a mlm decoder model does not"):
        translate.build(entry, mlm_cfg)


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
