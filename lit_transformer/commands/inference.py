"""Commands that use a trained model: `evaluate`, `generate`, `export`. Each resolves its
RUN_OR_CKPT argument with loading.py and asks the registry what the model's objective can do.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import torch

from lit_transformer.commands.loading import (
    label_names,
    load_for_evaluation,
    load_language_model,
    resolve_source,
    source_model_config,
    source_objective,
)
from lit_transformer.commands.train import cpu_threads, data_module
from lit_transformer.errors import RunError
from lit_transformer.evaluation.batch_generate import (
    BATCH_ROWS,
    BATCH_TOKENS,
    BatchGenerator,
    ContextNotes,
    Decoding,
    check_batching,
    decoding_device,
    decoding_dtype,
    translation_scores,
)
from lit_transformer.evaluation.batch_generate import generate_file as run_file
from lit_transformer.evaluation.heldout import EVALUATE_NAMES
from lit_transformer.recipe import registry
from lit_transformer.training.rundir import CONFIG_YAML


def evaluate(
    target: str,
    data: str | None = None,
    *,
    max_batches: int | None = None,
    data_target: str | None = None,
    num_beams: int | None = None,
    length_penalty: float | None = None,
    max_new_tokens: int | None = None,
    batch_size: int | None = BATCH_ROWS,
    batch_tokens: int | None = BATCH_TOKENS,
    dtype: str = "auto",
    device: str = "auto",
    task: str | None = None,
    progress_bar: bool = True,
    split: str = "validation",
) -> dict[str, Any]:
    """Metrics of a run (its final model) or checkpoint on its validation split, its test split
    (`split="test"`: the recipe's data.test_files) or on `data` (a file in the run's data
    format, or with `data_target` a pair of aligned source/target files). Keys: loss,
    perplexity, bits_per_byte (causal LM), accuracy, macro_f1, ... as fit
    the objective; a translation model (seq2seq with objective.bleu) also decodes every
    sentence (the first max_batches batches' worth with max_batches) and reports BLEU and chrF
    with sacrebleu's signatures, and its decoding speed (sentences_per_s, tokens_per_s) and
    weights' dtype. Decoding: objective.num_beams and objective.length_penalty unless given, at
    most data.max_target_length new tokens unless given, weights in `dtype` (decoding_dtype; the
    losses are computed as the run trained, whatever `dtype` says).

    A mixture run reports every task's metrics as `<task>/<metric>` (clm/bits_per_byte); with
    `task`, that task's alone under the single objective's keys. `max_batches` counts per task."""
    from lit_transformer.data.sources.corpus import build_sources
    from lit_transformer.data.sources.files import ReadStats
    from lit_transformer.objectives import evaluate_batches

    check_batching(batch_size, batch_tokens)
    decoding_dtype(dtype, decoding_device(device))  # a bad name fails before the losses are computed
    source = resolve_source(target)
    cfg = source.run_config
    if cfg is None or source.tokenizer is None:
        raise RunError(
            f"{target}: evaluate needs a run directory (or a checkpoint inside one) with "
            f"{CONFIG_YAML} and tokenizer.json"
        )
    data_cfg = cfg.data
    if split not in ("validation", "test"):
        raise RunError(f"--split {split}: evaluate reads the validation or the test split")
    if split == "test" and data is not None:
        raise RunError(f"--split test reads the run's data.test_files; --data {data} is evaluated as it is")
    if data_target is not None and data is None:
        raise RunError(f"--data-target {data_target}: needs --data (the source file it aligns with)")
    if data is not None:
        for flag, path in (("--data", data), ("--data-target", data_target)):
            if path is not None and not Path(path).exists():
                raise RunError(f"{flag} {path}: no such file")
        # the whole file: none of the run's caps on validation text
        data_cfg = dataclasses.replace(data_cfg, max_val_bytes=None, max_documents=None, test_files=[])
        if data_target is not None:
            data_cfg = dataclasses.replace(
                data_cfg,
                train_files=[],
                val_files=[],
                source_files=[data],
                target_files=[data_target],
                val_source_files=[data],
                val_target_files=[data_target],
            )
        else:
            data_cfg = dataclasses.replace(
                data_cfg,
                train_files=[data],
                val_files=[data],
                source_files=[],
                target_files=[],
                val_source_files=[],
                val_target_files=[],
            )
    style = registry.spec(source_objective(source)).prompt_for(source_model_config(source).arch)
    translation = style == "transform" and cfg.objective.bleu and not cfg.tasks
    cfg = dataclasses.replace(
        cfg,
        # evaluation reads the validation or test split from the token cache: a run trained from a
        # litdata store is evaluated without litdata and without writing its training shards
        data=dataclasses.replace(data_cfg, store="cache"),
        tokenizer=dataclasses.replace(cfg.tokenizer, path=str(source.tokenizer)),
        # BLEU is decoded below, over every sentence, not a few validation batches
        objective=dataclasses.replace(cfg.objective, bleu=False),
    )
    dm = data_module(cfg, None)
    module = load_for_evaluation(source, cfg, dm)
    try:
        streams = module.evaluation_streams(dm, task, split)
    except KeyError as error:
        raise RunError(f"{target}: {error.args[0]}") from None
    # [] when there is no split (a streaming DataLoader has no len(), so no truth test)
    if not streams or any(isinstance(batches, list) for _, batches in streams):
        named = " (the recipe names no data.test_files)" if split == "test" else ""
        raise RunError(f"{target}: the data has no {split} split{named}")
    module.measure_bytes_on(dm, split)
    out: dict[str, Any] = {"objective": module.objective_name, **({"task": task} if task is not None else {})}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.trainer.precision == "bf16-mixed")
    for prefix, batches in streams:
        batches = module.evaluation_batches(batches, dm.label_names, label_names(source))
        with cpu_threads(cfg.trainer.num_threads), autocast:  # the precision the run trained with
            values = evaluate_batches(module, batches, max_batches)
        for key, value in values.items():
            name = key.rsplit("/", 1)[-1]  # a mixture's metrics come as <task>/<name>
            out[prefix + EVALUATE_NAMES.get(name, name)] = value
    if translation:
        decoding = decoding_options(
            max_new_tokens=max_new_tokens or cfg.data.max_target_length,
            greedy=True,
            num_beams=num_beams if num_beams is not None else cfg.objective.num_beams,
            length_penalty=length_penalty if length_penalty is not None else cfg.objective.length_penalty,
        )
        # Cast in place: the losses above were the model's last float32 use. `generate --input`
        # with the same options and dtype gives the same text.
        where = decoding_device(device)
        model = module.model.to(device=where, dtype=decoding_dtype(dtype, where))
        generate_text = BatchGenerator(
            model, dm.tokenizer, dm.special_tokens, style, decoding, batch_size=batch_size, batch_tokens=batch_tokens
        )
        pairs = build_sources(data_cfg, registry.spec(module.objective_name).data)[split].iterate(ReadStats())
        limit = None if max_batches is None else max_batches * (data_cfg.eval_batch_size or data_cfg.batch_size)
        out.update(translation_scores(generate_text, pairs, limit=limit, progress_bar=progress_bar))
    return out


def batch_generator(
    target: str,
    decoding: Decoding,
    *,
    batch_size: int | None = BATCH_ROWS,
    batch_tokens: int | None = BATCH_TOKENS,
    dtype: str = "auto",
    device: str = "auto",
    notes: ContextNotes | None = None,
    bidirectional_prompt: bool = False,
    mode_token: str | None = None,
    show_prompt: bool = False,
) -> BatchGenerator:
    """A run's model (its weights in `dtype`: decoding_dtype), tokenizer and prompt style, ready
    to generate from text. A decoder may read the prompt bidirectionally (a prefix, as a
    mixture's prefix LM trained it); a mode token (a mixture's, e.g. [S2S]) is put before every
    prompt; show_prompt: a decoder's outputs start with their prompt."""
    from lit_transformer.data.tokens.tokenizer import SpecialTokens, load_tokenizer

    source = resolve_source(target)
    if source.tokenizer is None:
        raise RunError(f"{target}: no tokenizer.json next to the model")
    objective = source_objective(source)
    arch = source_model_config(source).arch
    style = registry.spec(objective).prompt_for(arch)
    if style is None:
        generative = [name for name, spec in registry.SPECS.items() if spec.generative(arch)]
        raise RunError(
            f"{target}: a {objective} {arch} model does not generate text; generate needs "
            f"a {', '.join(generative) or 'decoder or encoder-decoder'} run"
        )
    where = decoding_device(device)
    model = load_language_model(source).eval().to(device=where, dtype=decoding_dtype(dtype, where))
    tokenizer = load_tokenizer(source.tokenizer)
    if bidirectional_prompt and arch != "decoder":
        raise RunError(f"--bidirectional-prompt: a {arch} model's prompt is read by its encoder, bidirectional already")
    mode_id = None
    if mode_token is not None:
        mode_id = tokenizer.token_to_id(mode_token)
        if mode_id is None or mode_token not in {t.content for t in tokenizer.get_added_tokens_decoder().values()}:
            raise RunError(f"--mode-token {mode_token}: not a special token of {source.tokenizer}")
    return BatchGenerator(
        model,
        tokenizer,
        SpecialTokens.from_tokenizer(tokenizer),
        style,
        decoding,
        batch_size=batch_size,
        batch_tokens=batch_tokens,
        notes=notes,
        bidirectional_prompt=bidirectional_prompt,
        mode_token_id=mode_id,
        show_prompt=show_prompt,
    )


def decoding_options(
    *,
    max_new_tokens: int = 64,
    greedy: bool = False,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    num_beams: int = 1,
    length_penalty: float = 0.6,
    seed: int = 0,
) -> Decoding:
    """The command line's decoding flags: sampling unless greedy or beam search."""
    if num_beams < 1:
        raise RunError(f"--num-beams {num_beams} must be at least 1")
    if max_new_tokens < 1:
        raise RunError(f"--max-new-tokens {max_new_tokens} must be at least 1")
    sampling = not greedy and num_beams == 1
    if sampling and not temperature > 0:
        raise RunError(f"--temperature {temperature} must be positive")
    if sampling and top_p is not None and not 0 < top_p <= 1:
        raise RunError(f"--top-p {top_p} is outside (0, 1]")
    return Decoding(
        max_new_tokens=max_new_tokens,
        num_beams=num_beams,
        length_penalty=length_penalty,
        do_sample=sampling,
        temperature=temperature,
        top_k=top_k if sampling else None,
        top_p=top_p if sampling else None,
        seed=seed,
    )


def generate(
    target: str,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    greedy: bool = False,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    num_beams: int = 1,
    length_penalty: float = 0.6,
    seed: int = 0,
    bidirectional_prompt: bool = False,
    mode_token: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    continuation_only: bool = False,
) -> str:
    """Continue (decoder) or transform (encoder-decoder) a prompt with a run's model. A decoder's
    output is the prompt followed by its continuation (continuation_only: the new text alone); an
    encoder-decoder's is its output alone."""
    decoding = decoding_options(
        max_new_tokens=max_new_tokens,
        greedy=greedy,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        num_beams=num_beams,
        length_penalty=length_penalty,
        seed=seed,
    )
    generate_text = batch_generator(
        target,
        decoding,
        batch_size=1,
        dtype=dtype,
        device=device,
        bidirectional_prompt=bidirectional_prompt,
        mode_token=mode_token,
        show_prompt=not continuation_only,
    )
    (text,) = generate_text([prompt])
    generate_text.notes.finish()
    return text


def generate_file(
    target: str,
    input: str,
    output: str | None = None,
    *,
    column: str | None = None,
    batch_size: int | None = BATCH_ROWS,
    batch_tokens: int | None = BATCH_TOKENS,
    dtype: str = "auto",
    device: str = "auto",
    progress_bar: bool = True,
    bidirectional_prompt: bool = False,
    mode_token: str | None = None,
    **decoding: Any,
) -> int:
    """One output line per input of a file (its lines, or a jsonl/csv/tsv column), in input
    order, to `output` (a .jsonl output holds {"input", "output"} objects) or stdout; a decoder's
    outputs are continuations alone. The throughput goes to stderr at the end."""
    import sys

    if not Path(input).is_file():  # before loading the model
        raise RunError(f"--input {input}: no such file")
    check_batching(batch_size, batch_tokens)
    generate_text = batch_generator(
        target,
        decoding_options(**decoding),
        batch_size=batch_size,
        batch_tokens=batch_tokens,
        dtype=dtype,
        device=device,
        bidirectional_prompt=bidirectional_prompt,
        mode_token=mode_token,
    )
    if output is None:
        return run_file(generate_text, input, sys.stdout, column=column, progress_bar=progress_bar)
    try:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        file = open(output, "w", encoding="utf-8")
    except OSError as error:
        raise RunError(f"--output {output}: cannot write ({error.strerror})") from None
    with file:
        return run_file(
            generate_text, input, file, column=column, jsonl=output.endswith(".jsonl"), progress_bar=progress_bar
        )


def export(target: str, out: str, fmt: str = "hf") -> Path:
    """A transformers directory (config.json, model.safetensors, tokenizer.json) of a run's model."""
    from lit_transformer.data.tokens.tokenizer import SpecialTokens, load_tokenizer
    from lit_transformer.model.interop.directories import InteropError, export_hf

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
