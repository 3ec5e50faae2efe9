"""Start-up checks (training/preflight.py): a recipe that asks for more devices, cores or memory than the
machine has stops before anything is written or spawned, in one line naming the keys to change.
The machine is faked (cores, GPUs, available memory) so the tests say the same on any host."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import RECIPES

from lit_transformer.commands.cli import main
from lit_transformer.errors import RecipeError
from lit_transformer.recipe.load import load_recipe
from lit_transformer.recipe.model_section import longest_input, model_config
from lit_transformer.training import preflight

GiB = 1 << 30


@pytest.fixture
def machine(monkeypatch):
    """A 2-core, 24 GiB machine without GPUs (the CI machine); tests change what they need."""
    spec = {"cores": 2, "gpus": 0, "memory": 24 * GiB, "gpu_memory": 80 * GiB}
    monkeypatch.setattr(preflight, "cpu_cores", lambda: spec["cores"])
    monkeypatch.setattr(preflight, "gpu_count", lambda: spec["gpus"])
    monkeypatch.setattr(preflight, "available_memory", lambda: spec["memory"])
    monkeypatch.setattr(preflight, "gpu_memory", lambda: spec["gpu_memory"])
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):  # a test run inside a Slurm job is local rank 0 too
        monkeypatch.delenv(name, raising=False)
    return spec


def check(cfg) -> None:
    """The checks as `pretrain` runs them: on the sections and values it resolves from the recipe."""
    preflight.check(cfg.trainer, cfg.data, model_config(cfg), longest_input(cfg)[1])


def capped(cfg) -> int:
    return preflight.capped_workers(cfg.trainer, cfg.data.num_workers)


def trainer(tmp_path, *overrides):
    return wmt(tmp_path, *overrides).trainer


def estimate(cfg, model=None) -> preflight.MemoryEstimate:
    return preflight.estimate(cfg.trainer, cfg.data, model or model_config(cfg), longest_input(cfg)[1])


def translation_files(root: Path) -> list[str]:
    """The translation example's keys (docs/data.md), on a few aligned sentence pairs."""
    files = {}
    for name, lines in (
        ("train.en", ["a small house", "the red car"] * 20),
        ("train.de", ["ein kleines haus", "das rote auto"] * 20),
        ("valid.en", ["a red house"] * 4),
        ("valid.de", ["ein rotes haus"] * 4),
    ):
        (root / name).write_text("\n".join(lines) + "\n")
        files[name] = root / name
    return [
        f"data.source_files=[{files['train.en']}]",
        f"data.target_files=[{files['train.de']}]",
        f"data.val_source_files=[{files['valid.en']}]",
        f"data.val_target_files=[{files['valid.de']}]",
    ]


def wmt(tmp_path: Path, *extra: str):
    return load_recipe(
        RECIPES / "transformer-base-wmt.yaml", [*translation_files(tmp_path), "trainer.max_steps=2", *extra]
    )


def test_the_documented_translation_example_stops_at_once_naming_the_keys(machine, tmp_path, capsys):
    run_dir = tmp_path / "run"
    start = time.perf_counter()
    code = main(
        [
            "pretrain",
            str(RECIPES / "transformer-base-wmt.yaml"),
            *translation_files(tmp_path),
            "trainer.max_steps=2",
            f"run.dir={run_dir}",
        ]
    )
    assert code == 2 and time.perf_counter() - start < 30
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: trainer.devices=8") and "\n" not in err, err
    assert "trainer.devices=1" in err and "trainer.accumulate_grad_batches=8" in err
    assert not run_dir.exists()  # nothing written


def test_the_changed_keys_pass_every_check(machine, tmp_path):
    cfg = wmt(tmp_path, "trainer.devices=1", "trainer.accumulate_grad_batches=8")
    check(cfg)
    assert capped(cfg) == 2  # paper.yaml's 4 workers, for 2 cores


