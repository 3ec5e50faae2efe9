"""Data pipeline: corpora, tokenizers, packing and token cache, collators, data module.

Training code needs: `TextDataModule`, `DataConfig`, `TokenizerConfig`, `prepare`,
`SpecialTokens`, `check_tokenizer`, `DataError`; the rest is importable from the submodules.
"""

from lit_transformer.data.collate import (CLMCollator, ClassifyCollator, MLMCollator, Seq2SeqCollator,
                                          batch_generator, example_generators)
from lit_transformer.data.config import DataConfig, TokenizerConfig
from lit_transformer.data.errors import DataError
from lit_transformer.data.module import TextDataModule
from lit_transformer.data.prepare import prepare
from lit_transformer.data.span import SpanCorruptionCollator, span_lengths
from lit_transformer.data.tokenizer import (SpecialTokens, check_tokenizer, load_tokenizer, save_tokenizer,
                                            train_tokenizer)

__all__ = [
    "CLMCollator", "ClassifyCollator", "DataConfig", "DataError", "MLMCollator", "Seq2SeqCollator",
    "SpanCorruptionCollator", "SpecialTokens", "TextDataModule", "TokenizerConfig", "batch_generator",
    "check_tokenizer", "example_generators", "load_tokenizer", "prepare", "save_tokenizer", "span_lengths", "train_tokenizer",
]
