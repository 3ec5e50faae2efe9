"""Failure handling: crash-safe exact resume (kill -9, also inside a checkpoint write), a
one-line error for every bad input with nothing overwritten, safe checkpoint loading (pickled
code never runs), the non-finite guard, CPU determinism, and faults (a dying data-loader
worker, a full disk) that end in a clear error."""

from __future__ import annotations

import errno
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import TINY_RUN

from lit_transformer.commands.cli import main
from lit_transformer.errors import RunError
from lit_transformer.training import checkpoints
from lit_transformer.training.checkpoints import checkpoint_step, read_checkpoint
from lit_transformer.training.rundir import latest_checkpoint, read_metrics

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"

# dropout on, so that resuming has random draws to get right
TINY = [*TINY_RUN, "model.dropout=0.1", "optim.warmup_steps=2"]


pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")


def pretrain(run_dir: Path, *extra: str, recipe: str = "tiny-clm") -> list[str]:
    return ["pretrain", str(RECIPES / f"{recipe}.yaml"), *TINY, f"run.dir={run_dir}", *extra]


def losses(run_dir: Path) -> dict[int, float]:
    return {int(r["step"]): r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}


def one_error_line(capsys) -> str:
    """The error line; other stderr lines (progress bars) may precede it, a traceback may not."""
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1] if err else ""
    assert last.startswith("error: ") and "Traceback" not in err and err.count("error: ") == 1, err
    return last


def snapshot(folder: Path) -> dict[str, bytes]:
    return (
        {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        if folder.exists()
        else {}
    )


def temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.glob(".*") if checkpoints.is_temp(p)]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A finished 4-step tiny-clm run (checkpoints at steps 2 and 4) for the loading tests."""
    run_dir = tmp_path_factory.mktemp("tiny") / "run"
    mp = pytest.MonkeyPatch()
    mp.setenv("LIT_TRANSFORMER_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    try:
        assert (
            main(
                pretrain(
                    run_dir, "trainer.max_steps=4", "trainer.val_check_interval=4", "trainer.checkpoint_every_n_steps=2"
                )
            )
            == 0
        )
    finally:
        mp.undo()
    return run_dir


# ----------------------------------------------------------------------------- 1. crash safety

CRASH = ["trainer.max_steps=12", "trainer.val_check_interval=12", "trainer.checkpoint_every_n_steps=4"]
# The command line, with the checkpoint writer pausing for 120 s once last.ckpt of step 8 is
# written and fsync'ed in its temporary file and before the rename: the window a kill must hit.
PAUSED_CLI = """
import os, sys, time, torch
from lit_transformer.training import checkpoints
from lit_transformer.commands.cli import main

real_save = checkpoints.atomic_save

def paused_save(obj, path, *, write=None):
    if os.path.basename(path) != "last.ckpt" or obj.get("global_step") != 8:
        return real_save(obj, path, write=write)

    def write_then_pause(obj, file):
        torch.save(obj, file)
        file.flush()
        os.fsync(file.fileno())
        time.sleep(120)

    real_save(obj, path, write=write_then_pause)

