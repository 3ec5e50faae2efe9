"""Every shipped recipe under every strategy: the recipes are the test.

A feature a recipe turns on must run in that recipe under DDP and FSDP. The tiny recipes' eval
sections once crashed FSDP (the step-0 classify probe made a Block its own FSDP root) while
every test passed, because the distributed tests ran their own trimmed configurations. So here:

- every CPU recipe (the tiny ones, speedrun-clm, small-corpus-translation, minilm-classify)
  trains a few steps on 2 gloo processes under `ddp` and under `fsdp` through the command line,
  as shipped: its eval section (each entry capped to a few examples, its kind, mode token and
  options kept), its sample generation, its precision, its averaging and its `auto` sizing.
  Only sizes change (SHRINK): less text, fewer steps, shorter generations. One 2-process job
  (tests/launcher.py forks its ranks) trains every recipe under ddp, then under fsdp; each test
  reads one recipe's run directory.
- every paper-scale recipe builds its objective on the meta device under both strategies, and
  under fsdp is sharded as configure_model shards it (on a fake 2-rank process group: shapes only).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
from helpers import EVAL_EXAMPLES, RECIPES, capped_recipe
from option_pairs import assert_evaluations_ran

from lit_transformer.data.tokens.tokenizer import SpecialTokens
from lit_transformer.recipe import registry
from lit_transformer.recipe.load import load_recipe
from lit_transformer.recipe.schema import RunConfig
from lit_transformer.training.rundir import read_metrics

ALL = sorted(p.stem for p in RECIPES.glob("*.yaml"))
# GPU-scale recipes (base/paper.yaml): built on the meta device, never trained here
PAPER_SCALE = (
    "bert-base-mlm",
    "gpt2-small-clm",
    "llama-style-clm",
    "t5-base-span",
    "transformer-base-wmt",
    "transformer-big-wmt",
    "ul2-base",
    "unilm-base",
    "gptbert-base",
)
CPU_RECIPES = tuple(name for name in ALL if name not in PAPER_SCALE)
STRATEGIES = ("ddp", "fsdp")
# named evaluations on the initial weights (step 0) and at the validation on the final weights
STEPS = 2
# tiny-classify-from-pretrained fine-tunes a tiny-mlm run: the matrix's own, of the same strategy
FROM_RUN = {"tiny-classify-from-pretrained": "tiny-mlm"}

# Sizes only: what makes a few steps of each recipe take seconds. Nothing here turns a feature
# on or off: precision, generation, evaluations, averaging, auto sizing and compile stay the recipe's.
SHRINK = [
    "tokenizer.max_train_bytes=150000",
    "data.max_train_bytes=150000",
    "data.max_val_bytes=20000",
    "data.batch_size=4",  # per device
    f"trainer.max_steps={STEPS}",
    f"trainer.val_check_interval={STEPS}",
    f"trainer.checkpoint_every_n_steps={STEPS}",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "trainer.num_threads=1",
    "generation.max_new_tokens=4",
    "generation.num_prompts=2",
]


@functools.cache
def shipped(name: str) -> RunConfig:
    """The recipe as shipped, read once."""
    return load_recipe(RECIPES / f"{name}.yaml")


def refused(name: str, strategy: str) -> str | None:
    """The key a recipe's one-line refusal names under `strategy`, or None where it trains.
    Muon orthogonalises whole weight matrices, which FSDP2 shards (docs/scaling.md)."""
    if strategy == "fsdp" and shipped(name).optim.optimizer == "muon":
        return "optim.optimizer=muon"
    return None


def shrink(name: str) -> list[str]:
    """SHRINK, and the recipe-specific sizes: a token batch and BLEU's sentences for translation,
    a checkpoint every step where the recipe averages the last ones (so that two are averaged)."""
    cfg = shipped(name)
    out = list(SHRINK)
    if cfg.trainer.average_last:
        out.append("trainer.checkpoint_every_n_steps=1")
    if cfg.data.batch_tokens is not None:
        out.append("data.batch_tokens=256")
    if cfg.objective.name == "seq2seq" and cfg.objective.bleu:
        out.append("objective.bleu_sentences=4")
    return out


def commands(strategy: str, out: Path) -> list[list[str]]:
    """The command line of each CPU recipe under `strategy`, in CPU_RECIPES order (a run that
    another fine-tunes comes before it)."""
    order = sorted(CPU_RECIPES, key=lambda name: name in FROM_RUN)
    out_args = []
    for name in order:
        command = "finetune" if shipped(name).objective.name == "classify" else "pretrain"
        args = [command, str(capped_recipe(RECIPES / f"{name}.yaml", out)), *shrink(name), f"run.dir={out / name}"]
        args += [f"trainer.strategy={strategy}", "trainer.devices=2", "trainer.accelerator=cpu"]
        if name in FROM_RUN:
            args.append(f"finetune.from={out / FROM_RUN[name]}")
        out_args.append(args)
    return out_args


# A refusal (status 2) is the same on both ranks and comes before anything is spawned or
# written: its error line goes to <run dir>.refused and the next recipe starts. Any other
# failure ends the job.
_SCRIPT = r"""
import contextlib
import io
import json
import sys
from pathlib import Path

