"""The shared Transformer core: config, attention, positions, layers, heads, generation,
accounting, transformers interop.

Imports nothing from the package but `errors`, `lazy`, `machine` and `constants`: no Lightning, no distributed code.

The public names are imported on first use (PEP 562), so that `from lit_transformer.model.config
import preset` does not import torch: the command line's `info` and `--help` stay instant.
"""

from lit_transformer.lazy import lazy_exports

_EXPORTS = {
    "KVCache": "attention",
    "PRESETS": "config",
    "ConfigError": "config",
    "TransformerConfig": "config",
    "preset": "config",
    "ClassificationHead": "heads",
    "LMHead": "heads",
    "init_weights": "init",
    "LanguageModel": "language_model",
    "Transformer": "transformer",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