def test_gpus_are_counted(machine, tmp_path):
    machine["gpus"] = 2
    with pytest.raises(RecipeError, match=r"trainer.devices=8 but this machine has 2 GPU\(s\); set trainer.devices=2"):
        preflight.check_devices(trainer(tmp_path))
    machine["gpus"] = 0
    with pytest.raises(RecipeError, match="trainer.accelerator=gpu but this machine has no CUDA GPU"):
        preflight.check_devices(trainer(tmp_path, "trainer.accelerator=gpu", "trainer.devices=1"))
    preflight.check_devices(trainer(tmp_path, "trainer.devices=2"))  # two CPU processes on two cores


def test_workers_are_capped_by_the_cores_of_each_rank(machine, tmp_path, capsys):
    machine["cores"] = 8
    assert capped(wmt(tmp_path, "trainer.devices=2")) == 4
    assert capsys.readouterr().err == ""
    assert capped(wmt(tmp_path, "trainer.devices=4")) == 2
    assert "data.num_workers=4 capped to 2" in capsys.readouterr().err


def test_a_run_that_cannot_fit_in_memory_stops_naming_the_keys(machine, tmp_path):
    cfg = wmt(tmp_path, "trainer.devices=1")
    need = estimate(cfg)
    machine["memory"] = need.per_rank  # the process itself needs more than the states and activations
    with pytest.raises(
        RecipeError, match="data.batch_tokens.*trainer.activation_checkpointing=true.*trainer.check_memory=false"
    ):
        check(cfg)
    unchecked = wmt(tmp_path, "trainer.devices=1", "trainer.check_memory=false")
    check(unchecked)
    machine["gpus"], machine["gpu_memory"] = 1, need.per_rank // 2
    with pytest.raises(RecipeError, match="one GPU needs about"):
        check(cfg)


def test_the_estimate_follows_the_strategy_precision_and_recomputation(machine, tmp_path):
    sentences = ("trainer.devices=2", "data.batch_tokens=null")  # 128 pairs of up to 256 tokens
    base = wmt(tmp_path, *sentences)
    model = model_config(base)
    ddp = estimate(base, model)
    fsdp = estimate(wmt(tmp_path, *sentences, "trainer.strategy=fsdp"), model)
    assert fsdp.states == ddp.states // 2 and fsdp.activations == ddp.activations
    bf16 = estimate(wmt(tmp_path, *sentences, "trainer.precision=bf16-true"), model)
    assert bf16.states == ddp.states // 2
    recompute = estimate(wmt(tmp_path, *sentences, "trainer.activation_checkpointing=true"), model)
    assert recompute.activations < ddp.activations / 3
    assert ddp.tokens == 256  # data.max_length of the recipe
    # token batches: pairs x the longest side <= 3,200, so at most 12 pairs of 256 tokens
    tokens = estimate(wmt(tmp_path, "trainer.devices=2"), model)
    assert tokens == estimate(wmt(tmp_path, *sentences, "data.batch_size=12"), model)


def test_spawned_ranks_do_not_check_again(machine, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    cfg = wmt(tmp_path)
    check(cfg)  # rank 0 checked for the whole node


@pytest.mark.parametrize(
    ("launcher", "tasks"),
    [
        ("srun", [{"SLURM_LOCALID": "0"}, {"SLURM_LOCALID": "1"}]),  # srun sets no LOCAL_RANK
        ("lightning", [{}, {"LOCAL_RANK": "1"}]),  # the process started by hand, then the one it spawns
        # torchrun inside a one-task-per-node srun step: torchrun's LOCAL_RANK wins
        ("torchrun in srun", [{"SLURM_LOCALID": "0", "LOCAL_RANK": "0"}, {"SLURM_LOCALID": "0", "LOCAL_RANK": "1"}]),
    ],
)
def test_only_local_rank_0_of_a_node_checks(machine, tmp_path, monkeypatch, launcher, tasks):
    """Two processes of one node: the first checks devices and memory for both (check_memory
    counts every rank of the node), the second must not refuse a run the first found to fit."""
    cfg = wmt(tmp_path, "trainer.devices=2", "trainer.strategy=ddp")
    checked = []
    monkeypatch.setattr(preflight, "check_devices", lambda t: checked.append(("devices", task)))
    monkeypatch.setattr(preflight, "check_memory", lambda *args: checked.append(("memory", task)))
    for task, variables in enumerate(tasks):
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        check(cfg)
    assert checked == [("devices", 0), ("memory", 0)], launcher
