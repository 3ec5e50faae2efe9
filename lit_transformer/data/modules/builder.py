"""The data module a run reads, built from its DataPlan: the one place a data module is chosen.
A single objective reads a TextDataModule of its data kind; a mixture, a MixtureDataModule with
one TextDataModule per task. The module comes back not yet prepared (prepare_data, setup).
"""

from __future__ import annotations

import dataclasses

from lit_transformer.data.data_plan import DataPlan
from lit_transformer.data.modules.mixture_module import MixtureDataModule
from lit_transformer.data.modules.text_module import TextDataModule


def build_data_module(
    plan: DataPlan, *, run_dir: str | None = None, model_vocab_size: int | None = None, workers: int = 0
) -> TextDataModule | MixtureDataModule:
    """`plan`'s data module. `run_dir` receives the tokenizer and data files a run keeps;
    `model_vocab_size` checks a tokenizer fits the embedding; `workers` loader processes each."""
    data = dataclasses.replace(plan.data, num_workers=workers)
    if plan.mixture is None:
        return TextDataModule(
            data, plan.tokenizer, plan.kind, seed=plan.seed, run_dir=run_dir, model_vocab_size=model_vocab_size
        )
    tasks = [dataclasses.replace(t, data=dataclasses.replace(t.data, num_workers=workers)) for t in plan.tasks]
    m = plan.mixture
    return MixtureDataModule(
        tasks,
        arch=m.arch,
        tokenizer=plan.tokenizer,
        tokenizer_data=data,
        rates=m.rates,
        weights=m.weights,
        cap=m.cap,
        temperature=m.temperature,
        seed=plan.seed,
        accumulate=m.accumulate,
        run_dir=run_dir,
        model_vocab_size=model_vocab_size,
        mixing=m.mixing,
        max_steps=m.max_steps,
        max_time=m.max_time,
    )
