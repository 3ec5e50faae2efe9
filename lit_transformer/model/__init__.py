"""The shared Transformer core."""

from .attention import KVCache
from .config import PRESETS, ConfigError, TransformerConfig, preset
from .heads import ClassificationHead, LMHead
from .init import init_weights
from .language_model import LanguageModel
from .transformer import Transformer

__all__ = [
    "ConfigError", "ClassificationHead", "KVCache", "LMHead", "LanguageModel", "PRESETS", "Transformer",
    "TransformerConfig", "init_weights", "preset",
]
