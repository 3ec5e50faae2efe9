"""Data pipeline: corpora, tokenizers, packing and token cache, collators, samplers, data modules.

Imports nothing from the package but `errors` and `lazy`.

Training code needs: `TextDataModule`, `DataConfig`, `TokenizerConfig`, `SpecialTokens`,
`check_tokenizer`, `DataError` (and `prepare.prepare`, a module of the same name); the rest is
importable from the submodules. The public names are imported on first use (PEP 562): reading
a recipe imports `data.config` without torch or Lightning.
"""

from lit_transformer.lazy import lazy_exports

_EXPORTS = {
    "CLMCollator": "collate",
    "ClassifyCollator": "collate",
    "MLMCollator": "collate",
    "Seq2SeqCollator": "collate",
    "batch_generator": "collate",
    "example_generators": "collate",
    "DataConfig": "settings",
    "TokenizerConfig": "settings",
    "DataError": "errors",
    "TextDataModule": "module",
    "SpanCorruptionCollator": "span",
    "span_lengths": "span",
    "SpecialTokens": "tokenizer",
    "check_tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "save_tokenizer": "tokenizer",
    "train_tokenizer": "tokenizer",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
