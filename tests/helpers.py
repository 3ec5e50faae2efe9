"""Helpers shared by the test files (`from helpers import ...`); fixtures live in conftest.py.

pytest's default import mode ("prepend") puts this folder on sys.path, as the folder of
conftest.py and of the test files, whether pytest starts from the repository root or tests/.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from lit_transformer.model import LanguageModel, preset
from lit_transformer.model.config import TransformerConfig
from lit_transformer.recipe.schema import OptimConfig
from lit_transformer.training.rundir import read_metrics

V = 99  # odd tiny vocabulary: a transposed axis crashes instead of broadcasting
B, T = 3, 7  # odd batch and length of the hand-built batches below, for the same reason

# The smallest recipe run that still trains: a 300-token tokenizer on 150 kB of the embedded
# corpus, blocks of 24 tokens, batch 3, one 24-wide layer, float32 on the CPU; no W&B, no
# sample generation. Files that need more say so after it (`[*TINY_RUN, ...]`): in a recipe's
# overrides the later value of a key wins.
TINY_RUN = [
    "tokenizer.vocab_size=300",
    "tokenizer.max_train_bytes=150000",
    "data.max_train_bytes=150000",
    "data.max_val_bytes=20000",
    "data.block_size=24",
    "data.batch_size=3",
    "model.d_model=24",
    "model.n_heads=2",
    "model.d_ff=40",
    "model.n_layers=1",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "trainer.precision=32-true",
    "trainer.num_threads=1",
    "trainer.accelerator=cpu",
    "logger.wandb.mode=disabled",
    "generation.enabled=false",
    # the tiny recipes' named evaluations (base/tiny-eval.yaml) cost seconds per validation; the
    # tests of the eval section (test_eval_*.py) run them
    "eval=[]",
]


RECIPES = Path(__file__).resolve().parent.parent / "recipes"

# A few steps of each tiny recipe at TINY_RUN's sizes, warmup off so that 6 steps move the loss;
# the objective's default precision and sample generation on, as a user's run has them.
SMALL = [
    *TINY_RUN,
    "data.batch_size=4",
    "data.max_length=24",
    "data.max_target_length=8",
    "model.max_seq_len=32",
    "optim.lr=1e-2",
    "optim.warmup_steps=0",
    "trainer.max_steps=10",
    "trainer.val_check_interval=5",
    "trainer.checkpoint_every_n_steps=5",
    "trainer.precision=null",
    "objective.bleu_batches=1",
    "generation.enabled=true",
    "generation.max_new_tokens=4",
    "generation.num_prompts=2",
]
VOCAB = {
    "tiny-mlm": 400,
    "tiny-clm": 400,
    "tiny-span": 420,
    "tiny-seq2seq": 400,
    "tiny-classify": 400,
    "tiny-gptbert": 400,  # a mixture: clm and mntp rows in every batch
}


# TINY_RUN with dropout on, so that resuming has random draws to get right (the failure tests)
TINY_DROPOUT_RUN = [*TINY_RUN, "model.dropout=0.1", "optim.warmup_steps=2"]


def tiny_run_config(run_dir: Path, *extra: str, base: list[str] = TINY_RUN, recipe: str = "tiny-clm"):
    """`recipe` read with `base`'s overrides (TINY_RUN unless a file needs more), run.dir=`run_dir`,
    then `extra`: the run config of the training tests."""
    from lit_transformer.recipe.load import load_recipe

    return load_recipe(RECIPES / f"{recipe}.yaml", [*base, f"run.dir={run_dir}", *extra])


def tiny_dropout_pretrain(run_dir: Path, *extra: str, recipe: str = "tiny-clm") -> list[str]:
    """The `pretrain` command line of `recipe` at TINY_DROPOUT_RUN's sizes in `run_dir`."""
    return ["pretrain", str(RECIPES / f"{recipe}.yaml"), *TINY_DROPOUT_RUN, f"run.dir={run_dir}", *extra]


def one_error_line(capsys) -> str:
    """The error line; other stderr lines (progress bars) may precede it, a traceback may not."""
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1] if err else ""
    assert last.startswith("error: ") and "Traceback" not in err and err.count("error: ") == 1, err
    return last


def pretrain_args(name: str, run_dir: Path, *extra: str) -> list[str]:
    return [
        "pretrain",
        str(RECIPES / f"{name}.yaml"),
        *SMALL,
        f"tokenizer.vocab_size={VOCAB[name]}",
        f"run.dir={run_dir}",
        *extra,
    ]


