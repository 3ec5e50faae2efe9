"""lit-transformer: pretrain and fine-tune Transformers with PyTorch Lightning.

The public names are imported on first use (PEP 562): `import lit_transformer` (and so the
`lit-transformer` command) loads neither torch nor Lightning until a name needs them.
"""

from lit_transformer.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "PRESETS": "model.config",
    "ConfigError": "model.config",
    "TransformerConfig": "model.config",
    "preset": "model.config",
    "ClassificationHead": "model.heads",
    "KVCache": "model.attention",
    "LanguageModel": "model.language_model",
    "Transformer": "model.transformer",
    "init_weights": "model.init",
    "GenerationConfig": "model.generate",
    "generate": "model.generate",
    "InteropError": "model.interop.rules",
    "export_hf": "model.interop.directories",
    "load_pretrained": "model.interop.directories",
    "save_pretrained": "model.interop.directories",
    "RecipeError": "errors",
    "RunError": "errors",
    "RunConfig": "recipe.schema",
    "load_recipe": "recipe.load",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
