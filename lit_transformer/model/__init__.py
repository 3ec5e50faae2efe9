"""The shared Transformer core.

The public names are imported on first use (PEP 562), so that `from lit_transformer.model.config
import preset` does not import torch: the command line's `info` and `--help` stay instant.
"""

from importlib import import_module

_EXPORTS = {
    "KVCache": "attention", "PRESETS": "config", "ConfigError": "config", "TransformerConfig": "config",
    "preset": "config", "ClassificationHead": "heads", "LMHead": "heads", "init_weights": "init",
    "LanguageModel": "language_model", "Transformer": "transformer",
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