def tiny_config(arch: str = "decoder", **overrides) -> TransformerConfig:
    """An odd-sized tiny model config."""
    values = dict(
        arch=arch,
        vocab_size=V,
        d_model=24,
        n_heads=3,
        n_layers=2,
        d_ff=37,
        max_seq_len=32,
        relative_buckets=8,
        relative_max_distance=16,
    )
    return TransformerConfig(**{**values, **overrides})


def seeded_model(cfg: TransformerConfig, seed: int = 0) -> LanguageModel:
    """`LanguageModel(cfg)` in eval mode, its weights drawn from `seed` alone."""
    torch.manual_seed(seed)
    return LanguageModel.from_config(cfg).eval()


def assert_causal(model: LanguageModel, batch: int = 3, length: int = 7) -> None:
    """d output[t] / d embedding[t'] is exactly zero for every t' > t, and not zero for some t' <= t
    (a decoder's causality, asserted through its gradients)."""
    captured = {}

    def keep(module, inputs, output):
        output.retain_grad()
        captured["x"] = output

    hook = model.transformer.decoder.embed.register_forward_hook(keep)
    ids = torch.randint(0, model.config.vocab_size, (batch, length))
    try:
        for t in range(length):
            model.zero_grad()
            model(ids)[:, t].sum().backward()
            grad = captured["x"].grad  # (B, T, C)
            assert torch.all(grad[:, t + 1 :] == 0), f"position {t} sees the future"
            assert grad[:, : t + 1].abs().sum() > 0, "the output depends on nothing"
    finally:
        hook.remove()


class StopAt(Callback):
    """Interrupt training after `step` optimizer steps, as a killed job would be."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class RecordSteps(Callback):
    """Write `out`/rank<R>.json when training ends: each training micro-batch of this rank, as
    {"step": optimizer step, "epoch", "loss": as Lightning returns it, "rows": input_ids without padding}."""

    def __init__(self, out):
        self.out, self.rows = Path(out), []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.at = (trainer.global_step, trainer.current_epoch)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        ids = batch["input_ids"]
        mask = batch.get("attention_mask", torch.ones_like(ids))
        rows = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        self.rows.append({"step": self.at[0], "epoch": self.at[1], "loss": float(outputs["loss"]), "rows": rows})

    def on_train_end(self, trainer, module) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.rows))


def losses(run_dir: Path) -> dict[int, float]:
    """{step: train/loss} over every CSV version of a run."""
    return {int(r["step"]): r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}


def assert_resume_matches(config, tmp_path: Path, *, stop: int, steps: int) -> tuple[Path, Path]:
    """Train `config(run_dir, *extra)` whole, and again stopped after `stop` steps then resumed
    with resume=auto: the resumed run's losses equal the whole run's at every step. Returns the
    two run directories (whole, parts)."""
    import pytest

    from lit_transformer.commands.train import train

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(config(whole), progress_bar=False)
    train(config(parts), callbacks=[StopAt(stop)], progress_bar=False)
    assert max(losses(parts)) == stop - 1  # Lightning logs step N's loss at N - 1
    train(config(parts, "resume=auto"), progress_bar=False)
    expected, got = losses(whole), losses(parts)
    assert sorted(got) == sorted(expected) == list(range(steps))
    for step in range(steps):
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step
    return whole, parts


FILLER = "the a of to and in is that it for on with as by at from this be or an".split()
# The label is the keyword's; each keyword has a letter that no filler word has (j, p, z), so
# that a tiny tokenizer's character-level pieces still give it away.
KEYWORDS = {"jug": "kitchen", "plug": "socket", "zulu": "language"}


# examples per entry of an eval section in the end-to-end runs: the classify probe's 8 packages
# need 48 rows to have every dev label among the training rows; its features at a test's batch
# size of 4 were about a quarter of an option_pairs run otherwise (profiled: the whole embedded
# set at every validation)
EVAL_EXAMPLES = {"classify": 48, "heldout": 8, "choice": 8, "pairs": 8, "translate": 8}


def capped_recipe(recipe: Path, folder: Path) -> Path:
    """`recipe` with each eval entry capped to EVAL_EXAMPLES (a recipe in `folder` that extends it
    and restates its eval section: an override cannot reach into the list); `recipe` itself
    where it has no eval section. Kinds, mode tokens and options stay the recipe's."""
    import dataclasses

    import yaml

    from lit_transformer.recipe.eval_schema import EvalConfig
    from lit_transformer.recipe.load import load_recipe, to_dict

    cfg = load_recipe(recipe)
    if not cfg.eval:
        return recipe
    defaults = {
        f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(EvalConfig)
    }
    entries = [
        {**{k: v for k, v in entry.items() if v != defaults[k]}, "max_examples": EVAL_EXAMPLES[entry["kind"]]}
        for entry in to_dict(cfg)["eval"]
    ]
    path = folder / recipe.name
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"extends": str(recipe), "eval": entries}, sort_keys=False))
    return path


