"""The product's options against each other: a pairwise covering array, and the checks of each run.

tests/test_option_pairs.py checks the table and runs its single-process and refusal rows;
tests/test_option_pairs_distributed.py runs its ddp and fsdp rows.

Each row of ROWS below is one run: a few steps of a tiny configuration, stopped, resumed with
`resume=auto` to a later step, then the commands that apply to what it left (`evaluate
--json`, `generate`, `export`, and `finetune` from an mlm and a clm run of each strategy).
Every row keeps its tiny recipe's named evaluations (the eval section, each entry capped to a
few examples: helpers.capped_recipe). Every row's output is
checked, not only its exit code: training losses finite, starting at ln(vocabulary) and falling,
validation metrics present, each evaluation at step 0 and at both validations, the resumed run
continuing at the checkpoint's step, the files later commands read, exported weights computing
the same logits in transformers, and a one-line error where a command does not apply.

How to read the table: one column per axis; every pair of values of any two axes that may be
combined appears together in at least one row (test_the_table_covers_every_valid_pair checks
it, fast, without running anything). The full product would be 77,760 runs; 24 rows cover
every pair but three, left out for their cost (EXCLUDED: compile with seq2seq or with either
warmup). Where two values
must not be combined the program refuses them at startup, and a refusal row (its last column
names the key the one-line error must name) checks that refusal for exactly that pair. Values:

  attention   full; sliding_window = model.sliding_window=8 (+ model.global_tokens=1 on
              bidirectional stacks: Longformer); linear = model.attention_kind=linear;
              document_mask = data.document_mask=true (clm and mlm only)
  data        packed = the token cache; streaming = data.streaming=true; store =
              data.store=litdata (both mlm, clm, span only)
  strategy    single = this process; ddp, fsdp = 2 CPU processes on gloo, one 2-process job
              that trains the ddp rows and then the fsdp rows one after another
  generation  on = sample generation at each validation (clm, span, seq2seq), and BLEU for
              seq2seq; mlm and classify generate nothing, so only `off` applies to them
  compile     trainer.compile (the whole step, or per block with checkpointing or fsdp); checkpointing =
              trainer.activation_checkpointing; accumulate = trainer.accumulate_grad_batches
  averaging   ema = trainer.ema_decay (not under fsdp); last = trainer.average_last=2
  warmup      seqlen = data.block_warmup_steps (clm, mlm only); batch = data.batch_warmup_steps
              (not with streaming or the store)

Cost: most of it is compiling. With a cold inductor cache (a fresh CI machine) a compiled
single-process row took 22-69 s here (2026-11-27), its training and validation graphs: sample
generation and the named evaluations run the compiled blocks eagerly
(training.distributed.eager_outside_the_step), as they did not when a row took 132 s. Two ranks
compiling at once on the same 2 cores cost more. So the compile rows come first, in this process,
and the ddp and fsdp compile rows repeat the graph of one of them (same objective, attention,
precision, checkpointing and generation; LM blocks have one shape) so that inductor's on-disk
cache serves them. Everything else is 24 wide, one layer, 24-token blocks, one validation batch
and 4 generated tokens; a run without compile takes 1-3 s.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import astuple, dataclass
from pathlib import Path

import pytest
import torch
from helpers import (
    KEYWORD_FINETUNE,
    RECIPES,
    TINY_RUN,
    assert_learned_keywords,
    assert_tuned_from,
    capped_recipe,
    keyword_task,
    optional,
)

from lit_transformer.commands.cli import main
from lit_transformer.recipe.load import load_recipe
from lit_transformer.training.rundir import read_metrics


@dataclass(frozen=True)
class Row:
    objective: str
    attention: str
    data: str
    strategy: str
    precision: str
    generation: str
    compile: str
    checkpointing: str
    accumulate: int
    averaging: str
    warmup: str
    refuses: str | None = None  # a refusal row: the key its one-line error names

    @property
    def id(self) -> str:
        return "-".join(str(v) for v in astuple(self)[:11]).replace("_", "")


def refusal(
    objective: str, key: str, *, attention="full", data="packed", strategy="single", averaging="off", warmup="off"
):
    """A refusal row: `key` names the one refused pair; every other axis at its plainest value."""
    return Row(objective, attention, data, strategy, "32-true", "off", "off", "off", 1, averaging, warmup, key)


R = Row
ROWS = [
    # objective  attention         data         strategy  precision     gen    compile ckpt  accumulate averaging warmup
    # compile rows first: each single-process one compiles its blocks (cold); the ddp and fsdp
    # ones repeat the graphs of the second and first row, which inductor's disk cache then serves
    R("mlm", "document_mask", "packed", "single", "bf16-true", "off", "on", "on", 2, "off", "off"),
    R("clm", "linear", "store", "single", "bf16-mixed", "on", "on", "off", 1, "last", "off"),
    R("span", "sliding_window", "streaming", "single", "32-true", "off", "on", "off", 2, "ema", "off"),
    R("classify", "full", "packed", "single", "32-true", "off", "on", "on", 1, "last", "off"),
    R("clm", "linear", "streaming", "ddp", "bf16-mixed", "on", "on", "off", 2, "off", "off"),
    R("mlm", "document_mask", "streaming", "fsdp", "bf16-true", "off", "on", "on", 1, "last", "off"),
    # the rest, found by a greedy pairwise search with compile off
    R("seq2seq", "sliding_window", "packed", "ddp", "32-true", "on", "off", "on", 1, "ema", "batch"),
    R("clm", "full", "store", "fsdp", "bf16-true", "off", "off", "off", 1, "off", "seqlen"),
    R("seq2seq", "linear", "packed", "fsdp", "bf16-mixed", "off", "off", "on", 2, "last", "batch"),
    R("mlm", "full", "streaming", "ddp", "bf16-mixed", "off", "off", "on", 2, "ema", "seqlen"),
    R("span", "sliding_window", "store", "ddp", "bf16-true", "on", "off", "on", 2, "off", "off"),
    R("clm", "document_mask", "store", "single", "32-true", "on", "off", "on", 2, "ema", "seqlen"),
    R("span", "sliding_window", "packed", "fsdp", "bf16-mixed", "on", "off", "off", 1, "last", "batch"),
    R("classify", "full", "packed", "single", "bf16-true", "off", "off", "off", 2, "ema", "batch"),
    R("mlm", "linear", "store", "ddp", "32-true", "off", "off", "off", 2, "last", "seqlen"),
    R("seq2seq", "full", "packed", "ddp", "bf16-true", "on", "off", "off", 2, "off", "off"),
    R("clm", "document_mask", "packed", "fsdp", "32-true", "on", "off", "off", 2, "off", "batch"),
    R("classify", "linear", "packed", "fsdp", "bf16-mixed", "off", "off", "on", 2, "off", "batch"),
    R("clm", "sliding_window", "packed", "single", "bf16-true", "on", "off", "off", 2, "ema", "seqlen"),
    R("seq2seq", "linear", "packed", "single", "bf16-true", "on", "off", "on", 1, "ema", "off"),
    R("mlm", "sliding_window", "packed", "single", "bf16-true", "off", "off", "off", 2, "ema", "batch"),
    R("mlm", "document_mask", "packed", "ddp", "bf16-mixed", "off", "off", "off", 1, "last", "batch"),
    R("classify", "sliding_window", "packed", "ddp", "bf16-true", "off", "off", "on", 2, "off", "off"),
    R("span", "full", "streaming", "fsdp", "bf16-mixed", "on", "off", "on", 2, "last", "off"),
    # refusals at startup: exit status 2, one line naming the key (refusal(): the other axes at
    # their plainest values)
    refusal("span", "model.attention_kind", attention="linear"),
    refusal("span", "data.document_mask", attention="document_mask"),
    refusal("seq2seq", "data.document_mask", attention="document_mask"),
    refusal("classify", "data.document_mask", attention="document_mask"),
    refusal("seq2seq", "data.streaming", data="streaming"),
    refusal("classify", "data.streaming", data="streaming"),
    refusal("seq2seq", "data.store", data="store"),
    refusal("classify", "data.store", data="store"),
    refusal("span", "data.block_warmup_steps", warmup="seqlen"),
    refusal("seq2seq", "data.block_warmup_steps", warmup="seqlen"),
    refusal("classify", "data.block_warmup_steps", warmup="seqlen"),
    refusal("mlm", "data.batch_warmup_steps", data="streaming", warmup="batch"),
    refusal("mlm", "data.batch_warmup_steps", data="store", warmup="batch"),
    refusal("mlm", "trainer.ema_decay", strategy="fsdp", averaging="ema"),
]

AXES = {
    "objective": ("mlm", "clm", "span", "seq2seq", "classify"),
    "attention": ("full", "sliding_window", "linear", "document_mask"),
    "data": ("packed", "streaming", "store"),
    "strategy": ("single", "ddp", "fsdp"),
    "precision": ("32-true", "bf16-mixed", "bf16-true"),
    "generation": ("off", "on"),
    "compile": ("off", "on"),
    "checkpointing": ("off", "on"),
    "accumulate": (1, 2),
    "averaging": ("off", "ema", "last"),
    "warmup": ("off", "seqlen", "batch"),
}
# Pairs the program refuses at startup (linear attention has no scores for T5's relative
# bias; document masks need the clm/mlm collators' packed documents; streaming packs LM
# blocks only), and pairs that mean nothing (mlm and classify never generate).
REFUSED = {
    ("objective", "span", "attention", "linear"),
    ("objective", "span", "attention", "document_mask"),
    ("objective", "seq2seq", "attention", "document_mask"),
    ("objective", "classify", "attention", "document_mask"),
    ("objective", "seq2seq", "data", "streaming"),
    ("objective", "classify", "data", "streaming"),
    ("objective", "seq2seq", "data", "store"),
    ("objective", "classify", "data", "store"),
    ("objective", "span", "warmup", "seqlen"),
    ("objective", "seq2seq", "warmup", "seqlen"),
    ("objective", "classify", "warmup", "seqlen"),
    ("data", "streaming", "warmup", "batch"),
    ("data", "store", "warmup", "batch"),
    ("strategy", "fsdp", "averaging", "ema"),
}
MEANINGLESS = {("objective", "mlm", "generation", "on"), ("objective", "classify", "generation", "on")}
# Left out for cost, and the only such pair: compiling seq2seq's blocks took 140-180 s here
# (source and target lengths vary per batch, so both stacks compile again for dynamic shapes,
# in training and in eval), more than half the matrix's budget. The same encoder-decoder
# Block (cross-attention included) compiles in the span row.
# Compiling under a warmup is left out for the same reason: each row length (sequence-length
# warmup) or batch size (batch warmup) of the first steps is another shape to compile.
EXCLUDED = {
    ("objective", "seq2seq", "compile", "on"),
    ("compile", "on", "warmup", "seqlen"),
    ("compile", "on", "warmup", "batch"),
}

RUNS = [row for row in ROWS if row.refuses is None]
# finetune.from the first mlm and the first clm row of each strategy: six runs whose backbones
# have a window, linear attention or document masks, and two of them an FSDP-gathered model
FINETUNE_FROM = {
    next(r for r in RUNS if (r.objective, r.strategy) == key)
    for key in itertools.product(("mlm", "clm"), AXES["strategy"])
}
GENERATIVE = ("clm", "span", "seq2seq")

STEPS, MORE = 5, 10  # stop after STEPS, resume to MORE; validation and a checkpoint every 5 steps
# TINY_RUN with batch 4, room for seq2seq and classification rows and the recipes' named
# evaluations; each row sets its vocabulary, precision, generation and the rest (overrides())
SMALL = [
    *(a for a in TINY_RUN if a != "eval=[]"),  # the tiny recipes' eval sections run, as shipped
    "data.batch_size=4",
    "data.max_length=24",
    "data.max_target_length=8",
    "data.shuffle_buffer=64",
    "model.max_seq_len=32",
    "model.dropout=0.0",
    # a high constant learning rate without warmup: the loss falls within a few steps
    "optim.lr=1e-2",
    "optim.warmup_steps=0",
    "optim.schedule=constant",
    "trainer.val_check_interval=5",
    "trainer.checkpoint_every_n_steps=5",
    "trainer.limit_val_batches=1",
    "objective.bleu_batches=1",
    "generation.max_new_tokens=4",
    "generation.num_prompts=2",
]
VOCAB = {"mlm": 400, "clm": 400, "span": 420, "seq2seq": 400, "classify": 400}  # span adds sentinels
ON = {"on": "true", "off": "false"}
AVERAGING = {"off": [], "ema": ["trainer.ema_decay=0.9"], "last": ["trainer.average_last=2"]}  # checkpoints at 5, 10
# a warmup over the first 4 steps: rows of 6, 12 then 24 tokens; batches of 1, 2 then 4 examples
WARMUP = {
    "off": [],
    "seqlen": ["data.block_warmup_steps=4", "data.block_warmup_start=6"],
    "batch": ["data.batch_warmup_steps=4", "data.batch_warmup_start=1"],
}


def overrides(row: Row) -> list[str]:
    out = [f"tokenizer.vocab_size={VOCAB[row.objective]}"]
    if row.attention == "sliding_window":  # a window smaller than the block, so that it masks
        out += ["model.sliding_window=8"] + (["model.global_tokens=1"] if row.objective != "clm" else [])
    elif row.attention == "linear":
        out.append("model.attention_kind=linear")
    elif row.attention == "document_mask":
        out.append("data.document_mask=true")
    if row.data == "streaming":
        out.append("data.streaming=true")
    elif row.data == "store":
        out.append("data.store=litdata")
    out += AVERAGING[row.averaging] + WARMUP[row.warmup]
    if row.strategy != "single":
        out += [f"trainer.strategy={row.strategy}", "trainer.devices=2"]
    return out + [
        f"trainer.precision={row.precision}",
        f"generation.enabled={ON[row.generation]}",
        f"objective.bleu={ON[row.generation]}",
        f"trainer.compile={ON[row.compile]}",
        f"trainer.activation_checkpointing={ON[row.checkpointing]}",
        f"trainer.accumulate_grad_batches={row.accumulate}",
    ]


def pretrain_args(row: Row, run_dir: Path, *extra: str) -> list[str]:
    return [
        "pretrain",
        str(capped_recipe(RECIPES / f"tiny-{row.objective}.yaml", run_dir.parent)),
        *SMALL,
        *overrides(row),
        f"run.dir={run_dir}",
        *extra,
    ]


def stop_and_resume(row: Row, run_dir: Path) -> list[list[str]]:
    return [
        pretrain_args(row, run_dir, f"trainer.max_steps={STEPS}"),
        pretrain_args(row, run_dir, f"trainer.max_steps={MORE}", "resume=auto"),
    ]


def declared_eval(recipe: Path) -> list[str]:
    """The entry names of the eval section a recipe file declares: its YAML and its `extends:`
    chain read here, not through load_recipe (a list in a later file replaces an earlier one).
    What a run's eval section must hold, so that a section trimmed on the way fails a matrix."""
    return _declared_eval(recipe) or []


