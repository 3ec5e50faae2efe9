"""`auto` recipe values: the model's size, the vocabulary, dropout and the batch, from the
training corpus and the budget (docs/recipe-keys.md, "Sizing from the data").

Four keys may say `auto`: `model.size`, `tokenizer.vocab_size`, `model.dropout` and
`data.batch_size`. They resolve when a run starts (run/resolve.py, through
training/auto_resolve.py, which measures the step speed and calls `resolve` here), are printed,
and are written into the run's config.yaml as plain values, so the run repeats without `auto`.
This module holds the rules and the checks; it imports no torch: the speed arrives as a
function of the model.

The rules (the runs they were fitted on, with their commands: docs/time-to-quality.md,
"Sizing from the data"):
- size: the largest shape of SHAPES that sees at least TOKENS_PER_WEIGHT training tokens per
  weight outside the embeddings. It depends on the compute the budget buys, not on the corpus.
  Fitted in one regime only (2 CPU cores, minutes, a causal LM): a budget that buys many passes
  over a small corpus gets a large shape no run here has checked.
- vocabulary: the power of two nearest corpus bytes / BYTES_PER_VOCAB_ENTRY, at most the width
  that keeps the tied head's matrix no larger than the blocks' (head FLOPs <= the blocks'), at
  least MIN_VOCAB.
- dropout: rising with the expected passes over the corpus, none below DROPOUT_FREE_PASSES
  (dropout_for).
- batch: the largest power of two of rows that leaves at least MIN_STEPS optimizer steps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lit_transformer.data.data_config import AUTO
from lit_transformer.errors import RecipeError
from lit_transformer.model.accounting import non_embedding_parameters, train_flops
from lit_transformer.model.config import TransformerConfig

AUTO_KEYS = ("model.size", "tokenizer.vocab_size", "model.dropout", "data.batch_size")
AUTO_OBJECTIVES = ("clm", "mlm", "span")  # objectives that read a text corpus of packed blocks
SHAPE_KEYS = ("d_model", "n_layers", "n_heads", "d_ff", "n_decoder_layers", "head_dim", "n_kv_heads")

# (d_model, layers, heads): width and depth grow together, heads of 48-64 dimensions
SHAPES = (
    (96, 2, 2),
    (128, 3, 2),
    (144, 4, 3),
    (192, 4, 4),
    (256, 4, 4),
    (256, 6, 4),
    (384, 6, 6),
    (512, 8, 8),
    (768, 12, 12),
    (1024, 16, 16),
    (1280, 20, 20),
)
TOKENS_PER_WEIGHT = 0.6
BYTES_PER_VOCAB_ENTRY = 150
MIN_VOCAB, MAX_VOCAB = 1024, 65536
BYTES_PER_TOKEN = 4.0  # a BPE of a few thousand tokens on English prose: for the passes estimate only
DROPOUT_FREE_PASSES, DROPOUT_PER_PASS, MAX_DROPOUT = 1.5, 0.025, 0.2  # 1.4 -> 0, 5-6.5 -> 0.1, 10 -> 0.2
MIN_STEPS = 500
MAX_BATCH_TOKENS = 1 << 19  # GPT-3 small's 0.5M tokens a step (Brown et al. 2020, Table 2.1)


@dataclass(frozen=True)
class Budget:
    """What the run will see: training tokens (all ranks), or the measured speed that gives them."""

    corpus_bytes: int  # training text, after data.max_train_bytes
    max_time: float | None  # trainer.max_time; None: the budget is trainer.max_steps
    flops_per_second: float | None  # measured training FLOP/s of all ranks (with max_time)
    max_steps: int
    world_size: int = 1


def auto_keys(cfg: Any) -> list[str]:
    """The keys of a loaded RunConfig that say `auto`."""
    return [key for key in AUTO_KEYS if getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) == AUTO]


def check(cfg: Any, source: str) -> None:
    """One-line RecipeErrors for `auto` where it cannot resolve, before anything runs."""
    keys = auto_keys(cfg)
    if cfg.model.size is not None and cfg.model.size != AUTO:
        raise RecipeError(f"{source}: model.size={cfg.model.size!r} must be 'auto' or null")
    if not keys:
        return
    first = keys[0]

    def refuse(why: str) -> None:
        raise RecipeError(f"{source}: {first}=auto {why}")

    if cfg.finetune.from_ is not None:
        refuse(f"sizes a model trained from scratch; finetune.from={cfg.finetune.from_} brings its own")
    if cfg.tasks:
        refuse("reads one corpus; a mixture (tasks) is not sized automatically: set the values")
    if cfg.objective.name not in AUTO_OBJECTIVES:
        refuse(
            f"reads a text corpus (objective {' / '.join(AUTO_OBJECTIVES)}), not objective.name={cfg.objective.name}"
        )
    if cfg.data.hub_name is not None:
        refuse(f"reads the size of the training files; data.hub_name={cfg.data.hub_name} has none here")
    if cfg.data.streaming:
        refuse("reads the size of the training files before training; data.streaming=true reads them as it goes")
    if cfg.data.format == "parquet":
        refuse("reads the size of the training text; parquet files are compressed: give text, jsonl or csv")
    if "model.size" in keys:
        if cfg.model.preset is not None:
            raise RecipeError(f"{source}: model.size=auto chooses the shape; model.preset={cfg.model.preset} too")
        for key in SHAPE_KEYS:
            value = getattr(cfg.model, key)
            if value is not None:
                raise RecipeError(
                    f"{source}: model.size=auto chooses model.{key}, which is set to {value!r}; "
                    f"set model.{key}=null or drop model.size"
                )
    if "tokenizer.vocab_size" in keys:
        if cfg.tokenizer.path is not None:
            raise RecipeError(
                f"{source}: tokenizer.vocab_size=auto sizes a tokenizer to train; tokenizer.path={cfg.tokenizer.path} "
                "is one already trained"
            )
        if cfg.model.vocab_size is not None:
            raise RecipeError(f"{source}: tokenizer.vocab_size=auto, but model.vocab_size={cfg.model.vocab_size}")
    if "data.batch_size" in keys:
        if cfg.trainer.max_time is None:
            raise RecipeError(
                f"{source}: data.batch_size=auto sizes the batch from trainer.max_time, which is null; set both"
            )
        if cfg.data.batch_tokens is not None:
            raise RecipeError(f"{source}: data.batch_size=auto, but data.batch_tokens={cfg.data.batch_tokens} sizes it")


STAND_IN = {"vocab_size": 8192, "dropout": 0.0, "batch_size": 16}  # any valid values: the shape is SHAPES[3]


# ----------------------------------------------------------------------------- the rules


def shape_config(base: TransformerConfig, d_model: int, n_layers: int, n_heads: int) -> TransformerConfig:
    """`base` at another width and depth: d_ff 4x wide (8/3 for gated units, a multiple of 16)."""
    gated = base.activation in ("swiglu", "geglu")
    d_ff = 16 * math.ceil(8 * d_model / 3 / 16) if gated else 4 * d_model
    return base.replace(
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        d_ff=d_ff,
        n_decoder_layers=None,
        head_dim=None,
        n_kv_heads=None,
    )


def vocab_for(corpus_bytes: int, model: TransformerConfig | None) -> int:
    """The vocabulary rule: the power of two nearest corpus_bytes / BYTES_PER_VOCAB_ENTRY, no larger than
    the head matrix the blocks' weights allow (model None: no such bound)."""
    vocab = 2 ** round(math.log2(max(corpus_bytes / BYTES_PER_VOCAB_ENTRY, 1)))
    if model is not None:
        bound = non_embedding_parameters(model.replace(vocab_size=MIN_VOCAB)) / model.d_model
        vocab = min(vocab, 2 ** math.floor(math.log2(max(bound, 1))))
    return int(min(max(vocab, MIN_VOCAB), MAX_VOCAB))