def keyword_task(folder: Path, train: int = 240, val: int = 60) -> list[str]:
    """A classification set that a few steps learn: each text is filler words around one keyword,
    and the keyword alone decides the label (chance is 1/3). Returns the data overrides."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("val", val)):
        lines = []
        for _ in range(rows):
            keyword = rng.choice(sorted(KEYWORDS))
            words = rng.choices(FILLER, k=rng.randint(2, 5))
            words.insert(rng.randint(0, len(words)), keyword)
            lines.append(json.dumps({"text": " ".join(words), "label": KEYWORDS[keyword]}))
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return [f"data.train_files=[{folder / 'train.jsonl'}]", f"data.val_files=[{folder / 'val.jsonl'}]"]


# Fine-tuning a pretrained backbone on keyword_task (tests/option_pairs.py, test_multitask.py):
# 200 steps at 1e-2 (the recipe's cosine schedule) learn it from every backbone the option table
# fine-tunes from, under every pretraining seed and precision measured; the 40 steps at 3e-2 used
# before stalled near chance on some (docs/guarantees.md, "CPU kinds": figures and command).
KEYWORD_FINETUNE = [
    "data.max_length=24",
    "data.batch_size=16",
    "optim.lr=1e-2",
    "optim.warmup_steps=0",
    "trainer.max_steps=200",
    "trainer.val_check_interval=200",
]


def assert_learned_keywords(metrics: dict) -> None:
    """The fine-tune learned keyword_task: chance is 1/3 (loss ln 3 = 1.10); the bars' margins
    over the worst run measured are in docs/guarantees.md, "CPU kinds"."""
    assert metrics["val/accuracy"] >= 0.9 and metrics["val/loss"] < 0.3, metrics


def assert_tuned_from(source: Path, tuned: Path) -> None:
    """`tuned` was fine-tuned from `source`'s weights, not from a fresh backbone (which learns
    keyword_task as well, so accuracy alone cannot tell: docs/guarantees.md). The token rows that
    the fine-tune's data never shows get a zero gradient, AdamW moves them by weight decay only,
    and embeddings take none: most rows are the source's, bit for bit; the rest moved."""
    from lit_transformer.model.interop.directories import load_pretrained

    before = load_pretrained(source).transformer.tokens.weight
    after = load_pretrained(tuned).transformer.tokens.weight
    same = int((before == after).all(dim=-1).sum())
    assert len(before) // 2 < same < len(before), f"{same} of {len(before)} token rows unchanged"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(cache: Path, port: int) -> dict[str, str]:
    """The environment of a distributed job's processes: the token cache `cache`, the rendezvous on
    this machine at `port`, one thread each, no hub access."""
    return dict(
        os.environ,
        LIT_TRANSFORMER_CACHE=str(cache),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        HF_HUB_OFFLINE="1",
        # the scripts import this module's callbacks (StopAt) instead of writing their own
        PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")]),
    )


def run_two_ranks(script: Path, args: list[str], cache: Path, cwd: Path, timeout: int) -> None:
    """Run `script` with `args` as rank 0 of a 2-process gloo job on this machine (Lightning starts
    rank 1 by running the script again) with the token cache `cache`. A rank that waits on a
    collective the other never enters hangs: the timeout turns it into a failure. (The files of
    distributed training fork their ranks instead: tests/launcher.py.)"""
    env = job_env(cache, free_port())
    result = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-4000:]


# The strategies of the 2-process jobs and each one's overrides. data.batch_size is per device:
# two ranks of 3 rows make the global batch of 6 that the one-process reference runs (ONE_RANK).
TWO_RANKS = {
    strategy: [f"trainer.strategy={strategy}", "trainer.devices=2", "data.batch_size=3"] for strategy in ("ddp", "fsdp")
}
ONE_RANK = ["data.batch_size=6"]


def two_rank_job(launcher, folder: Path, script: str, args: list[str], cache: Path, timeout: int) -> dict[str, Path]:
    """The 2-process fixture of the distributed tests: `script` (a program's source) written to
    `folder`/run.py and run once as a 2-process gloo job (`launcher`, conftest.py's fixture) with
    `folder` then `args` as its arguments. The script trains under each strategy of TWO_RANKS in
    turn, in this one job, into `folder`/<strategy>; returns {strategy: that folder}."""
    script_path = folder / "run.py"
    script_path.write_text(script)
    launcher.run(script_path, [str(folder), *args], cache, folder, timeout=timeout)
    return {strategy: folder / strategy for strategy in TWO_RANKS}


