"""Prompts in and text out, the way each objective's model saw its inputs in training
(registry.PromptStyle): shared by `generate` and the sample generations logged during
validation.

Shape legend: B prompts, T prompt length, G generated length.
"""

from __future__ import annotations

import torch

from lit_transformer.data.batches.collate import pad
from lit_transformer.model.generate import generate
from lit_transformer.recipe.registry import PromptStyle


def encode_prompt(text: str, tokenizer, special, style: PromptStyle) -> list[int]:
    """A decoder reads documents that follow a separator; an encoder reads a source ending in
    eos; a span model fills the sentinels in its input (one is appended when the prompt has
    none)."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if style == "continue":
        return ([special.separator_id] if special.separator_id is not None else []) + ids
    end = special.eos_id if special.eos_id is not None else special.sep_id
    if style == "fill_spans" and not set(ids) & set(special.sentinel_ids) and special.sentinel_ids:
        ids = ids + [special.sentinel_ids[0]]
    return ids + ([end] if end is not None else [])


def _stops(special, style: PromptStyle) -> set[int]:
    stop = {special.eos_id} if special.eos_id is not None else set()
    if style == "continue" and special.separator_id is not None:
        stop.add(special.separator_id)
    return stop


def kept_new(special, style: PromptStyle, row: list[int]) -> list[int]:
    """The generated ids of a row that make its text: up to (not including) eos, padding dropped."""
    stop = _stops(special, style)
    out = []
    for token in row:
        if token in stop:
            break
        if token != special.pad_id:
            out.append(token)
    return out


def generated_length(special, style: PromptStyle, row: list[int]) -> int:
    """Tokens the model generated for a row: up to and including eos, not the padding after it."""
    stop = _stops(special, style)
    return next((n + 1 for n, token in enumerate(row) if token in stop), len(row))


def decode_new(tokenizer, special, style: PromptStyle, row: list[int]) -> str:
    """Text of generated ids up to eos; a span model's sentinels are kept to show the spans."""
    return tokenizer.decode(kept_new(special, style, row), skip_special_tokens=style != "fill_spans")


def with_prompt(tokenizer, special, text: str, prompt: list[int], row: list[int]) -> str:
    """A decoder's prompt `text` followed by its continuation `row`. Prompt and new ids are decoded
    together, so that a tokenizer that joins pieces (WordPiece's ##, SentencePiece's ▁, byte-level
    BPE's split characters) joins them across the seam; the decoded prompt is then swapped for the
    text as written, which a tokenizer may have normalised, as transformers' text-generation
    pipeline does. Special tokens (a separator, a mode token) are not shown."""
    head = tokenizer.decode(prompt, skip_special_tokens=True)
    whole = tokenizer.decode(prompt + kept_new(special, "continue", row), skip_special_tokens=True)
    return text + whole[len(head) :] if whole.startswith(head) else whole


def show_prompt(tokenizer, style: PromptStyle, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=style != "fill_spans")


def complete_ids(
    model,
    special,
    style: PromptStyle,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    generator: torch.Generator | None = None,
    bidirectional_prompt: bool = False,
    **options,
) -> list[list[int]]:
    """Generate from token-id prompts; returns the new ids of each row (eos, then padding, where
    it stopped early). bidirectional_prompt: a decoder reads its prompt bidirectionally (a model
    trained with prefix-LM attention modes)."""
    device = next(model.parameters()).device
    ids = pad(prompts, special.pad_id or 0).to(device)  # (B, T)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        mask[i, : len(p)] = 1
    continues = style == "continue"
    limit = model.config.max_seq_len - (ids.shape[1] if continues else 0)
    out = generate(
        model,
        ids,
        mask,
        max_new_tokens=max(1, min(max_new_tokens, limit)),
        eos_token_id=special.separator_id if continues else special.eos_id,
        pad_token_id=special.pad_id or 0,
        decoder_start_token_id=None if continues else special.decoder_start_id,
        generator=generator,
        bidirectional_prompt=bidirectional_prompt,
        **options,
    )
    new = out[:, ids.shape[1] :] if continues else out[:, 1:]  # (B, G): after the prompt, or the start token
    return new.tolist()


def complete(
    model,
    tokenizer,
    special,
    style: PromptStyle,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    generator: torch.Generator | None = None,
    bidirectional_prompt: bool = False,
    **options,
) -> list[str]:
    """The new text of each prompt (complete_ids decoded)."""
    rows = complete_ids(
        model,
        special,
        style,
        prompts,
        max_new_tokens=max_new_tokens,
        generator=generator,
        bidirectional_prompt=bidirectional_prompt,
        **options,
    )
    return [decode_new(tokenizer, special, style, row) for row in rows]
