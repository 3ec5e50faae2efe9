"""Data pipeline: corpora, tokenizers, packing and token cache, collators, samplers, data modules.

Imports nothing from the package but `errors`, `lazy`, `machine` and `constants`.

Training code needs: `TextDataModule`, `DataConfig`, `TokenizerConfig`, `SpecialTokens`,
`check_tokenizer` (and `tokens.prepare.prepare`; `DataError` is in lit_transformer.errors); the rest is
importable from the submodules. The public names are imported on first use (PEP 562): reading
a recipe imports `data.data_config` without torch or Lightning.
"""

from lit_transformer.lazy import lazy_exports

_EXPORTS = {
    "CLMCollator": "batches.collate",
    "ClassifyCollator": "batches.collate",
    "MLMCollator": "batches.collate",
    "Seq2SeqCollator": "batches.collate",
    "batch_generator": "batches.collate",
    "example_generators": "batches.collate",
    "DataConfig": "data_config",
    "TokenizerConfig": "data_config",
    "TextDataModule": "modules.text_module",
    "SpanCorruptionCollator": "batches.span",
    "span_lengths": "batches.span",
    "SpecialTokens": "tokens.tokenizer",
    "check_tokenizer": "tokens.tokenizer",
    "load_tokenizer": "tokens.tokenizer",
    "save_tokenizer": "tokens.tokenizer",
    "train_tokenizer": "tokens.tokenizer",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
