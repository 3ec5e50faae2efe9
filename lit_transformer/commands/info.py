"""`lit-transformer info PRESET_OR_RECIPE`: size, training compute and KV-cache memory of a
model, from its config alone (nothing is built or allocated). See model/accounting.py for
the conventions behind each number. With `--plan`, a recipe's training run is planned too:
memory per device, tokens, FLOPs and time per step, checkpoint size and the data rate per node
(docs/scaling.md, "Planning a run from the config").
"""

from __future__ import annotations

import functools
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
from lit_transformer.recipe.catalog import resolve_recipe, shipped_recipes
from lit_transformer.recipe.load import load_recipe
from lit_transformer.run.resolve import ResolvedRun, resolve_run

BF16_BYTES = 2


@functools.lru_cache(maxsize=4)
def resolved_recipe(target: str, overrides: tuple[str, ...]) -> ResolvedRun:
    """The recipe resolved as a run resolves it (run/resolve.py: `auto` values measure the step
    speed, so once per recipe and overrides)."""
    return resolve_run(load_recipe(target, overrides), training=False)


def recipe_target(target: str) -> str | None:
    """The recipe file `info` reads for TARGET, or None for a preset: an existing file first, then
    a preset name, then a shipped recipe's name (recipe/catalog.py), so a preset wins over a
    shipped recipe of the same name."""
    if os.path.isfile(target):
        return target
    if target in PRESETS:
        return None
    recipes = shipped_recipes()
    if target in recipes or target.endswith((".yaml", ".yml")) or os.sep in target:
        return str(resolve_recipe(target))  # the shipped recipe, or resolve_recipe's one-line error
    raise ConfigError(
        f"unknown preset {target!r}{closest(target, [*PRESETS, *recipes])}, nor a shipped recipe; "
        f"presets: {', '.join(PRESETS)}; `lit-transformer recipes` lists the recipes"
    )


def load_model_config(target: str, overrides: Sequence[str] = ()) -> tuple[str, str | None, TransformerConfig]:
    """(name, preset name or None, config) for a preset name, a recipe path or a shipped recipe's
    name (recipe_target). A recipe is read by `load_recipe`, as every command reads it (extends
    and key=value overrides applied); a fine-tuning recipe's model is finetune.from's config with
    the recipe's fields on top."""
    path = recipe_target(target)
    if path is None:
        if overrides:
            raise RecipeError("key=value overrides apply to recipes, not presets")
        return target, target, preset(target)
    try:
        run = resolved_recipe(path, tuple(overrides))
    except ConfigError as error:  # a fine-tuning recipe's model keys on finetune.from's config
        raise RecipeError(f"{path}: {error}") from None
    name = os.path.splitext(os.path.basename(path))[0]
    return name, run.config.model.preset, run.model


