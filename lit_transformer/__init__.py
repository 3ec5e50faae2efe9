"""lit-transformer: pretrain and fine-tune Transformers with PyTorch Lightning."""

from .model import (
    PRESETS, ClassificationHead, ConfigError, KVCache, LanguageModel, Transformer, TransformerConfig,
    init_weights, preset,
)
from .config import RecipeError, RunConfig, load_recipe
from .model.generate import GenerationConfig, generate
from .model.interop import InteropError, export_hf, load_pretrained, save_pretrained

__version__ = "0.1.0"
__all__ = [
    "PRESETS", "ClassificationHead", "RecipeError", "RunConfig", "load_recipe", "ConfigError", "GenerationConfig", "InteropError", "KVCache", "LanguageModel", "Transformer",
    "TransformerConfig", "export_hf", "generate", "init_weights", "load_pretrained", "preset", "save_pretrained",
]
