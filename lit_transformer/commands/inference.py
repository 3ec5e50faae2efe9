"""Commands that use a trained model to write: `generate` and `export` (`evaluate` is
evaluate.py). Each resolves its RUN_OR_CKPT argument with run/loading.py and asks the registry what
the model's objective can do.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

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
)
from lit_transformer.evaluation.batch_generate import generate_file as run_file
from lit_transformer.recipe import registry
from lit_transformer.run.loading import (
    load_language_model,
    resolve_source,
    source_model_config,
    source_objective,
)


def text_generator(
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
    generate_text = text_generator(
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
    generate_text = text_generator(
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
