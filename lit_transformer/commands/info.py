"""`lit-transformer info PRESET_OR_RECIPE`: size, training compute and KV-cache memory of a
model, from its config alone (nothing is built or allocated). See model/accounting.py for
the conventions behind each number.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence
from typing import Any

from lit_transformer.errors import RecipeError, closest
from lit_transformer.model.accounting import (
    EMBEDDING_KEYS,
    count_parameters,
    cross_kv_cache_bytes_per_source_token,
    kv_cache_bytes_per_token,
    non_embedding_parameters,
    parameter_breakdown,
    train_flops,
)
from lit_transformer.model.config import PRESETS, ConfigError, TransformerConfig, preset
from lit_transformer.recipe.load import load_recipe, model_config, model_overrides

BF16_BYTES = 2


def load_model_config(target: str, overrides: Sequence[str] = ()) -> tuple[str, str | None, TransformerConfig]:
    """(name, preset name or None, config) for a preset name or a recipe path. A recipe is read
    by `load_recipe`, as every command reads it (extends and key=value overrides applied); a
    fine-tuning recipe's model is finetune.from's config with the recipe's fields on top."""
    if target in PRESETS and not os.path.isfile(target):
        if overrides:
            raise RecipeError("key=value overrides apply to recipes, not presets")
        return target, target, preset(target)
    if not os.path.isfile(target):
        if target.endswith((".yaml", ".yml")) or os.sep in target:
            raise RecipeError(f"{target}: no such recipe file")
        raise ConfigError(f"unknown preset {target!r}{closest(target, PRESETS)}; presets: {', '.join(PRESETS)}")
    recipe = load_recipe(target, overrides)
    name = os.path.splitext(os.path.basename(target))[0]
    if recipe.finetune.from_ is None:
        return name, recipe.model.preset, model_config(recipe)
    from lit_transformer.commands.loading import resolve_source, source_model_config  # reads the source's model config

    config = source_model_config(resolve_source(recipe.finetune.from_))
    try:
        return name, recipe.model.preset, config.replace(**model_overrides(recipe))
    except ConfigError as error:
        raise RecipeError(f"{target}: {error}") from None


def info(
    target: str, overrides: Sequence[str] = (), seq_len: int | None = None, decoder_seq_len: int | None = None
) -> dict[str, Any]:
    """Accounting for a preset name or recipe path, as a JSON-serialisable dict.

    FLOPs are at `seq_len` (default the config's max_seq_len) and, for encoder-decoder models,
    `decoder_seq_len` targets (default `seq_len`); KV-cache bytes are for bfloat16.
    """
    name, preset_name, cfg = load_model_config(target, overrides)
    seq_len = seq_len or cfg.max_seq_len
    if cfg.arch == "encoder_decoder":
        decoder_seq_len = decoder_seq_len or seq_len
    flops = train_flops(cfg, seq_len, decoder_seq_len)
    return {
        "name": name,
        "preset": preset_name,
        "source": os.path.abspath(target) if os.path.isfile(target) else "preset",
        "arch": cfg.arch,
        "parameters": count_parameters(cfg),
        "non_embedding_parameters": non_embedding_parameters(cfg),
        "parameter_breakdown": parameter_breakdown(cfg),
        "seq_len": seq_len,
        "decoder_seq_len": flops.decoder_seq_len,
        "flops_token": "source token" if cfg.arch == "encoder_decoder" else "token",
        "train_flops_per_token": flops.per_token,
        "train_flops_per_sequence": flops.total,
        "attention_flops_fraction": flops.attention / flops.total,
        "kv_cache_dtype": "bfloat16",
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(cfg, BF16_BYTES),
        "cross_kv_cache_bytes_per_source_token": cross_kv_cache_bytes_per_source_token(cfg, BF16_BYTES),
        "config": cfg.to_dict(),
    }


def _si(value: float, unit: str = "") -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.4g} {prefix}{unit}"
    return f"{value:.4g} {unit}".rstrip()


def _bytes(value: int) -> str:
    for factor, prefix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if value >= factor:
            return f"{value / factor:.4g} {prefix} ({value:,} B)"
    return f"{value:,} B"


def format_info(d: dict[str, Any]) -> str:
    """A human-readable table of an `info` dict."""
    source = "preset" if d["source"] == "preset" else d["source"]
    title = f"{d['name']}  ({source}" + (f", preset {d['preset']}" if d["preset"] and source != "preset" else "") + ")"
    lengths = f"T={d['seq_len']}"
    if d["decoder_seq_len"] is not None:
        lengths = f"S={d['seq_len']}, T_dec={d['decoder_seq_len']}"
    rows = [
        ("arch", d["arch"]),
        ("parameters", f"{d['parameters']:,}  ({_si(d['parameters'])})"),
        ("non-embedding parameters", f"{d['non_embedding_parameters']:,}  ({_si(d['non_embedding_parameters'])})"),
    ]
    for key, value in d["parameter_breakdown"].items():
        if value:
            rows.append((f"  {key}" + ("  [embedding]" if key in EMBEDDING_KEYS else ""), f"{value:,}"))
    rows += [
        (f"train FLOPs / {d['flops_token']} ({lengths})", _si(d["train_flops_per_token"], "FLOP")),
        ("  attention share", f"{100 * d['attention_flops_fraction']:.1f}%"),
        ("  per sequence", _si(d["train_flops_per_sequence"], "FLOP")),
        (f"KV cache / token ({d['kv_cache_dtype']})", _bytes(d["kv_cache_bytes_per_token"])),
    ]
    if d["arch"] == "encoder_decoder":
        rows.append(
            (
                f"cross KV cache / source token ({d['kv_cache_dtype']})",
                _bytes(d["cross_kv_cache_bytes_per_source_token"]),
            )
        )
    width = max(len(label) for label, _ in rows)
    lines = [title, "-" * len(title)] + [f"{label:<{width}}  {value}" for label, value in rows]
    config = " ".join(f"{key}={value}" for key, value in d["config"].items())
    lines += ["", "config:"] + textwrap.wrap(config, width=100, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(lines)
