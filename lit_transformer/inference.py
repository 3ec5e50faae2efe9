"""Commands that use a trained model: `evaluate`, `generate`, `export`. Each resolves its
RUN_OR_CKPT argument with loading.py and asks the registry what the model's objective can do.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import torch

from . import registry
from .errors import RunError
from .loading import label_names, load_for_evaluation, load_language_model, resolve_source, source_objective
from .prompts import complete, encode_prompt
from .rundir import CONFIG_YAML
from .runner import cpu_threads, data_module

# what evaluate prints for the names the objectives log under val/
EVALUATE_NAMES = {"ppl": "perplexity", "bpb": "bits_per_byte", "masked_accuracy": "accuracy",
                  "token_accuracy": "accuracy"}


def evaluate(target: str, data: str | None = None, *, max_batches: int | None = None) -> dict[str, Any]:
    """Validation metrics of a run (its final model) or checkpoint on its validation split or
    on `data` (a file in the run's data format). Keys: loss, perplexity, bits_per_byte,
    accuracy, macro_f1, bleu, ... as fit the objective."""
    from .objectives import evaluate_batches

    source = resolve_source(target)
    cfg = source.run_config
    if cfg is None or source.tokenizer is None:
        raise RunError(f"{target}: evaluate needs a run directory (or a checkpoint inside one) with "
                       f"{CONFIG_YAML} and tokenizer.json")
    data_cfg = cfg.data
    if data is not None:
        if not Path(data).exists():
            raise RunError(f"--data {data}: no such file")
        data_cfg = dataclasses.replace(data_cfg, train_files=[data], val_files=[data], source_files=[],
                                       target_files=[], val_source_files=[], val_target_files=[])
    cfg = dataclasses.replace(cfg, data=data_cfg,
                              tokenizer=dataclasses.replace(cfg.tokenizer, path=str(source.tokenizer)))
    dm = data_module(cfg, None)
    module = load_for_evaluation(source, cfg, dm)
    batches = dm.val_dataloader()
    if not batches:
        raise RunError(f"{target}: the data has no validation split")
    batches = module.evaluation_batches(batches, dm.label_names, label_names(source))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.trainer.precision == "bf16-mixed")
    with cpu_threads(cfg.trainer.num_threads), autocast:  # the precision the run trained with
        values = evaluate_batches(module, batches, max_batches)
    return {"objective": module.objective_name, **{EVALUATE_NAMES.get(k, k): v for k, v in values.items()}}


def generate(target: str, prompt: str, *, max_new_tokens: int = 64, greedy: bool = False, temperature: float = 0.8,
             top_k: int | None = 50, top_p: float | None = None, num_beams: int = 1, seed: int = 0) -> str:
    """Continue (decoder) or transform (encoder-decoder) a prompt with a run's model."""
    from .data.tokenizer import SpecialTokens, load_tokenizer

    source = resolve_source(target)
    if source.tokenizer is None:
        raise RunError(f"{target}: no tokenizer.json next to the model")
    objective = source_objective(source)
    style = registry.spec(objective).prompt
    if style is None:
        generative = [name for name, spec in registry.SPECS.items() if spec.generative]
        raise RunError(f"{target}: a {objective} model does not generate text; generate needs a "
                       f"{', '.join(generative)} run")
    model = load_language_model(source).eval()
    tokenizer = load_tokenizer(source.tokenizer)
    special = SpecialTokens.from_tokenizer(tokenizer)
    ids = encode_prompt(prompt, tokenizer, special, style)
    sampling = not greedy and num_beams == 1
    options = dict(do_sample=sampling, num_beams=num_beams)
    if sampling:
        options.update(temperature=temperature, top_k=top_k, top_p=top_p)
    generator = torch.Generator().manual_seed(seed)
    (text,) = complete(model, tokenizer, special, style, [ids], max_new_tokens=max_new_tokens,
                       generator=generator, **options)
    return text


def export(target: str, out: str, fmt: str = "hf") -> Path:
    """A transformers directory (config.json, model.safetensors, tokenizer.json) of a run's model."""
    from .data.tokenizer import SpecialTokens, load_tokenizer
    from .model.interop import InteropError, export_hf

    if fmt != "hf":
        raise RunError(f"--format {fmt}: the only export format is hf")
    source = resolve_source(target)
    objective = source_objective(source)
    if not registry.spec(objective).lm_head:
        raise RunError(f"{target}: a {objective} run; export writes language models (BERT, GPT-2, T5, LLaMA)")
    model = load_language_model(source)
    extra: dict[str, Any] = {}
    if source.tokenizer is not None:
        special = SpecialTokens.from_tokenizer(load_tokenizer(source.tokenizer))
        ids = {"pad_token_id": special.pad_id, "eos_token_id": special.eos_id, "bos_token_id": special.bos_id}
        if model.config.arch == "encoder_decoder":
            ids["decoder_start_token_id"] = special.decoder_start_id
        extra = {k: v for k, v in ids.items() if v is not None}
    try:
        path = export_hf(model, out, extra_config=extra)
    except InteropError as error:
        raise RunError(str(error)) from None
    if source.tokenizer is not None:
        shutil.copyfile(source.tokenizer, path / "tokenizer.json")
    return path