def info(
    target: str, overrides: Sequence[str] = (), seq_len: int | None = None, decoder_seq_len: int | None = None
) -> dict[str, Any]:
    """Accounting for a preset name or recipe path, as a JSON-serialisable dict.

    FLOPs are at `seq_len` (default the config's max_seq_len) and, for encoder-decoder models,
    `decoder_seq_len` targets (default `seq_len`); KV-cache bytes are for bfloat16.
    """
    name, preset_name, cfg = load_model_config(target, overrides)
    path = recipe_target(target)
    seq_len = seq_len or cfg.max_seq_len
    if cfg.arch == "encoder_decoder":
        decoder_seq_len = decoder_seq_len or seq_len
    flops = train_flops(cfg, seq_len, decoder_seq_len)
    return {
        "name": name,
        "preset": preset_name,
        "source": "preset" if path is None else os.path.abspath(path),
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


# ----------------------------------------------------------------------------- planning a run

DEFAULT_MFU = 0.4


def plan(
    target: str, overrides: Sequence[str] = (), peak_tflops: float | None = None, mfu: float = DEFAULT_MFU
) -> dict[str, Any]:
    """What one optimizer step of a recipe costs on trainer.num_nodes x trainer.devices devices,
    from the config alone, as a JSON-serialisable dict. Planning launches nothing, so the devices
    need not exist here (a trainer.devices of "auto" counts this machine's GPUs, as a launch would).
    Every sequence is taken as full at the recipe's longest input: exact for packed LM blocks, an
    upper bound for the ragged batches of the other objectives."""
    if peak_tflops is not None and not peak_tflops > 0:
        raise RecipeError(f"--peak-tflops={peak_tflops} must be a positive number of TFLOP/s per device")
    if not 0 < mfu <= 1:
        raise RecipeError(f"--mfu={mfu} must be a fraction in (0, 1]")
    path = recipe_target(target)
    if path is None:
        raise RecipeError(f"{target}: --plan needs a recipe (a preset has no trainer or data section)")
    # preflight and pack import torch: only a plan pays for it, so that plain `info` stays light
    from lit_transformer.data.tokens.pack import token_dtype
    from lit_transformer.training import preflight

    run = resolved_recipe(path, tuple(overrides))
    _, _, cfg = load_model_config(path, overrides)
    t, data = run.config.trainer, run.config.data
    length_key, tokens = run.longest_input
    memory = preflight.estimate(t, data, cfg, tokens)
    sequences = data.batch_size if data.batch_tokens is None else max(data.batch_tokens // tokens, 1)
    devices = preflight.processes_per_node(t)
    world = devices * t.num_nodes
    sequences_per_step = sequences * world * t.accumulate_grad_batches
    step_tokens = sequences_per_step * tokens
    step_flops = train_flops(cfg, tokens).total * sequences_per_step
    params = count_parameters(cfg)
    weight_bytes = 2 if t.precision == "bf16-true" else 4  # mixed precision keeps float32 master weights
    out: dict[str, Any] = {
        "num_nodes": t.num_nodes,
        "devices_per_node": devices,
        "world_size": world,
        "strategy": t.strategy,
        "precision": t.precision,
        "seq_len": tokens,
        "seq_len_key": length_key,
        "sequences_per_device_batch": sequences,
        "accumulate_grad_batches": t.accumulate_grad_batches,
        "tokens_per_step": step_tokens,
        "train_flops_per_step": step_flops,
        "memory_per_device": {"states": memory.states, "activations": memory.activations, "total": memory.per_rank},
        # the weights and AdamW's two moments, each in the weights' dtype
        "checkpoint_bytes_per_parameter": 3 * weight_bytes,
        "checkpoint_bytes": 3 * weight_bytes * params,
        "token_cache_bytes_per_token": token_dtype(cfg.vocab_size).itemsize,
        "peak_tflops": peak_tflops,
        "mfu": mfu,
        "seconds_per_step": None,
        "tokens_per_second": None,
        "tokens_per_second_per_device": None,
        "data_bytes_per_second_per_node": None,
    }
    if peak_tflops is not None:
        seconds = step_flops / (world * peak_tflops * 1e12 * mfu)
        out["seconds_per_step"] = seconds
        out["tokens_per_second"] = step_tokens / seconds
        out["tokens_per_second_per_device"] = step_tokens / seconds / world
        out["data_bytes_per_second_per_node"] = step_tokens / seconds / t.num_nodes * out["token_cache_bytes_per_token"]
    return out


def format_plan(p: dict[str, Any]) -> str:
    """A human-readable table of a `plan` dict."""
    title = (
        f"plan: {p['num_nodes']} node(s) x {p['devices_per_node']} device(s) = {p['world_size']}, "
        f"strategy={p['strategy']}, precision={p['precision']}"
    )
    mem = p["memory_per_device"]
    batch = f"{p['sequences_per_device_batch']} seq x {p['seq_len']} ({p['seq_len_key']})"
    rows = [
        (
            "memory / device (start-up estimate)",
            f"{mem['total'] / 1e9:.3g} GB = states {mem['states'] / 1e9:.3g} GB (weights, gradients, AdamW) "
            f"+ activations {mem['activations'] / 1e9:.3g} GB at {batch}",
        ),
        (
            "tokens / step",
            f"{p['tokens_per_step']:,}  (= {batch} x {p['world_size']} devices "
            f"x {p['accumulate_grad_batches']} accumulation)",
        ),
        ("train FLOPs / step (6N + attention)", _si(p["train_flops_per_step"], "FLOP")),
    ]
    if p["seconds_per_step"] is None:
        rows.append(("time / step", "give --peak-tflops (the device's dense peak) to estimate it"))
    else:
        at = f"at {p['mfu']:.0%} MFU of {p['peak_tflops']:g} TFLOP/s per device"
        rows += [
            ("time / step", f"{p['seconds_per_step']:.4g} s  ({at})"),
            ("tokens / s", f"{_si(p['tokens_per_second'])} run, {_si(p['tokens_per_second_per_device'])} per device"),
            (
                "data read / s / node",
                f"{_si(p['data_bytes_per_second_per_node'], 'B')}  (packed token cache, "
                f"{p['token_cache_bytes_per_token']} B/token)",
            ),
        ]
    rows.append(
        (
            "checkpoint",
            f"{p['checkpoint_bytes'] / 1e9:.3g} GB  (weights + AdamW moments, "
            f"{p['checkpoint_bytes_per_parameter']} B/parameter)",
        )
    )
    width = max(len(label) for label, _ in rows)
    return "\n".join([title, "-" * len(title)] + [f"{label:<{width}}  {value}" for label, value in rows])