def _declared_eval(recipe: Path) -> list[str] | None:
    """As declared_eval; None where neither the file nor its ancestors have an eval section."""
    import yaml

    tree = yaml.safe_load(recipe.read_text()) or {}
    if "eval" in tree:
        return [entry["name"] for entry in tree["eval"] or []]
    parents = tree.get("extends") or []
    names = None
    for parent in [parents] if isinstance(parents, str) else parents:
        found = _declared_eval(recipe.parent / parent)
        names = found if found is not None else names
    return names


def assert_evaluations_ran(recipe: Path, run_dir: Path, steps: list[int]) -> None:
    """Every evaluation `recipe` declares ran at each of `steps` in the run at `run_dir`, and its
    final numbers are in metrics.json; the run's eval section is the recipe's, none dropped."""
    expected = declared_eval(recipe)
    assert [e.name for e in load_recipe(run_dir / "config.yaml").eval] == expected, (recipe.name, expected)
    rows, metrics = read_metrics(run_dir), json.loads((run_dir / "metrics.json").read_text())
    ran = {k.split("/")[1] for r in rows for k in r if k.startswith("eval/") and k.endswith("/seconds")}
    assert ran == set(expected), (recipe.name, sorted(ran), expected)
    for name in expected:
        assert sorted({int(r["step"]) for r in rows if f"eval/{name}/seconds" in r}) == steps, name
        assert math.isfinite(metrics[f"eval/{name}/examples"]), (name, sorted(metrics))


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


