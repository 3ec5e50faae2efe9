"""Bad inputs end in one error line and exit status 2 with nothing overwritten: bad recipes and
data, a run directory holding another run, damaged checkpoints and final models, another
architecture; and inputs that would run code (pickles, recipe interpolations) are refused
without running it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import RECIPES, one_error_line
from helpers import TINY_DROPOUT_RUN as TINY
from helpers import tiny_dropout_pretrain as pretrain

from lit_transformer.commands.cli import main
from lit_transformer.errors import RunError
from lit_transformer.training.checkpoints import checkpoint_step, read_checkpoint
from lit_transformer.training.rundir import latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")


def snapshot(folder: Path) -> dict[str, bytes]:
    return (
        {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        if folder.exists()
        else {}
    )


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


# ----------------------------------------------------------------------------- bad inputs


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


# ----------------------------------------------------------------------------- security


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