checkpoints.atomic_save = paused_save
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_kill_9_inside_a_checkpoint_write_then_resume_matches_an_uninterrupted_run(tmp_path):
    """The run is killed while last.ckpt of step 8 sits written and fsync'ed in its temporary
    file, not yet renamed (PAUSED_CLI holds that window open): step-8.ckpt is complete,
    last.ckpt still says step 4. resume=auto must take step-8.ckpt, by step not by name, never
    the temporary file; the losses of the two segments equal an uninterrupted run's."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert main(pretrain(whole, *CRASH)) == 0

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", PAUSED_CLI, *pretrain(killed, *CRASH)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    folder = killed / "checkpoints"
    deadline = time.monotonic() + 180
    try:
        while not (
            (folder / "step-8.ckpt").exists() and any(p.name.startswith(".last.ckpt.") for p in temp_files(folder))
        ):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no checkpoint write seen"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # kill -9, the run and anything it started
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    (tmp,) = temp_files(folder)
    assert tmp.name.startswith(".last.ckpt.")
    assert checkpoint_step(folder / "last.ckpt") == 4 and checkpoint_step(folder / "step-8.ckpt") == 8
    assert latest_checkpoint(killed) == folder / "step-8.ckpt"

    assert main(pretrain(killed, *CRASH, "resume=auto")) == 0
    assert not temp_files(folder)  # the leftover of the killed write is gone
    expected, got = losses(whole), losses(killed)
    # Lightning logs a step's row after its on_train_batch_end, where checkpoints are written:
    # a kill inside that write loses the one row of step 7 (the loss, not the training).
    assert sorted(expected) == list(range(12)) and sorted(got) == [s for s in range(12) if s != 7]
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step


def test_a_write_never_leaves_a_partial_file_under_the_final_name(tmp_path, monkeypatch):
    """An exception in the middle of torch.save (what a kill would cut) leaves the previous
    file byte for byte and no temporary file."""
    target = tmp_path / "last.ckpt"
    checkpoints.atomic_save({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, target)
    before = target.read_bytes()

    def half_then_fail(obj, file):
        file.write(b"PK\x03\x04 partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        checkpoints.atomic_save({"state_dict": {}}, target, write=half_then_fail)
    assert target.read_bytes() == before and not temp_files(tmp_path)
    assert read_checkpoint(target)["global_step"] == 1


# ----------------------------------------------------------------------------- 2. bad inputs


def _write(tmp_path: Path, name: str, data: bytes) -> str:
    (tmp_path / name).write_bytes(data)
    return str(tmp_path / name)


def _wordlevel_tokenizer(tmp_path: Path) -> str:
    """A tokenizer.json with words and [UNK] only: no mask, pad or separator token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "def", "return", "self", "the", "import", "class", "if", "in", "for"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "words.json"))
    return str(tmp_path / "words.json")


def _labels(tmp_path: Path) -> list[str]:
    import json

    train = "".join(
        json.dumps({"text": f"some text number {i}", "label": ["cat", "dog"][i % 2]}) + "\n" for i in range(40)
    )
    val = "".join(json.dumps({"text": f"other {i}", "label": ["cat", "bird"][i % 2]}) + "\n" for i in range(6))
    return [
        f"data.train_files=[{_write(tmp_path, 't.jsonl', train.encode())}]",
        f"data.val_files=[{_write(tmp_path, 'v.jsonl', val.encode())}]",
    ]


# (case, recipe, extra overrides (a function of tmp_path), expected message, fails before the run dir exists)
BAD_INPUTS = [
    ("malformed YAML", None, lambda t: [], "malformed YAML", True),
    ("code-naming key", "target", lambda t: [], "unknown key _target_", True),
    ("wrong type", "tiny-clm", lambda t: ["trainer.max_steps=ten"], "trainer.max_steps: Value 'ten'", True),
    ("dropout", "tiny-clm", lambda t: ["model.dropout=1.0"], "model.dropout=1.0 is outside [0, 1)", True),
    ("attention dropout", "tiny-clm", lambda t: ["model.attention_dropout=-0.1"], "is outside [0, 1)", True),
    ("heads", "tiny-clm", lambda t: ["model.n_heads=5"], "model.d_model=24 is not divisible by model.n_heads=5", True),
    (
        "kv heads",
        "tiny-clm",
        lambda t: ["model.n_heads=4", "model.n_kv_heads=3"],
        "model.n_heads=4 is not divisible by model.n_kv_heads=3",
        True,
    ),
    (
        "learned positions",
        "tiny-clm",
        lambda t: ["model.position=learned", "model.max_seq_len=16"],
        "data.block_size=24 exceeds model.max_seq_len=16",
        True,
    ),
    ("patience", "tiny-clm", lambda t: ["trainer.nonfinite_patience=0"], "trainer.nonfinite_patience=0 must be", True),
    (
        "missing data",
        "tiny-clm",
        lambda t: [f"data.train_files=[{t / 'none.txt'}]"],
        "no such file or directory",
        False,
    ),
    ("empty data", "tiny-clm", lambda t: [f"data.train_files=[{_write(t, 'e.txt', b'')}]"], "is an empty file", False),
    (
        "binary data",
        "tiny-clm",
        lambda t: [f"data.train_files=[{_write(t, 'b.txt', bytes(range(256)) * 8)}]"],
        "looks binary",
        False,
    ),
    (
        "tokenizer lacks tokens",
        "tiny-mlm",
        lambda t: [f"tokenizer.path={_wordlevel_tokenizer(t)}"],
        "which objective 'mlm' needs",
        False,
    ),
    ("vocabulary > embedding", "tiny-clm", lambda t: ["model.vocab_size=50"], "model.vocab_size=50", False),
    ("labels outside the set", "tiny-classify", _labels, "labels ['bird'] do not occur in the training data", False),
]