# ----------------------------------------------------------------------------- checks


def _csv_steps(version: Path) -> list[int]:
    import csv

    with (version / "metrics.csv").open(newline="") as file:
        return [int(r["step"]) for r in csv.DictReader(file) if r.get("train/loss")]


def check_run(row: Row, run_dir: Path) -> None:
    """What the stopped and resumed run left: files, losses, metrics, samples."""
    files = ["config.yaml", "tokenizer.json", "config.json", "model.safetensors", "metrics.json"]
    files += ["classifier.safetensors", "labels.json"] if row.objective == "classify" else []
    assert [f for f in files if not (run_dir / f).is_file()] == [], row
    last = run_dir / "checkpoints" / "last.ckpt"
    if row.strategy == "fsdp":  # a directory of one shard per rank
        assert last.is_dir() and len(list(last.glob("*.distcp"))) == 2
    else:
        assert last.is_file()
    # one CSV version per start: the resumed one begins at the checkpoint's step, every
    # optimizer step logged once (accumulation included)
    versions = sorted((run_dir / "csv").glob("version_*"))
    assert [_csv_steps(v) for v in versions] == [list(range(STEPS)), list(range(STEPS, MORE))]
    losses = [r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r]
    assert len(losses) == MORE and all(map(math.isfinite, losses)), losses
    # at initialisation every prediction is about uniform: the first loss is ln(choices) (under
    # ddp and fsdp only if the logged loss is the global batch's, not rank 0's share of it)
    choices = 8 if row.objective == "classify" else VOCAB[row.objective]  # 8 docstring packages
    assert abs(losses[0] - math.log(choices)) < 0.3, losses
    if row.objective != "classify":  # docstring topics take longer than ten steps to show
        assert sum(losses[-3:]) < sum(losses[:3]), losses
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert math.isfinite(metrics["val/loss"]), metrics
    # the recipe's named evaluations, every one it declares: on the initial weights, at each
    # validation (the stopped run's last one and the resumed run's), their final numbers in metrics.json
    assert_evaluations_ran(RECIPES / f"tiny-{row.objective}.yaml", run_dir, [0, STEPS, MORE])
    assert (run_dir / "averaged.json").is_file() == (row.averaging == "last")
    assert ("val/bleu" in metrics) == (row.objective == "seq2seq" and row.generation == "on"), metrics
    samples = run_dir / "samples.jsonl"
    assert samples.is_file() == (row.objective in GENERATIVE and row.generation == "on")
    if samples.is_file():  # one entry per validation, across the stop
        entries = [json.loads(line) for line in samples.read_text().splitlines()]
        assert [e["step"] for e in entries] == [STEPS, MORE] and all(len(e["samples"]) == 2 for e in entries)


