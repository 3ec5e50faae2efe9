"""The run schema: one typed dataclass per recipe section.

Each section checks its own values in `__post_init__`, with a message naming the full key:
that is the only place each range check lives (the model's in TransformerConfig, the data's
in DataConfig and TokenizerConfig, the rest here). `recipe.load.load_recipe` merges YAML onto
`RunConfig` with OmegaConf and returns these dataclasses. Nothing here imports torch or
Lightning.

The model section is generated from `TransformerConfig`'s fields (each an optional override of
the preset), so a new core field is a new recipe key without touching this file.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from omegaconf import MISSING

from lit_transformer.data.data_config import DataConfig, TokenizerConfig
from lit_transformer.errors import RecipeError, closest
from lit_transformer.model.config import TransformerConfig
from lit_transformer.recipe.eval_schema import EvalConfig

Strategy = Literal["auto", "ddp", "fsdp"]
Accelerator = Literal["auto", "cpu", "gpu", "cuda", "mps"]
Precision = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed"]
WandbMode = Literal["offline", "online", "disabled"]
Pooling = Literal["first", "mean", "last"]
Attention = Literal["causal", "bidirectional"]
Schedule = Literal["constant", "linear", "cosine", "wsd", "inverse_sqrt"]
SCHEDULES = typing.get_args(Schedule)
OptimizerName = Literal["adamw", "muon"]
OPTIMIZERS = typing.get_args(OptimizerName)
# what one task of a mixture trains (recipe/tasks.py): prefix_lm is bidirectional over a prefix and
# causal after it (a decoder), or the prefix encoded and its continuation decoded (an encoder-decoder);
# mntp is GPT-BERT's masked next-token prediction on a decoder
TaskObjective = Literal["mlm", "clm", "prefix_lm", "mntp", "span", "seq2seq"]
# how a mixture's tasks are drawn (Raffel et al. 2020, 3.5.2): the tasks' weights, examples-
# proportional with an artificial limit K, or temperature-scaled
MixtureRates = Literal["weights", "proportional", "temperature"]
# one task per optimizer step, or rows of every task in each batch (a decoder's same-shape tasks)
Mixing = Literal["step", "row"]


def need(ok: bool, key: str, value: Any, what: str) -> None:
    """A RecipeError `key=value what` unless ok."""
    if not ok:
        raise RecipeError(f"{key}={value!r} {what}")


def need_positive_int(key: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    need(ok, key, value, "must be a positive integer" + (" or null" if optional else ""))


# ----------------------------------------------------------------------------- sections

_MODEL_HINTS = typing.get_type_hints(TransformerConfig)
# model keys that may say "auto" besides model.size (recipe/auto_rules.py)
_AUTO_MODEL_FIELDS = ("dropout",)
ModelSection = dataclasses.make_dataclass(
    "ModelSection",
    [("preset", str | None, field(default=None)), ("size", str | None, field(default=None))]
    + [
        (f.name, _MODEL_HINTS[f.name] | (str if f.name in _AUTO_MODEL_FIELDS else None) | None, field(default=None))
        for f in dataclasses.fields(TransformerConfig)
    ],
)
ModelSection.__doc__ = (
    "`preset` (a name from lit_transformer.PRESETS) plus any TransformerConfig field as an override; "
    "None keeps the preset's value. vocab_size defaults to the tokenizer's. `size: auto` chooses "
    "the width and depth from the corpus and the budget (recipe/auto_rules.py), as `dropout: auto` does dropout."
)


@dataclass
class ObjectiveConfig:
    name: str = MISSING  # a registered objective: mlm, clm, span, seq2seq, classify
    bleu: bool = True  # seq2seq: decode validation sentences and report corpus BLEU (sacrebleu)
    bleu_sentences: int | None = 500  # validation sentences decoded for BLEU; null: the whole split
    bleu_batches: int | None = None  # a further cap in validation batches (null: none)
    # decoding for BLEU (validation and `evaluate`): beam search when num_beams > 1, with GNMT's
    # length penalty alpha (Wu et al. 2016); the 2017 paper: beam 4, alpha 0.6 (section 6.1)
    num_beams: int = 1
    length_penalty: float = 0.6

    def __post_init__(self):
        need_positive_int("objective.bleu_batches", self.bleu_batches, optional=True)
        need_positive_int("objective.bleu_sentences", self.bleu_sentences, optional=True)
        need_positive_int("objective.num_beams", self.num_beams)
        need(self.length_penalty >= 0, "objective.length_penalty", self.length_penalty, "must not be negative")


@dataclass
class OptimConfig:
    lr: float = 3e-4  # peak learning rate; for inverse_sqrt, a multiplier on the 2017 paper's formula
    weight_decay: float = 0.1  # AdamW decay on matrices only (not biases, norms, embeddings' ... see param_groups)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    schedule: Schedule = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # cosine/linear/wsd decay floor as a fraction of lr
    # wsd (warmup-stable-decay): the peak lr until the last `cooldown_fraction` of the steps after
    # warmup (or of trainer.max_time), then a 1 - sqrt decay to the floor (Hagele et al. 2024, "Scaling Laws and
    # Compute-Optimal Training Beyond Fixed Training Durations": a 20% cooldown matches cosine)
    cooldown_fraction: float = 0.2
    label_smoothing: float = 0.0  # the 2017 paper used 0.1
    # muon: Muon (Jordan et al. 2024, torch.optim.Muon) for the 2-D weight matrices of the
    # Transformer blocks, AdamW for the rest, as the modded-nanoGPT speedrun does (optim.py)
    optimizer: OptimizerName = "adamw"
    muon_lr: float = 0.02  # Muon's peak lr (Jordan's reference Muon's default; `lr` stays AdamW's), same schedule
    muon_momentum: float = 0.95  # Muon's Nesterov momentum (the reference's and the speedrun's)
    # PaLM's auxiliary z_loss * log(Z)^2 per predicted token on the LM objectives' training loss,
    # keeping the softmax normaliser near 1 (Chowdhery et al. 2022, section 5: 1e-4); 0: off
    z_loss: float = 0.0

    def __post_init__(self):
        need(
            self.schedule in SCHEDULES,
            "optim.schedule",
            self.schedule,
            f"is not one of {list(SCHEDULES)}{closest(str(self.schedule), SCHEDULES)}",
        )
        need(
            self.optimizer in OPTIMIZERS,
            "optim.optimizer",
            self.optimizer,
            f"is not one of {list(OPTIMIZERS)}{closest(str(self.optimizer), OPTIMIZERS)}",
        )
        need(self.muon_lr > 0, "optim.muon_lr", self.muon_lr, "must be positive")
        need(0 <= self.muon_momentum < 1, "optim.muon_momentum", self.muon_momentum, "is outside [0, 1)")
        need(self.z_loss >= 0, "optim.z_loss", self.z_loss, "must not be negative")
        need(0 < self.cooldown_fraction <= 1, "optim.cooldown_fraction", self.cooldown_fraction, "is outside (0, 1]")
        need(self.lr > 0, "optim.lr", self.lr, "must be positive")
        need(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "must not be negative")
        for key in ("beta1", "beta2"):
            need(0 <= getattr(self, key) < 1, f"optim.{key}", getattr(self, key), "is outside [0, 1)")
        need(self.eps > 0, "optim.eps", self.eps, "must be positive")
        need(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "must not be negative")
        need(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", self.min_lr_ratio, "is outside [0, 1]")
        need(0 <= self.label_smoothing < 1, "optim.label_smoothing", self.label_smoothing, "is outside [0, 1)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> OptimConfig:
        names = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in names:
                raise RecipeError(f"unknown key optim.{key}{closest(key, names)}")
        return cls(**values)


@dataclass
class TrainerConfig:
    max_steps: int = 1000  # optimizer steps (with max_time: an upper bound)
    # a budget in seconds of training (training.TimeBudget says what counts: from the first
    # training batch, without validation), after which the run finishes as at max_steps; the
    # linear, cosine and wsd schedules then decay over it, and an mntp task's mask rate falls
    # over it. None: no budget
    max_time: float | None = None
    devices: Any = 1  # int or "auto"; Lightning's `devices`, per node (data.batch_size is per device)
    num_nodes: int = 1
    accelerator: Accelerator = "auto"
    # ddp: a replica per device; fsdp: FSDP2 via ModelParallelStrategy (sharded weights, gradients
    # and AdamW state, meta-device init, sharded checkpoints); both also run on CPU with gloo
    strategy: Strategy = "auto"
    precision: Precision | None = None  # None: the objective's default (recipe/registry.py)
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = 1.0
    val_check_interval: int = 200  # optimizer steps between validations
    limit_val_batches: int | None = None  # None: the whole validation split
    log_every_n_steps: int = 10
    checkpoint_every_n_steps: int = 500
    # step-N checkpoints kept besides last.ckpt (the newest ones); at least average_last
    keep_checkpoints: int = 1
    # average the model weights of the last N checkpoints into the final model (Vaswani et al.
    # 2017, section 6.1: the last 5); null or 1: the final weights as trained
    average_last: int | None = None
    # an exponential moving average of the weights, ema = d ema + (1 - d) w after every optimizer
    # step, which validation, the named evaluations and the final model use (training.callbacks
    # .WeightsEMA); null: none. Not with average_last or strategy=fsdp
    ema_decay: float | None = None
    seed: int = 0
    deterministic: bool = False
    # torch's CPU threads (None: its default, one per core). Tiny models gain little from a
    # second thread and lose several times over when other processes share the cores.
    num_threads: int | None = None
    # torch.compile the training step: its whole loss as one graph, or each Transformer block under
    # FSDP2 or activation checkpointing (training/compiled_step.py; inductor needs a C++ compiler on CPU)
    compile: bool = False
    # the blocks' matrix products in float8 (torchao; H100/H200-class GPUs only: training/float8.py)
    float8: bool = False
    activation_checkpointing: bool = False  # recompute each block in backward: memory for ~1 more forward
    # stop after this many optimizer steps in a row were skipped for a non-finite loss or gradient
    nonfinite_patience: int = 10
    # refuse at start-up a run whose ranks need more memory than the machine has (training/preflight.py)
    check_memory: bool = True
    # glibc's malloc keeps the memory each step frees for the next one instead of unmapping it
    # and page-faulting it back in (training.keep_freed_memory): faster CPU steps for more resident
    # memory (docs/defaults.md, "trainer.keep_freed_memory"). false: glibc's defaults
    keep_freed_memory: bool = True

    def __post_init__(self):
        for key in (
            "max_steps",
            "accumulate_grad_batches",
            "val_check_interval",
            "log_every_n_steps",
            "checkpoint_every_n_steps",
            "num_nodes",
            "nonfinite_patience",
            "keep_checkpoints",
        ):
            need_positive_int(f"trainer.{key}", getattr(self, key))
        need(
            self.devices == "auto"
            or (isinstance(self.devices, int) and not isinstance(self.devices, bool) and self.devices > 0),
            "trainer.devices",
            self.devices,
            "must be a positive integer or 'auto'",
        )
        need(
            self.gradient_clip_val is None or self.gradient_clip_val > 0,
            "trainer.gradient_clip_val",
            self.gradient_clip_val,
            "must be positive or null",
        )
        need_positive_int("trainer.num_threads", self.num_threads, optional=True)
        need_positive_int("trainer.limit_val_batches", self.limit_val_batches, optional=True)
        need_positive_int("trainer.average_last", self.average_last, optional=True)
        if self.ema_decay is not None:
            need(0 < self.ema_decay < 1, "trainer.ema_decay", self.ema_decay, "is outside (0, 1)")
            need(
                (self.average_last or 1) == 1,
                "trainer.ema_decay",
                self.ema_decay,
                f"and trainer.average_last={self.average_last} both average the weights: choose one",
            )
            need(
                self.strategy != "fsdp",
                "trainer.ema_decay",
                self.ema_decay,
                "needs whole weights on every rank; with trainer.strategy=fsdp leave it null",
            )
        need(self.max_time is None or self.max_time > 0, "trainer.max_time", self.max_time, "must be positive or null")


@dataclass
class WandbConfig:
    mode: WandbMode = "offline"  # online falls back to offline without an API key
    project: str = "lit-transformer"
    name: str | None = None  # None: the run directory's name
    entity: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    csv: bool = True


@dataclass
class RunSection:
    dir: str | None = None  # None: runs/<recipe file name without .yaml>
    overwrite: bool = False


@dataclass
class FinetuneConfig:
    # `from` in YAML and on the command line (a Python keyword, hence the trailing underscore here):
    # a run directory, a Lightning checkpoint, a transformers directory, or `minilm`.
    from_: str | None = None
    pooling: Pooling | None = None  # None: first for encoders, last for decoders, mean for encoder-decoders
    backbone_lr_ratio: float = 1.0  # backbone lr = optim.lr * ratio; the head gets optim.lr
    # layer-wise lr decay (ELECTRA, Clark et al. 2020, appendix A): block i of L gets the backbone
    # lr x decay^(L - i), the embeddings decay^(L + 1), so lower layers move less; 1.0: off
    layer_lr_decay: float = 1.0
    head_dropout: float = 0.1
    # how a decoder reads the text: causal, or bidirectional (UniLM's bidirectional mode); None:
    # bidirectional when finetune.from is a mixture run that trained a bidirectional (mlm) task
    attention: Attention | None = None

    def __post_init__(self):
        need(self.backbone_lr_ratio > 0, "finetune.backbone_lr_ratio", self.backbone_lr_ratio, "must be positive")
        need(0 <= self.head_dropout < 1, "finetune.head_dropout", self.head_dropout, "is outside [0, 1)")
        need(0 < self.layer_lr_decay <= 1, "finetune.layer_lr_decay", self.layer_lr_decay, "is outside (0, 1]")


@dataclass
class SampleGenerationConfig:
    """Sample generations logged as a W&B table at every validation (clm, span, seq2seq)."""

    enabled: bool = True
    prompts: list[str] = field(default_factory=list)  # empty: the first few validation texts
    num_prompts: int = 3
    prompt_tokens: int = 16  # prompts taken from validation data are cut to this many tokens
    max_new_tokens: int = 24
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        need(self.temperature > 0, "generation.temperature", self.temperature, "must be positive")
        need_positive_int("generation.top_k", self.top_k, optional=True)
        need(self.top_p is None or 0 < self.top_p <= 1, "generation.top_p", self.top_p, "is outside (0, 1]")
        need_positive_int("generation.max_new_tokens", self.max_new_tokens)
        need_positive_int("generation.prompt_tokens", self.prompt_tokens)
        need(self.num_prompts >= 0, "generation.num_prompts", self.num_prompts, "must not be negative")


_DATA_HINTS = typing.get_type_hints(DataConfig)
TaskData = dataclasses.make_dataclass(
    "TaskData",
    [(f.name, _DATA_HINTS[f.name] | None, field(default=None)) for f in dataclasses.fields(DataConfig)],
)
TaskData.__doc__ = "Any `data` key, overriding the recipe's data section for one task; None keeps the recipe's value."


@dataclass
class TaskConfig:
    """One task of a mixture: an objective on the shared core, its data (the recipe's by
    default, so tasks share one corpus and one token cache) and its objective's parameters
    (None: the recipe's data section's value)."""

    name: str = MISSING  # metrics are logged as train/<name>/..., val/<name>/...
    objective: TaskObjective = MISSING
    weight: float = 1.0  # mixture.rates=weights: the task's share of steps is weight / sum of weights
    mode_token: str | None = None  # UL2's paradigm token ([NLU], [NLG], [S2S]) put before every input
    mlm_probability: float | None = None  # mlm
    # mlm, mntp: of the chosen tokens, the share that becomes [MASK] and the share a random token
    # (the rest stay); null: data.mask_replace_prob, data.random_replace_prob
    mask_replace_prob: float | None = None
    random_replace_prob: float | None = None
    # mntp: the mask rate at the run's start and end (trainer.max_time where set, as the learning
    # rate, else trainer.max_steps), linear between (GPT-BERT: 0.30 and 0.15); null: mask_rate_end,
    # and data.mlm_probability for mask_rate_end
    mask_rate_start: float | None = None
    mask_rate_end: float | None = None
    max_span_length: int | None = None  # mntp: spans of 1..this many tokens; null: 3 (GPT-BERT's)
    noise_density: float | None = None  # span
    mean_span_length: float | None = None  # span
    prefix_fraction: float = 0.5  # prefix_lm: the mean share of a row that is prefix (UL2's S-denoiser: 0.75)
    data: TaskData = field(default_factory=TaskData)  # type: ignore[valid-type]

    def __post_init__(self):
        need(self.weight > 0, f"tasks.{self.name}.weight", self.weight, "must be positive")
        need(
            0 < self.prefix_fraction < 1,
            f"tasks.{self.name}.prefix_fraction",
            self.prefix_fraction,
            "is outside (0, 1)",
        )
        for key in ("mask_rate_start", "mask_rate_end"):
            value = getattr(self, key)
            need(value is None or 0 < value < 1, f"tasks.{self.name}.{key}", value, "is outside (0, 1)")
        need_positive_int(f"tasks.{self.name}.max_span_length", self.max_span_length, optional=True)
        need(
            self.mode_token is None or (isinstance(self.mode_token, str) and self.mode_token.strip() != ""),
            f"tasks.{self.name}.mode_token",
            self.mode_token,
            "must be a non-empty string or null",
        )


@dataclass
class MixtureConfig:
    rates: MixtureRates = "weights"
    cap: int | None = None  # K, in training examples, for proportional and temperature rates; null: no limit
    temperature: float = 1.0  # temperature rates: r_i proportional to min(n_i, K) ** (1 / temperature)
    # step: each optimizer step trains one task (its batch keeps its own shape and SDPA's fused
    # causal kernel where it is causal); row: every batch holds rows of every task, by the rates
    # (GPT-BERT's causal and masked rows in one step; a decoder's tasks of one shape only)
    mixing: Mixing = "step"

    def __post_init__(self):
        need_positive_int("mixture.cap", self.cap, optional=True)
        need(self.temperature > 0, "mixture.temperature", self.temperature, "must be positive")


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)  # type: ignore[valid-type]
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    run: RunSection = field(default_factory=RunSection)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    generation: SampleGenerationConfig = field(default_factory=SampleGenerationConfig)
    # a mixture of objectives on one set of weights (recipe/tasks.py); empty: the one objective.name
    tasks: list[TaskConfig] = field(default_factory=list)
    mixture: MixtureConfig = field(default_factory=MixtureConfig)
    # named evaluations run at validation and by `evaluate` (recipe/eval_schema.py); empty: none
    eval: list[EvalConfig] = field(default_factory=list)
    resume: str | None = None  # null | auto | path to a Lightning checkpoint


# ----------------------------------------------------------------------------- key names
# `finetune.from` is spelled `from_` in the dataclass; these translate at the YAML boundary.

ALIASES = {"from": "from_"}


def to_internal(key: str) -> str:
    return ".".join(ALIASES.get(part, part) for part in key.split("."))


def to_public(key: str) -> str:
    back = {v: k for k, v in ALIASES.items()}
    return ".".join(back.get(part, part) for part in key.split("."))


def rename(tree: Any, mapping: dict[str, str]) -> Any:
    if isinstance(tree, dict):
        return {mapping.get(k, k) if isinstance(k, str) else k: rename(v, mapping) for k, v in tree.items()}
    return tree


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """typing.get_type_hints, once per class: the annotations are strings (`from __future__ import
    annotations`), so each call compiles every one again, and reading a recipe asks thousands of times."""
    return typing.get_type_hints(cls)


def field_type(path: list[str]) -> Any:
    """The type hint at a dotted path of RunConfig (internal names), or None off the schema."""
    cls: Any = RunConfig
    for part in path:
        if not dataclasses.is_dataclass(cls):
            return None
        hints = _type_hints(cls)
        if part not in hints:
            return None
        cls = hints[part]
    return cls


def is_list_type(hint: Any) -> bool:
    """list[...] or Optional[list[...]]."""
    if typing.get_origin(hint) is list:
        return True
    return any(typing.get_origin(arg) is list for arg in typing.get_args(hint))


def all_keys(cls: Any = RunConfig, prefix: str = "") -> list[str]:
    """Every leaf key of the schema as a public dotted path (`trainer.max_steps`, `finetune.from`)."""
    keys = []
    for f in dataclasses.fields(cls):
        hint = _type_hints(cls)[f.name]
        path = f"{prefix}{to_public(f.name)}"
        keys.extend(all_keys(hint, path + ".") if dataclasses.is_dataclass(hint) else [path])
    return keys


def sections() -> list[str]:
    return [to_public(f.name) for f in dataclasses.fields(RunConfig)]