def flops_per_token(model: TransformerConfig, block_size: int) -> float:
    return train_flops(model, block_size).per_token


def training_tokens(budget: Budget, model: TransformerConfig, block_size: int, batch_rows: int | None) -> float:
    """Tokens the run trains on: the time budget at the measured FLOP/s, or max_steps full batches."""
    if budget.max_time is not None:
        if budget.flops_per_second is None:
            raise ValueError("a time budget needs the measured flops_per_second")
        return budget.flops_per_second * budget.max_time / flops_per_token(model, block_size)
    assert batch_rows is not None
    return float(budget.max_steps * batch_rows * block_size * budget.world_size)


def dropout_for(passes: float) -> float:
    """DROPOUT_PER_PASS for each pass beyond DROPOUT_FREE_PASSES, at most MAX_DROPOUT, in steps
    of 0.05 (a smooth rule: the passes are an estimate)."""
    dropout = min(MAX_DROPOUT, max(0.0, DROPOUT_PER_PASS * (passes - DROPOUT_FREE_PASSES)))
    return round(round(dropout / 0.05) * 0.05, 2)


def batch_for(tokens: float, block_size: int, world_size: int) -> int:
    """The largest power-of-two batch (rows per device) leaving MIN_STEPS steps, 1 at least."""
    rows = 1
    while (
        2 * rows * block_size * world_size * MIN_STEPS <= tokens
        and 2 * rows * block_size * world_size <= MAX_BATCH_TOKENS
    ):
        rows *= 2
    return rows