from lit_transformer.commands.cli import main

for args in json.loads(Path(sys.argv[1]).read_text()):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(args)
    sys.stderr.write(err.getvalue())
    if code == 2:
        run_dir = next(a.split("=", 1)[1] for a in args if a.startswith("run.dir="))
        Path(run_dir + ".refused").write_text(err.getvalue())
    elif code != 0:
        raise SystemExit(f"exit status {code}: {' '.join(args)}")
"""


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, launcher) -> tuple[Path, str]:
    """(the folder of the runs, what went wrong or ""): every recipe under each strategy in turn,
    all in one 2-process job; a failure is kept, not raised, so that each recipe's test says what
    it did."""
    out = tmp_path_factory.mktemp("recipes")
    every = [args for strategy in STRATEGIES for args in commands(strategy, out / strategy)]
    (out / "commands.json").write_text(json.dumps(every))
    (out / "run.py").write_text(_SCRIPT)
    try:
        launcher.run(out / "run.py", [str(out / "commands.json")], tmp_path_factory.getbasetemp() / "cache", out, 900)
    except AssertionError as error:
        return out, str(error)
    return out, ""


def test_every_recipe_is_in_one_list():
    assert set(PAPER_SCALE) <= set(ALL) and CPU_RECIPES, "a recipe named here was removed"
    for name in CPU_RECIPES:  # the matrix trains it: a GPU-scale recipe would not finish
        assert "paper.yaml" not in (RECIPES / f"{name}.yaml").read_text(), name


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", CPU_RECIPES)
def test_recipe_trains_as_shipped(matrix, name, strategy):
    out, failure = matrix
    run_dir, refusal_file = out / strategy / name, out / strategy / f"{name}.refused"
    refusal = refused(name, strategy)
    if refusal is not None:  # one line naming the key, and nothing written
        err = refusal_file.read_text().strip()
        assert err.startswith("error: ") and "\n" not in err and refusal in err, err
        assert not run_dir.exists()
        return
    said = refusal_file.read_text().strip() if refusal_file.is_file() else failure
    finished = (run_dir / "metrics.json").is_file() and not refusal_file.is_file()
    assert finished, f"{name} under {strategy} did not finish: {said}"
    cfg = load_recipe(run_dir / "config.yaml")
    assert cfg.trainer.strategy == strategy and cfg.trainer.max_steps == STEPS
    metrics = json.loads((run_dir / "metrics.json").read_text())
    val_losses = [v for k, v in metrics.items() if k.startswith("val/") and k.endswith("loss")]  # a mixture's per task
    assert val_losses and all(map(math.isfinite, val_losses)), metrics
    rows = read_metrics(run_dir)
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == STEPS and all(map(math.isfinite, losses)), losses
    # every entry of the shipped eval section (the recipe file's, none dropped) ran on the initial
    # weights and at the validation on the final weights (again on averaged ones), and its final
    # numbers are in metrics.json, each over its capped number of examples
    assert_evaluations_ran(RECIPES / f"{name}.yaml", run_dir, [0, STEPS])
    for entry in cfg.eval:
        assert metrics[f"eval/{entry.name}/examples"] == EVAL_EXAMPLES[entry.kind], (entry.name, metrics)
    if cfg.generation.enabled and registry.spec(cfg.objective.name).generative(cfg.model.arch):  # one per validation
        entries = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
        assert [e["step"] for e in entries] == [STEPS]
    if cfg.objective.name == "seq2seq" and cfg.objective.bleu:
        assert "val/bleu" in metrics, metrics
    if cfg.trainer.average_last:
        assert (run_dir / "averaged.json").is_file()


# ----------------------------------------------------------------------------- paper scale


@pytest.fixture
def fake_two_ranks():
    """A fake process group of 2 ranks (no communication; collectives return at once), so FSDP2
    shards as on two devices: each parameter's local shard is half its rows."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield torch.distributed.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    finally:
        dist.destroy_process_group()


