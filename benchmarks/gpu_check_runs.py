"""What benchmarks/gpu_check.py's checks share: the Context (device, mode, scratch directory, one
GPT-2 step), a check's own verdict (`need`, CheckFailed), short runs of the tiny recipes with a
probe of where they trained, a keyword classification task that a dozen steps learn, and the
runs' token cache.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (also puts the repository on sys.path)

RECIPES = common.REPO / "recipes"
VOCAB = {"tiny-span": 420}  # span corruption needs room for its sentinels; the others 400
# What every recipe run here shares: little data, no W&B, no generation, no named evaluations,
# a high learning rate without warmup so that a few steps move the loss.
RUN = """tokenizer.max_train_bytes=150000 data.max_train_bytes=150000 data.max_val_bytes=20000
trainer.limit_val_batches=1 trainer.log_every_n_steps=1 trainer.devices=1 logger.wandb.mode=disabled
generation.enabled=false eval=[] optim.lr=1e-2 optim.warmup_steps=0""".split()
# On CPU, tests/helpers.py TINY_RUN's sizes (copied: benchmarks do not import tests); on CUDA the
# recipes' own model, block and batch sizes.
CPU_SIZES = """data.block_size=24 data.batch_size=4 data.max_length=24 data.max_target_length=8
model.max_seq_len=32 trainer.num_threads=1""".split()


class CheckFailed(Exception):
    """A check's own verdict (the numbers are wrong), as opposed to an error while running it."""


def need(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


class Context:
    """What the checks share: the device, the mode, a scratch directory, one GPT-2 step."""

    def __init__(self, device: str, quick: bool, scratch: Path):
        self.device, self.quick, self.scratch = device, quick, scratch
        self.cuda = device == "cuda"
        self._gpt2 = None
        self._runs = 0

    def run_dir(self, name: str) -> Path:
        self._runs += 1
        return self.scratch / f"{self._runs:02d}-{name}"

    def overrides(self, steps: int, evaluations: bool = False) -> list[str]:
        """RUN's overrides for a run of `steps` steps; with `evaluations`, the recipe's eval section runs."""
        sizes = [] if self.cuda else CPU_SIZES
        every = [f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}"]
        every.append(f"trainer.checkpoint_every_n_steps={steps}")
        run = [a for a in RUN if a != "eval=[]"] if evaluations else RUN
        return [*run, f"trainer.accelerator={'gpu' if self.cuda else 'cpu'}", *sizes, *every]

    def gpt2(self):
        """(setup, side, batch) of the GPT-2 small step the mfu and peak_memory checks share:
        12 layers at T=1024 on CUDA (batch 16, 4 with --quick), 2 layers at T=128 on CPU."""
        if self._gpt2 is None:
            layers, T, B = (12, 1024, 4 if self.quick else 16) if self.cuda else (2, 128, 2)
            setup = common.make_setup("gpt2_clm", layers=layers, seq_len=T, batch=B)
            precision = "bf16-mixed" if self.cuda else common.choose_precision("cpu", None)[0]
            side = common.build_ours(setup, self.device, precision)
            self._gpt2 = (setup, side, common.make_batch(setup, self.device), precision)
        return self._gpt2


# ----------------------------------------------------------------------------- recipe runs
def probe_callback():
    from lightning.pytorch.callbacks import Callback

    class Probe(Callback):
        """Where and how the run trained: the weights' device and dtype, the process group."""

        def __init__(self):
            self.seen: dict = {}

        def on_train_start(self, trainer, module):
            weight = next(module.parameters())
            backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
            self.seen = {"device": weight.device.type, "dtype": str(weight.dtype).replace("torch.", "")}
            self.seen |= {"backend": backend, "world_size": trainer.world_size}
            self.seen["checkpointed"] = any(type(m).__name__ == "CheckpointedBlock" for m in module.modules())

    return Probe()


def recipe_run(ctx: Context, recipe: str, overrides: list[str], steps: int, evaluations: bool = False) -> dict:
    """Train `recipe` for `steps` steps in a fresh run directory (with `evaluations`, its eval
    section too); its losses per step (from the run's CSV log), final validation metrics and
    what the Probe saw."""
    from lit_transformer.commands.train import train
    from lit_transformer.recipe.load import load_recipe
    from lit_transformer.training.rundir import read_metrics

    run_dir = ctx.run_dir(recipe)
    vocab = f"tokenizer.vocab_size={VOCAB.get(recipe, 400)}"
    cfg = load_recipe(
        RECIPES / f"{recipe}.yaml", [*ctx.overrides(steps, evaluations), vocab, *overrides, f"run.dir={run_dir}"]
    )
    probe = probe_callback()
    resident = 0
    if ctx.cuda:  # the run's own peak: what earlier checks left allocated (the GPT-2 step) is not its own
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
    metrics = train(cfg, callbacks=[probe], progress_bar=False)
    by_step = {int(r["step"]): r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}
    losses = [by_step[s] for s in sorted(by_step)]
    need(len(losses) == steps, f"{recipe}: {len(losses)} logged losses for {steps} steps ({run_dir})")
    need(all(math.isfinite(x) for x in losses), f"{recipe}: non-finite loss in {losses}")
    peak = torch.cuda.max_memory_allocated() - resident if ctx.cuda else None
    for entry in cfg.eval:  # each named evaluation ran: its numbers are in the final metrics
        need(f"eval/{entry.name}/examples" in metrics, f"{recipe}: eval entry {entry.name} left no numbers ({run_dir})")
    return {"dir": run_dir, "losses": losses, "metrics": metrics, "seen": probe.seen, "peak_bytes": peak}


def keyword_task(folder: Path, rows: int = 240) -> list[str]:
    """A classification set a dozen steps learn (the classify recipe's own task needs hundreds):
    filler words around one keyword, which alone decides the label. Returns the data overrides."""
    import random

    rng = random.Random(0)
    filler = "the a of to and in is that it for on with as by at from this be or an".split()
    labels = {"jug": "kitchen", "plug": "socket", "zulu": "language"}
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", rows), ("val", rows // 5)):
        lines = []
        for _ in range(n):
            keyword = rng.choice(sorted(labels))
            words = rng.choices(filler, k=rng.randint(2, 5))
            words.insert(rng.randint(0, len(words)), keyword)
            lines.append(json.dumps({"text": " ".join(words), "label": labels[keyword]}))
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return [f"data.train_files=[{folder / 'train.jsonl'}]", f"data.val_files=[{folder / 'val.jsonl'}]"]


@contextlib.contextmanager
def token_cache(folder: Path):
    """The runs' token cache in the scratch directory, the variable restored afterwards."""
    saved = os.environ.get("LIT_TRANSFORMER_CACHE")
    os.environ["LIT_TRANSFORMER_CACHE"] = str(folder)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LIT_TRANSFORMER_CACHE", None)
        else:
            os.environ["LIT_TRANSFORMER_CACHE"] = saved
