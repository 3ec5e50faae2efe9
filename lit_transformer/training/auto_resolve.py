"""The values of a recipe's `auto` keys when the run starts (the rules: recipe/auto_rules.py;
the resolver, run/resolve.py, puts them in the run config).

`auto_values` reads the training corpus's size, measures the training step speed on this
machine for a couple of seconds where the budget is `trainer.max_time`, applies the rules and
prints one line saying what it chose and why. A resumed run takes the values its config.yaml
recorded instead: a new measurement could size another model than the checkpoint's.

Processes of one run must agree: the process that starts the others (Lightning's launcher)
passes its values on in an environment variable; processes started all at once (torchrun,
srun) with a time budget to measure are refused, with the command that resolves once.

No torch at import (the resolver asks every recipe here, `--print-config` included): the probe,
the process checks and the launcher's count import it when a recipe has `auto` values.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lit_transformer.data.data_config import AUTO, DataConfig
from lit_transformer.errors import RecipeError
from lit_transformer.machine import cpu_threads
from lit_transformer.model.config import TransformerConfig
from lit_transformer.recipe import auto_rules
from lit_transformer.recipe.load import load_recipe
from lit_transformer.recipe.model_section import stand_in_model
from lit_transformer.recipe.schema import RunConfig, TrainerConfig

ENV = "LIT_TRANSFORMER_AUTO"  # the resolved values, as JSON, for the processes a launcher starts
PROBE_SECONDS = 1.5  # timed steps of the speed probe (after one untimed step)
PROBE_MIN_STEPS = 3


def corpus_bytes(data: DataConfig) -> int:
    """Bytes of training text: the training files (or the embedded corpus's training split),
    at most data.max_train_bytes."""
    from lit_transformer.data.sources.files import resolve_files

    if data.train_files:
        total = sum(p.stat().st_size for p in resolve_files(data.train_files, "data.train_files", data.format))
    else:
        from lit_transformer.data.sources.stdlib import corpus_split

        total = sum(path.stat().st_size for _, path in corpus_split("train", data.val_fraction))
    return min(total, data.max_train_bytes) if data.max_train_bytes is not None else total


def measure_flops_per_second(model: TransformerConfig, trainer: TrainerConfig, data: DataConfig) -> float:
    """Training FLOP/s of one process on `model` at the recipe's batch, block, precision and
    threads: forward, cross-entropy, backward and an AdamW step on random tokens."""
    import torch
    import torch.nn.functional as F

    from lit_transformer.model.language_model import LanguageModel
    from lit_transformer.training import preflight

    batch = data.batch_size if data.batch_size != AUTO else auto_rules.STAND_IN["batch_size"]
    block = data.block_size
    device = "cuda" if preflight.on_gpu(trainer) and torch.cuda.is_available() else "cpu"
    precision = trainer.precision or "32-true"
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16 if precision.startswith("16") else None
    generator = torch.Generator().manual_seed(0)
    with cpu_threads(trainer.num_threads if device == "cpu" else None):
        lm = LanguageModel(model.replace(dropout=0.0)).to(device)
        if precision == "bf16-true":
            lm = lm.to(torch.bfloat16)
        optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-4)
        ids = torch.randint(model.vocab_size, (batch, block), generator=generator).to(device)
        decoder = {"decoder_input_ids": ids} if model.arch == "encoder_decoder" else {}

        def step() -> None:
            with torch.autocast(device, dtype=dtype, enabled=dtype is not None and precision.endswith("mixed")):
                logits = lm(ids, **decoder)
                loss = F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()

        step()  # allocations, kernel choices
        steps, start = 0, time.perf_counter()
        while steps < PROBE_MIN_STEPS or time.perf_counter() - start < PROBE_SECONDS:
            step()
            steps += 1
        seconds = time.perf_counter() - start
    return steps * batch * block * auto_rules.flops_per_token(model, block) / seconds


Measure = Callable[[TransformerConfig, TrainerConfig, DataConfig], float]


def auto_values(cfg: RunConfig, *, measure: Measure | None = None, quiet: bool = False) -> dict:
    """The plain value of each `auto` key of `cfg` (auto_rules.auto_keys; none: {}), model.size as
    the shape's fields. `measure` gives one process's training FLOP/s for a model (default
    measure_flops_per_second; tests pass a fixed speed)."""
    trainer, data, run_dir = cfg.trainer, cfg.data, cfg.run.dir
    measure = measure or measure_flops_per_second

    def measured_here(keys: list[str]) -> dict:
        """This process measures the speed and applies the rules (one pass: auto_rules.resolve)."""
        world = preflight.processes_per_node(trainer) * trainer.num_nodes
        corpus = corpus_bytes(data)

        def speed(model: TransformerConfig) -> float:
            return measure(model, trainer, data)

        timed = speed if trainer.max_time is not None else None
        resolved = auto_rules.resolve(cfg, base, corpus, world, timed)
        if not quiet and is_main_process():
            print(f"{resolved.summary()}; from {corpus / 1e6:.2f} MB of training text", file=sys.stderr)
        return resolved.values

    # the model the rules size from, before the keys: the rules then run in one pass (a recipe
    # without `auto` values describes its model already; its stand-in is that model)
    base = stand_in_model(cfg)
    keys = auto_rules.auto_keys(cfg)
    if not keys:
        return {}
    from lit_transformer.training import preflight  # torch: only for a recipe with `auto` values
    from lit_transformer.training.distributed import is_main_process

    saved = _saved_values(Path(run_dir), cfg.resume, keys)
    inherited = json.loads(os.environ.get(ENV, "{}"))
    if saved is not None:
        return saved
    if not is_main_process() and inherited.get("run_dir") == run_dir:
        return inherited["values"]
    if _joined_group():
        return _resolved_on_rank_zero(measured_here, keys)
    if trainer.max_time is not None and _started_together():
        raise RecipeError(
            f"{keys[0]}=auto measures this machine's speed, and every process of a torchrun or srun job would "
            "measure its own: resolve once with `lit-transformer pretrain RECIPE --print-config > resolved.yaml` "
            "and start the job on resolved.yaml"
        )
    values = measured_here(keys)
    # the processes Lightning starts for this run (they are not the main process) take these
    os.environ[ENV] = json.dumps({"run_dir": run_dir, "values": values})
    return values


def _resolved_on_rank_zero(resolve: Callable[[list[str]], dict], keys: list[str]) -> dict:
    """A later run of a job whose ranks are already started (a script or sweep that trains
    again): the launcher passed no values for it, so rank 0 resolves and the others take its
    values (or its error), where each measuring its own speed could size another model."""
    import torch.distributed as dist

    outcome: list = [None]
    if dist.get_rank() == 0:
        try:
            outcome = [resolve(keys)]
        except Exception as error:  # the other ranks wait on the broadcast: they raise it too
            outcome = [error]
    dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


def _saved_values(run_dir: Path, resume: str | None, keys: list[str]) -> dict | None:
    """What a resumed run's config.yaml recorded for the `auto` keys; None when not resuming."""
    from lit_transformer.training.distributed import is_main_process

    saved = run_dir / "config.yaml"
    if resume is None or not saved.is_file():
        return None
    old = load_recipe(saved)
    values: dict = {}
    for key in keys:
        if key == "model.size":
            values[key] = {k: getattr(old.model, k) for k in ("d_model", "n_layers", "n_heads", "d_ff")}
        else:
            section, name = key.split(".")
            values[key] = getattr(getattr(old, section), name)
    if is_main_process():
        print(f"auto: resuming with the values {saved} recorded", file=sys.stderr)
    return values


def _joined_group() -> bool:
    """Whether this process is already one of several ranks of a started process group."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _started_together() -> bool:
    """Whether this process is one of several a launcher outside Lightning started (torchrun, srun)."""
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")) or 1)
    return world > 1