@dataclass(frozen=True)
class Resolved:
    """The values the `auto` keys took, and what they were computed from (printed, and tested)."""

    values: dict[str, Any]  # dotted key -> value, for the keys that said auto (model.size: the shape)
    model: TransformerConfig
    tokens: float  # training tokens expected
    passes: float  # expected passes over the corpus
    flops_per_second: float | None = None  # the speed measured (all ranks), with a time budget

    def summary(self) -> str:
        parts = []
        for key, value in self.values.items():
            if key == "model.size":
                parts.append(" ".join(f"model.{k}={v}" for k, v in value.items()))
            else:
                parts.append(f"{key}={value}")
        weights = non_embedding_parameters(self.model)
        speed = f" at {self.flops_per_second / 1e9:.2f} GFLOP/s measured" if self.flops_per_second else ""
        return (
            f"auto: {', '.join(parts)} (about {self.tokens / 1e6:.2f}M training tokens for {weights / 1e6:.2f}M "
            f"weights outside the embeddings, {self.passes:.1f} passes over the corpus){speed}"
        )


def resolve(
    cfg: Any,
    base: TransformerConfig,
    corpus_bytes: int,
    world_size: int,
    speed: Callable[[TransformerConfig], float] | None,
) -> Resolved:
    """The `auto` keys of `cfg`, in one pass: `base` is the model the recipe describes with
    stand-ins for its `auto` values (model_section.stand_in_model), `speed` one process's
    training FLOP/s on a model (with trainer.max_time; None without a time budget). The speed of
    the shape chosen is measured again once and the choice made again: small shapes use the
    cores less well than the stand-in."""
    t = cfg.trainer
    if t.max_time is None:
        return choose(cfg, base, Budget(corpus_bytes, None, None, t.max_steps, world_size))
    if speed is None:
        raise ValueError("a time budget needs the measured speed")
    probe = base.replace(vocab_size=vocab_for(corpus_bytes, base)) if "tokenizer.vocab_size" in auto_keys(cfg) else base
    measured: dict[TransformerConfig, float] = {}
    for _ in range(2):
        if probe not in measured:
            measured[probe] = speed(probe) * world_size
        budget = Budget(corpus_bytes, t.max_time, measured[probe], t.max_steps, world_size)
        resolved = choose(cfg, base, budget)
        probe = resolved.model.replace(dropout=0.0)
    return dataclasses.replace(resolved, flops_per_second=budget.flops_per_second)


def choose(cfg: Any, base: TransformerConfig, budget: Budget) -> Resolved:
    """The `auto` keys of `cfg` given the model the recipe describes otherwise (`base`: any shape
    and vocabulary where those are auto) and the budget."""
    keys = auto_keys(cfg)
    block = cfg.data.block_size
    fixed_rows = None if "data.batch_size" in keys else cfg.data.batch_size
    auto_vocab = "tokenizer.vocab_size" in keys

    def sized(model: TransformerConfig) -> TransformerConfig:
        return model.replace(vocab_size=vocab_for(budget.corpus_bytes, model)) if auto_vocab else model

    if "model.size" in keys:
        candidates = [sized(shape_config(base, *shape)) for shape in SHAPES]
        fitting = [
            m
            for m in candidates
            if training_tokens(budget, m, block, fixed_rows) >= TOKENS_PER_WEIGHT * non_embedding_parameters(m)
        ]
        model = fitting[-1] if fitting else candidates[0]
    else:
        model = sized(base)
    tokens = training_tokens(budget, model, block, fixed_rows)
    passes = tokens * BYTES_PER_TOKEN / max(budget.corpus_bytes, 1)
    values: dict[str, Any] = {}
    if "model.size" in keys:
        values["model.size"] = {k: getattr(model, k) for k in ("d_model", "n_layers", "n_heads", "d_ff")}
    if auto_vocab:
        values["tokenizer.vocab_size"] = model.vocab_size
    if "model.dropout" in keys:
        values["model.dropout"] = dropout_for(passes)
        model = model.replace(dropout=values["model.dropout"])
    if "data.batch_size" in keys:
        values["data.batch_size"] = batch_for(tokens, block, budget.world_size)
    return Resolved(values=values, model=model, tokens=tokens, passes=passes)
