"""Data pipeline: corpora, tokenizers, packing and token cache, collators, data module.

Training code needs: `TextDataModule`, `DataConfig`, `TokenizerConfig`, `SpecialTokens`,
`check_tokenizer`, `DataError` (and `prepare.prepare`, a module of the same name); the rest is
importable from the submodules. The public names are imported on first use (PEP 562): reading
a recipe imports `data.config` without torch or Lightning.
"""

from importlib import import_module

_EXPORTS = {
    "CLMCollator": "collate", "ClassifyCollator": "collate", "MLMCollator": "collate", "Seq2SeqCollator": "collate",
    "batch_generator": "collate", "example_generators": "collate", "DataConfig": "config",
    "TokenizerConfig": "config", "DataError": "errors", "TextDataModule": "module",
    "SpanCorruptionCollator": "span", "span_lengths": "span", "SpecialTokens": "tokenizer",
    "check_tokenizer": "tokenizer", "load_tokenizer": "tokenizer", "save_tokenizer": "tokenizer",
    "train_tokenizer": "tokenizer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
