"""The collator each data kind reads its batches with, chosen in one place for training's data
module and evaluation's split reader, so that a split is collated as training collates it."""

from __future__ import annotations

from collections.abc import Callable

from lit_transformer.data.batches.collate import (
    ClassifyCollator,
    CLMCollator,
    MLMCollator,
    Seq2SeqCollator,
    word_start_table,
)
from lit_transformer.data.batches.span import SpanCorruptionCollator
from lit_transformer.data.data_config import DataConfig
from lit_transformer.data.tokens.tokenizer import SpecialTokens


def make_collator(kind: str, cfg: DataConfig, tokenizer, special: SpecialTokens) -> Callable:
    """The collator of a data kind (mlm, clm, span, seq2seq, classify): training's (TextDataModule) and
    evaluation's (SplitReader) alike."""
    if kind == "mlm":
        return MLMCollator(
            special=special,
            vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
            probability=cfg.mlm_probability,
            mask_replace_prob=cfg.mask_replace_prob,
            random_replace_prob=cfg.random_replace_prob,
            word_starts=word_start_table(tokenizer) if cfg.whole_word_mask else None,
            document_mask=cfg.document_mask,
        )
    if kind == "clm":
        return CLMCollator(special=special, document_mask=cfg.document_mask)
    if kind == "span":
        return SpanCorruptionCollator(
            block_size=cfg.block_size,
            sentinel_ids=special.sentinel_ids,
            eos_id=special.eos_id,
            decoder_start_id=special.decoder_start_id,
            noise_density=cfg.noise_density,
            mean_span_length=cfg.mean_span_length,
        )
    if kind == "seq2seq":
        return Seq2SeqCollator(special=special)
    return ClassifyCollator(special=special, task=cfg.task)