class _DataShape:
    """What an objective reads of its data module when it is built (no text is read here)."""

    bytes_per_token = 4.0
    tokenizer = None
    special_tokens = SpecialTokens(pad_id=0, unk_id=1, bos_id=2, eos_id=3, cls_id=2, sep_id=3, mask_id=4)

    def bytes_per_token_of(self, task: int) -> float:
        return self.bytes_per_token


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", PAPER_SCALE)
def test_paper_recipe_builds_under_strategy(request, monkeypatch, name, strategy):
    """The objective a paper recipe trains, built as commands/train.py builds it (the registry, a meta
    model under fsdp); under fsdp configure_model's sharding applied with every Block its own
    unit, nothing allocated (materialize, which allocates, is stubbed out)."""
    from torch.distributed.tensor import DTensor

    from lit_transformer.commands.train import build_objective
    from lit_transformer.model.transformer import Block
    from lit_transformer.run.resolve import resolve_run
    from lit_transformer.training import distributed

    run = resolve_run(
        load_recipe(RECIPES / f"{name}.yaml", [f"trainer.strategy={strategy}", "trainer.devices=8"]), training=False
    )
    cfg, model = run.config, run.model
    data = _DataShape()
    if strategy == "ddp":
        from lit_transformer.model.language_model import LanguageModel

        model = LanguageModel.from_config(model, device="meta")
    module = build_objective(cfg, model, data)
    assert all(p.is_meta for p in module.parameters())
    if strategy == "fsdp":
        from torch.distributed.fsdp import FSDPModule

        mesh = request.getfixturevalue("fake_two_ranks")
        monkeypatch.setattr(distributed, "materialize", lambda module, device: None)
        distributed.prepare_blocks(module, activation_checkpointing=False, compile=False, mesh=mesh)
        blocks = [m for m in module.modules() if isinstance(m, Block)]
        assert blocks and all(isinstance(b, FSDPModule) for b in blocks)
        assert all(isinstance(p, DTensor) for p in module.parameters())


def test_a_part_of_the_model_may_run_first_inside_gathered_parameters(fake_two_ranks):
    """The cause of the crash the matrix found: before the first training step, the classify
    probe runs the backbone (`model.transformer`), not the model, inside gathered_parameters.
    FSDP2 made the first Block it ran its own root, and the training step's forward through the
    model then raised "FSDP state has already been lazily initialized"."""
    from helpers import tiny_config

    from lit_transformer.objectives.causal_lm import CausalLM
    from lit_transformer.training.distributed import gathered_parameters, meta_language_model, prepare_blocks

    module = CausalLM(meta_language_model(tiny_config("decoder")))
    prepare_blocks(module, activation_checkpointing=False, compile=False, mesh=fake_two_ranks)
    ids = torch.randint(0, module.model.config.vocab_size, (3, 7))
    with torch.no_grad():
        with gathered_parameters(module):
            assert module.model.transformer(ids).shape == (3, 7, module.model.config.d_model)
        assert module.model(ids).shape == (3, 7, module.model.config.vocab_size)  # the step's forward