def optional(module: str, extra: str):
    """`module` of an optional library, imported; a skip naming the library and its extra only
    where the library is not installed at all. An installed library that fails to import, or a
    module of ours that does, fails the test instead of hiding behind a skip."""
    import importlib
    import importlib.util

    import pytest

    library = module.partition(".")[0]
    if importlib.util.find_spec(library) is None:
        reason = f"{library} is not installed: scripts/install.sh installs it with the '{extra}' extra"
        pytest.skip(reason, allow_module_level=True)
    return importlib.import_module(module)


# ----------------------------------------------------------------------------- objective tests


def tiny_objective_config(arch: str, **overrides) -> TransformerConfig:
    """tiny_config at width 30 and d_ff 44, the model of the objective tests."""
    return tiny_config(arch, **{"d_model": 30, "d_ff": 44, **overrides})


def fast_optim(lr: float = 1e-2, **overrides) -> OptimConfig:
    values = dict(lr=lr, weight_decay=0.0, schedule="constant", warmup_steps=0)
    values.update(overrides)
    return OptimConfig(**values)


def mlm_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(4, V, (B, T))
    labels = torch.full((B, T), -100)
    labels[:, 1::3] = ids[:, 1::3]  # the "masked" positions: 2 per row
    labels[2, 5] = ids[2, 5]  # an uneven count per row
    inputs = ids.clone()
    inputs[labels != -100] = 3  # [MASK]
    return {
        "input_ids": inputs,
        "attention_mask": torch.ones(B, T, dtype=torch.long),
        "labels": labels,
        "token_type_ids": torch.zeros(B, T, dtype=torch.long),
    }


def clm_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(4, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[2, 5:] = 0  # a right-padded row
    ids[2, 5:] = 0
    labels = torch.full((B, T), -100)
    labels[:, :-1] = ids[:, 1:]
    labels[2, 4:] = -100  # no target after the last real token
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def seq2seq_batch(eos: int = 1, pad: int = 0) -> dict[str, torch.Tensor]:
    source = torch.randint(4, V, (B, T))
    source_mask = torch.ones(B, T, dtype=torch.long)
    source_mask[1, 6:] = 0
    lengths = [4, 5, 3]  # target tokens before eos
    T_dec = max(lengths) + 1
    labels = torch.full((B, T_dec), -100)
    for row, n in enumerate(lengths):
        labels[row, :n] = torch.randint(4, V, (n,))
        labels[row, n] = eos
    decoder_input_ids = torch.full((B, T_dec), pad)
    decoder_input_ids[:, 1:] = labels[:, :-1].clamp(min=pad)  # start token (pad, as T5), then labels shifted right
    decoder_input_ids[decoder_input_ids == -100] = pad
    decoder_mask = torch.zeros(B, T_dec, dtype=torch.long)
    for row, n in enumerate(lengths):
        decoder_mask[row, : n + 1] = 1
    return {
        "input_ids": source,
        "attention_mask": source_mask,
        "decoder_input_ids": decoder_input_ids,
        "decoder_attention_mask": decoder_mask,
        "labels": labels,
    }


# ----------------------------------------------------------------------------- interop tests


def _lengths_mask(lengths, length):
    return (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).long()  # (B, T)


def padded_interop_batch() -> dict[str, torch.Tensor]:
    """B rows of T encoder ids right-padded to lengths 7, 5, 3, with token types, and decoder ids
    right-padded to lengths 5, 4, 2 (padding 0, ids from 3 up), from one seeded generator."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (B, T), generator=g)
    mask = _lengths_mask((7, 5, 3), T)
    dec = torch.randint(3, V, (B, 5), generator=g)
    return {
        "ids": ids * mask,
        "mask": mask,
        "types": torch.randint(0, 3, (B, T), generator=g) * mask,
        "dec": dec * _lengths_mask((5, 4, 2), 5),
        "dec_mask": _lengths_mask((5, 4, 2), 5),
    }


@torch.no_grad()
def perturb(model, seed=0):
    """Every parameter moved by seeded noise (0.05 std), so that an unmapped bias or a swapped
    norm weight/bias changes the logits; the model in eval mode."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():  # tied parameters are listed once
        p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def tiny_preset(name, **kw):
    """Preset `name` at the interop tests' odd sizes (width 48, 3 heads, d_ff 74; T5 d_kv 10)."""
    sizes = dict(vocab_size=V, d_model=48, n_heads=3, n_layers=2, d_ff=74, max_seq_len=16)
    if name.startswith("t5"):
        sizes.update(head_dim=10, n_decoder_layers=3, relative_buckets=8, relative_max_distance=20)
    if name == "tinyllama-1.1b":
        sizes.update(n_heads=6, n_kv_heads=2)
    return preset(name, **(sizes | kw))
