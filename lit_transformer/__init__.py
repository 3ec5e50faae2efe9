"""lit-transformer: pretrain and fine-tune Transformers with PyTorch Lightning.

The public names are imported on first use (PEP 562): `import lit_transformer` (and so the
`lit-transformer` command) loads neither torch nor Lightning until a name needs them.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "PRESETS": "model.config", "ConfigError": "model.config", "TransformerConfig": "model.config",
    "preset": "model.config", "ClassificationHead": "model.heads", "KVCache": "model.attention",
    "LanguageModel": "model.language_model", "Transformer": "model.transformer", "init_weights": "model.init",
    "GenerationConfig": "model.generate", "generate": "model.generate", "InteropError": "model.interop_maps",
    "export_hf": "model.interop", "load_pretrained": "model.interop", "save_pretrained": "model.interop",
    "RecipeError": "errors", "RunError": "errors", "RunConfig": "config", "load_recipe": "config",
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
