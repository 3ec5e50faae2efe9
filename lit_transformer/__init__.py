"""lit-transformer: pretrain and fine-tune Transformers with PyTorch Lightning."""

from .model import (
    PRESETS, ClassificationHead, ConfigError, KVCache, LanguageModel, Transformer, TransformerConfig,
    init_weights, preset,
)

__version__ = "0.1.0"
__all__ = [
    "PRESETS", "ClassificationHead", "ConfigError", "KVCache", "LanguageModel", "Transformer",
    "TransformerConfig", "init_weights", "preset",
]