def export_refusal(row: Row) -> str | None:
    """What `export` must name, or None where it writes a transformers directory."""
    if row.objective == "classify":
        return "export writes language models"
    if row.attention == "sliding_window":
        return "model.sliding_window"
    if row.attention == "linear":
        return "model.attention_kind"
    if row.objective == "seq2seq":  # the 2017 paper's sinusoidal encoder-decoder has no family
        return "model.position='sinusoidal'"
    return None


HF_CLASS = {"mlm": "AutoModelForMaskedLM", "clm": "AutoModelForCausalLM", "span": "AutoModelForSeq2SeqLM"}


def check_export(row: Row, run_dir: Path, out: Path) -> None:
    """The exported directory computes the run's model: same logits in transformers."""
    from lit_transformer.model.interop.directories import load_pretrained

    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    transformers = optional("transformers", "dev")  # reads the export back
    ours = load_pretrained(run_dir).float().eval()
    theirs = getattr(transformers, HF_CLASS[row.objective]).from_pretrained(out).float().eval()
    ids = torch.randint(5, ours.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    extra = {"decoder_input_ids": ids[:, :6]} if row.objective == "span" else {}
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids, **extra).logits, ours(ids, **extra), rtol=1e-4, atol=1e-4)


def follow_up(row: Row, run_dir: Path, tmp: Path, capsys) -> None:
    """evaluate, generate and export on the run, and finetune from an mlm or clm run."""
    capsys.readouterr()
    assert main(["evaluate", str(run_dir), "--json", "--max-batches", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    loss = out["eval/validation/loss"]
    assert out["objective"] == row.objective and math.isfinite(loss), out
    translated = "eval/validation_translation/bleu" in out
    assert translated == (row.objective == "seq2seq" and row.generation == "on"), out
    final = json.loads((run_dir / "metrics.json").read_text())
    for key, value in final.items():  # the recipe's own evaluations ran too, on the same final weights
        if key.startswith("eval/") and not key.endswith("/seconds"):
            assert key in out, key
    if row.strategy == "single" and row.precision == "32-true":  # the same weights on the same batch
        assert loss == pytest.approx(final["val/loss"], rel=1e-5)
    if row.strategy == "fsdp" and row.averaging != "last":  # the sharded checkpoint holds the final weights too
        last = str(run_dir / "checkpoints" / "last.ckpt")
        assert main(["evaluate", last, "--split", "validation", "--json", "--max-batches", "1"]) == 0
        assert json.loads(capsys.readouterr().out)["eval/validation/loss"] == pytest.approx(loss, rel=1e-5)

    prompt = ["generate", str(run_dir), "--prompt", "def read(self, size):", "--max-new-tokens", "4", "--greedy"]
    if row.objective in GENERATIVE:
        assert main(prompt) == 0 and capsys.readouterr().out.endswith("\n")
    else:
        assert main(prompt) == 2 and "does not generate text" in one_error_line(capsys)

    refusal = export_refusal(row)
    assert main(["export", str(run_dir), str(tmp / "hf")]) == (0 if refusal is None else 2)
    if refusal is None:
        capsys.readouterr()
        check_export(row, run_dir, tmp / "hf")
    else:
        assert refusal in one_error_line(capsys)

    if row in FINETUNE_FROM:
        finetune(run_dir, tmp / "classify", capsys)


def finetune_args(source: Path, run_dir: Path, *extra: str) -> list[str]:
    """The command line of the fine-tune below (tests/finetune_margins.py measures its margin);
    `extra` overrides come last and win."""
    return [
        "finetune",
        str(RECIPES / "tiny-classify-from-pretrained.yaml"),
        f"finetune.from={source}",
        f"run.dir={run_dir}",
        *keyword_task(run_dir.parent / "keywords"),
        *KEYWORD_FINETUNE,
        "trainer.num_threads=1",
        "trainer.precision=32-true",
        "logger.wandb.mode=disabled",
        *extra,
    ]


def finetune(source: Path, run_dir: Path, capsys) -> None:
    """A classifier fine-tuned from the run's weights learns a keyword task (chance 1/3) and
    keeps the backbone's config, attention options included."""
    from lit_transformer.model.interop.directories import load_pretrained

    assert main(finetune_args(source, run_dir)) == 0
    assert_learned_keywords(json.loads((run_dir / "metrics.json").read_text()))
    assert_tuned_from(source, run_dir)
    assert (run_dir / "classifier.safetensors").is_file()
    pretrained, tuned = load_pretrained(source).config, load_pretrained(run_dir).config
    for key in ("arch", "d_model", "sliding_window", "global_tokens", "attention_kind"):
        assert getattr(tuned, key) == getattr(pretrained, key), key
    capsys.readouterr()