@pytest.mark.parametrize("case, recipe, extra, message, early", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2(case, recipe, extra, message, early, tmp_path, capsys):
    if recipe is None:
        path = _write(tmp_path, "bad.yaml", b"objective:\n  name: clm\n model: [\n")
    elif recipe == "target":
        path = _write(tmp_path, "target.yaml", f"extends: {RECIPES / 'tiny-clm.yaml'}\n_target_: os.system\n".encode())
    else:
        path = str(RECIPES / f"{recipe}.yaml")
    run_dir = tmp_path / "run"
    assert main(["pretrain", path, *TINY, f"run.dir={run_dir}", *extra(tmp_path)]) == 2
    assert message in one_error_line(capsys)
    if early:  # refused at startup: nothing written
        assert not run_dir.exists()
    assert not (run_dir / "checkpoints").exists()


def test_a_run_directory_holding_another_run_is_left_alone(tiny_run, tmp_path, capsys):
    before = snapshot(tiny_run)
    assert (
        main(
            pretrain(
                tiny_run,
                "trainer.max_steps=4",
                "trainer.val_check_interval=4",
                "trainer.checkpoint_every_n_steps=2",
                "model.d_model=32",
            )
        )
        == 2
    )
    assert "holds a different run (model.d_model: 24 -> 32)" in one_error_line(capsys)
    assert snapshot(tiny_run) == before


def _copy_run(src: Path, dst: Path, checkpoint: bytes) -> Path:
    """A run directory with src's recipe and tokenizer and the given bytes as last.ckpt."""
    (dst / "checkpoints").mkdir(parents=True)
    for name in ("config.yaml", "tokenizer.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    (dst / "checkpoints" / "last.ckpt").write_bytes(checkpoint)
    return dst / "checkpoints" / "last.ckpt"


def _damaged(tiny_run: Path) -> dict[str, bytes]:
    good = (tiny_run / "checkpoints" / "last.ckpt").read_bytes()
    flipped = bytearray(good)
    flipped[:200] = bytes(b ^ 0xFF for b in flipped[:200])  # the zip header and pickle
    return {"truncated": good[: len(good) // 2], "corrupted": bytes(flipped), "not a checkpoint": b"hello"}


@pytest.mark.parametrize("damage", ["truncated", "corrupted", "not a checkpoint"])
def test_damaged_checkpoints_are_one_line_errors_naming_the_file(damage, tiny_run, tmp_path, capsys):
    ckpt = _copy_run(tiny_run, tmp_path / "copy", _damaged(tiny_run)[damage])
    for argv in (
        ["evaluate", str(ckpt)],
        ["generate", str(ckpt), "--prompt", "def"],
        ["export", str(ckpt), str(tmp_path / "out")],
        pretrain(tmp_path / "new", "trainer.max_steps=4", f"resume={ckpt}"),
    ):
        assert main(argv) == 2, argv
        line = one_error_line(capsys)
        assert str(ckpt) in line and "not a readable Lightning checkpoint" in line, line
    # resume=auto in the directory: the only checkpoint is unreadable, so no silent restart
    before = snapshot(tmp_path / "copy")
    args = pretrain(
        tmp_path / "copy",
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        "trainer.checkpoint_every_n_steps=2",
        "resume=auto",
    )
    assert main(args) == 2 and str(ckpt) in one_error_line(capsys)
    assert snapshot(tmp_path / "copy") == before


def test_resume_auto_names_an_unreadable_newer_checkpoint_it_skips(tmp_path, capsys):
    """Both step-4 files damaged: resume=auto goes back to step-2.ckpt, and says on stderr which
    files it skipped and which it took (a silent resume from further back loses work unseen)."""
    run = tmp_path / "run"
    steps = ["trainer.max_steps=4", "trainer.val_check_interval=4", "trainer.checkpoint_every_n_steps=2"]
    assert main(pretrain(run, *steps, "trainer.keep_checkpoints=2")) == 0
    folder = run / "checkpoints"
    good = (folder / "last.ckpt").read_bytes()
    damaged = {"last.ckpt": good[: len(good) // 2], "step-4.ckpt": b"hello"}
    for name, data in damaged.items():
        (folder / name).write_bytes(data)
    capsys.readouterr()
    assert main(pretrain(run, *steps, "trainer.keep_checkpoints=2", "resume=auto")) == 0
    out, err = capsys.readouterr()
    taken = folder / "step-2.ckpt"
    for name in damaged:
        (note,) = [line for line in err.splitlines() if f"skipping {folder / name}," in line]
        assert f"taking {taken} (step 2)" in note, note
    assert f"continuing from {taken} (step 2)" in err and "skipping" not in out
    assert checkpoint_step(latest_checkpoint(run)) == 4  # it trained on from step 2 and saved step 4 again


@pytest.mark.parametrize("damage", ["truncated", "not safetensors"])
def test_a_damaged_final_model_is_a_one_line_error_naming_the_file(damage, tiny_run, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.yaml", "config.json", "tokenizer.json", "model.safetensors"):
        (run / name).write_bytes((tiny_run / name).read_bytes())
    weights = run / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2] if damage == "truncated" else b"hello world, not tensors")
    for argv in (
        ["evaluate", str(run)],
        ["generate", str(run), "--prompt", "def"],
        ["export", str(run), str(tmp_path / "out")],
    ):
        assert main(argv) == 2, argv
        line = one_error_line(capsys)
        assert f"{weights}: not a readable safetensors file" in line, line
    assert not (tmp_path / "out").exists()


def test_resuming_a_checkpoint_of_another_architecture_names_the_fields(tiny_run, tmp_path, capsys):
    ckpt = tiny_run / "checkpoints" / "last.ckpt"
    assert main(pretrain(tmp_path / "r", "model.d_model=32", "model.n_layers=2", f"resume={ckpt}")) == 2
    line = one_error_line(capsys)
    assert "another architecture" in line and "d_model=24 (checkpoint) vs 32" in line
    assert "n_layers=1 (checkpoint) vs 2" in line and "n_heads" not in line
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_non_utf8_data_is_replaced_and_counted(tmp_path, capsys):
    """Documented behaviour: invalid bytes become U+FFFD, counted in the summary."""
    text = (
        "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400)).encode() + b"caf\xe9 \xff\xfe\n"
    )
    path = _write(tmp_path, "latin.txt", text)
    args = pretrain(tmp_path / "run", f"data.train_files=[{path}]", "data.val_fraction=0.1")
    assert main(["prepare", *args[1:]]) == 0
    assert "replaced_chars=3" in capsys.readouterr().out  # the prepare summary counts them


# ----------------------------------------------------------------------------- 3. security


class Payload:
    """A pickle that runs a shell command when unpickled by plain pickle.load."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_pickled_code_is_refused_without_running(tiny_run, tmp_path, capsys):
    from lit_transformer.model.interop.directories import InteropError, load_pretrained

    marker = tmp_path / "MARKER"
    evil = tmp_path / "evil.pt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": Payload(marker)}, evil)
    ckpt = _copy_run(tiny_run, tmp_path / "run", evil.read_bytes())
    hf = tmp_path / "hf"  # a transformers-style directory with pytorch_model.bin
    hf.mkdir()
    (hf / "config.json").write_text(
        '{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 24, '
        '"n_head": 2, "n_layer": 1, "vocab_size": 300, "n_positions": 32}'
    )
    torch.save({"transformer.wte.weight": Payload(marker)}, hf / "pytorch_model.bin")
    (hf / "tokenizer.json").write_bytes((tiny_run / "tokenizer.json").read_bytes())
    finetune = [
        "finetune",
        str(RECIPES / "tiny-classify-from-pretrained.yaml"),
        "trainer.max_steps=1",
        "data.max_train_bytes=150000",
        "data.max_val_bytes=20000",
        "logger.wandb.mode=disabled",
        f"run.dir={tmp_path / 'ft'}",
    ]
    for argv, says in (
        (["evaluate", str(ckpt)], "refused"),
        (["generate", str(ckpt), "--prompt", "x"], "refused"),
        (["generate", str(hf), "--prompt", "x"], "refused"),
        ([*finetune, f"finetune.from={ckpt}"], "refused"),
        ([*finetune, f"finetune.from={hf}"], "refused"),
        (pretrain(tmp_path / "new", f"resume={ckpt}"), "refused"),
        (pretrain(tmp_path / "run", "resume=auto"), "refused"),
    ):
        assert main(argv) == 2, argv
        assert says in one_error_line(capsys)
    with pytest.raises(InteropError, match="refused"):
        load_pretrained(hf)
    with pytest.raises(RunError, match="refused"):
        read_checkpoint(ckpt)
    assert not marker.exists()
    import pickle

    pickle.loads(pickle.dumps(Payload(marker)))  # the payload is real: plain pickle runs it
    assert marker.exists()


def test_recipes_cannot_run_code(tmp_path, capsys, monkeypatch):
    from omegaconf import OmegaConf

    from lit_transformer.recipe.load import load_recipe

    monkeypatch.setenv("RUN_ROOT", str(tmp_path))
    assert load_recipe(RECIPES / "tiny-clm.yaml", ["run.dir=${oc.env:RUN_ROOT}/x"]).run.dir == f"{tmp_path}/x"
    assert not any(OmegaConf.has_resolver(name) for name in ("eval", "python", "exec", "import"))
    assert main(pretrain(tmp_path / "r", "run.dir=${eval:1+1}")) == 2
    assert "Unsupported interpolation type eval" in one_error_line(capsys)
    sources = "".join(p.read_text() for p in (ROOT / "lit_transformer").rglob("*.py"))
    assert "trust_remote_code" not in sources and "instantiate(" not in sources


# ----------------------------------------------------------------------------- 4. numerics


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(tmp_path, monkeypatch, capsys):
    """Step 2: a finite loss with infinite gradients (skipped); steps 5, 6, 7: NaN losses. With
    patience 3 the run stops after step 7, before step 8's checkpoint: step 4's stays the
    newest, finite and intact; skipped steps leave the weights alone."""
    from lit_transformer.objectives.objective_base import ObjectiveBase

    original = ObjectiveBase.finish_training_step
    seen: dict[int, dict[str, torch.Tensor]] = {}  # step -> weights its forward ran with

    def poisoned(self, loss, *args, **kwargs):
        if self.global_step == 2:
            loss = loss * 1.0
            loss.register_hook(lambda grad: grad * float("inf"))
        elif self.global_step >= 5:
            loss = loss * float("nan")
        seen[self.global_step] = {k: v.detach().clone() for k, v in self.state_dict().items()}
        return original(self, loss, *args, **kwargs)

    monkeypatch.setattr(ObjectiveBase, "finish_training_step", poisoned)
    run_dir = tmp_path / "run"
    assert (
        main(
            pretrain(
                run_dir,
                "trainer.max_steps=12",
                "trainer.val_check_interval=12",
                "trainer.checkpoint_every_n_steps=4",
                "trainer.nonfinite_patience=3",
            )
        )
        == 2
    )
    line = one_error_line(capsys)
    assert "training stopped at step 8: 3 steps in a row had a non-finite loss or gradient" in line
    assert str(run_dir / "checkpoints" / "last.ckpt") in line
    rows = read_metrics(run_dir)
    loss = {int(r["step"]): r["train/loss"] for r in rows if "train/loss" in r}
    assert sorted(loss) == [0, 1, 2, 3, 4, 5, 6]  # step 7's row: the run stopped before Lightning logs it
    assert all(math.isfinite(loss[s]) for s in range(5)) and all(math.isnan(loss[s]) for s in (5, 6))
    norms = {int(r["step"]): r["train/grad_norm"] for r in rows if "train/grad_norm" in r}
    assert not math.isfinite(norms[2]) and all(math.isfinite(norms[s]) for s in (0, 1, 3, 4))
    assert [r.get("train/skipped_steps") for r in rows if "train/loss" in r] == [0, 0, 0, 1, 1, 2, 3]  # 4th: step 7
    assert checkpoint_step(latest_checkpoint(run_dir)) == 4 and not (run_dir / "model.safetensors").exists()
    state = read_checkpoint(latest_checkpoint(run_dir))["state_dict"]
    for name, value in state.items():
        assert torch.isfinite(value).all(), name
        torch.testing.assert_close(value, seen[4][name], rtol=0, atol=0)  # the checkpoint: after 4 updates
        torch.testing.assert_close(seen[7][name], seen[5][name], rtol=0, atol=0)  # skipped steps change nothing
    assert all(torch.equal(seen[3][k], seen[2][k]) for k in state)  # step 2 (inf gradients) was skipped too


@pytest.mark.parametrize("bf16_cpu", [True, False])
def test_language_models_default_to_bf16_where_bf16_is_fast(bf16_cpu, monkeypatch):
    from lit_transformer.recipe import load
    from lit_transformer.recipe.load import load_recipe

    flags = {"avx2", "amx_bf16"} if bf16_cpu else {"avx2", "avx512f"}
    monkeypatch.setattr(load, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(load, "_has_nvidia_gpu", lambda: False)
    for path in RECIPES.glob("*.yaml"):
        cfg = load_recipe(path)
        if cfg.objective.name in ("span", "seq2seq"):  # never float16: T5's activations overflow it
            assert cfg.trainer.precision.startswith("bf16") or not bf16_cpu and cfg.trainer.precision == "32-true", path
    span = "bf16-mixed" if bf16_cpu else "32-true"  # emulated bf16 is several times slower than float32
    assert load_recipe(RECIPES / "tiny-span.yaml", ["trainer.precision=null"]).trainer.precision == span
    assert load_recipe(RECIPES / "tiny-seq2seq.yaml", ["trainer.precision=null"]).trainer.precision == span
    assert load_recipe(RECIPES / "tiny-span.yaml", ["trainer.accelerator=gpu"]).trainer.precision == "bf16-mixed"
    assert load_recipe(RECIPES / "tiny-clm.yaml", ["trainer.precision=null"]).trainer.precision == span
    assert load_recipe(RECIPES / "tiny-mlm.yaml", ["trainer.precision=null"]).trainer.precision == span
    assert load_recipe(RECIPES / "tiny-classify.yaml", ["trainer.precision=null"]).trainer.precision == "32-true"
    # a recipe's own choice stands
    assert load_recipe(RECIPES / "tiny-clm.yaml", ["trainer.precision=bf16-mixed"]).trainer.precision == "bf16-mixed"


# ----------------------------------------------------------------------------- 5. determinism


def test_same_recipe_and_seed_give_identical_losses(tmp_path):
    """Masked LM: random masking, dropout and shuffling, twice from scratch: bitwise equal."""
    args = ["trainer.max_steps=5", "trainer.val_check_interval=5", "trainer.checkpoint_every_n_steps=5"]
    assert main(pretrain(tmp_path / "a", *args, recipe="tiny-mlm")) == 0
    assert main(pretrain(tmp_path / "b", *args, recipe="tiny-mlm")) == 0
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(a) == 5 and a == b
    assert main(pretrain(tmp_path / "c", *args, "trainer.seed=1", recipe="tiny-mlm")) == 0
    assert losses(tmp_path / "c") != a  # the seed matters


# ----------------------------------------------------------------------------- 6. faults

WORKER_DIES = """
import os, sys, torch.utils.data as tud
from lit_transformer.commands.cli import main
from lit_transformer.data.modules import text_module as module
getitem = module._CollatedBatches.__getitem__
def dying(self, index):
    if tud.get_worker_info() is not None:
        os._exit(3)  # the worker vanishes, as when the OOM killer takes it
    return getitem(self, index)
module._CollatedBatches.__getitem__ = dying
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_dying_dataloader_worker_is_a_clear_error_not_a_hang(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = pretrain(tmp_path / "run", "data.num_workers=1", "trainer.max_steps=4", "trainer.val_check_interval=4")
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", WORKER_DIES, *args], env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 2, out.stderr[-3000:]
    err = out.stderr.strip().splitlines()[-1]
    assert err.startswith("error: a data-loader worker died (DataLoader worker (pid") and "Traceback" not in out.stderr
    assert time.monotonic() - t0 < 200


def test_a_full_disk_during_a_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch, capsys):
    """torch.save fails with ENOSPC half-way through step 4's first checkpoint file."""
    real_save = torch.save

    def full_disk(obj, file, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("global_step") == 4:
            file.write(b"PK\x03\x04" + b"\0" * 1000)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, file, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    run_dir = tmp_path / "run"
    assert (
        main(
            pretrain(
                run_dir, "trainer.max_steps=6", "trainer.val_check_interval=6", "trainer.checkpoint_every_n_steps=2"
            )
        )
        == 2
    )
    line = one_error_line(capsys)
    assert "No space left on device" in line and "the previous checkpoint is intact" in line
    folder = run_dir / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step-2.ckpt"]  # no temporary file
    assert read_checkpoint(folder / "last.ckpt")["global_step"] == 2
    monkeypatch.setattr(torch, "save", real_save)
    assert (
        main(
            pretrain(
                run_dir,
                "trainer.max_steps=6",
                "trainer.val_check_interval=6",
                "trainer.checkpoint_every_n_steps=2",
                "resume=auto",
            )
        )
        == 0
    )  # and it resumes
