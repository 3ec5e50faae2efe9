"""TransformerConfig: one frozen, keyword-only description of every model the core builds.

Presets are functions that return a fresh config; `preset(name, **overrides)` looks one up.
Every invariant is checked in `__post_init__` with a message that names the values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from lit_transformer.errors import closest

Arch = Literal["encoder", "decoder", "encoder_decoder"]
Position = Literal["sinusoidal", "learned", "rope", "alibi", "t5_relative", "none"]
Norm = Literal["layernorm", "rmsnorm"]
NormPosition = Literal["pre", "post"]
Activation = Literal["relu", "gelu", "gelu_tanh", "relu2", "swiglu", "geglu", "geglu_tanh"]
LMHeadKind = Literal["linear", "bert_mlm"]
AttentionImpl = Literal["sdpa", "math"]
AttentionKind = Literal["softmax", "linear"]

GATED_ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh")


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names it."""


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    arch: Arch
    vocab_size: int
    d_model: int
    n_heads: int
    n_layers: int  # encoder layers (encoder, encoder_decoder) or decoder layers (decoder)
    d_ff: int
    n_decoder_layers: int | None = None  # encoder_decoder only; None means n_layers
    n_kv_heads: int | None = None  # None: multi-head (= n_heads); 1: MQA; otherwise GQA
    head_dim: int | None = None  # None: d_model // n_heads (T5 sets it independently)
    max_seq_len: int = 512  # learned positions' table size; also the generation limit
    position: Position = "learned"
    rope_base: float = 10000.0
    relative_buckets: int = 32  # T5 relative attention bias
    relative_max_distance: int = 128
    norm: Norm = "layernorm"
    norm_eps: float = 1e-5
    norm_position: NormPosition = "pre"  # pre-norm stacks end with a final norm
    embedding_norm: bool = False  # BERT normalises the summed embeddings
    # QK-norm: RMS-normalise each head's queries and keys (learned scale, before RoPE) in every
    # attention layer. Bounds the attention logits, which otherwise grow until softmax saturates
    # (Dehghani et al. 2023, ViT-22B; Wortsman et al. 2023); modded-nanoGPT, Qwen3, OLMo 2 use it.
    qk_norm: bool = False
    activation: Activation = "gelu"  # relu2: max(0, x)^2 (So et al. 2021, Primer), not gated
    bias: bool = True  # biases of attention and feed-forward projections
    dropout: float = 0.0  # embeddings and residual branches
    attention_dropout: float = 0.0
    scale_embeddings: bool = False  # multiply token embeddings by sqrt(d_model) (2017 paper, 3.4)
    scale_attention: bool = True  # divide scores by sqrt(head_dim); T5 folds this into init
    type_vocab_size: int = 0  # BERT token-type (segment) embeddings; 0 for none
    tie_embeddings: bool = True  # LM head shares the token embedding matrix
    lm_head: LMHeadKind = "linear"  # bert_mlm: dense + activation + norm, then decoder with bias
    scale_decoder_output: bool = False  # T5 v1.0: hidden * d_model**-0.5 before the tied LM head
    init_std: float = 0.02
    # sdpa: torch's fused kernels (flash / memory-efficient where available); math: the
    # explicit softmax(QK^T)V reference the tests compare against.
    attention_impl: AttentionImpl = "sdpa"
    # Efficient attention (docs/efficient-attention.md). sliding_window w: a causal query sees
    # itself and the w - 1 tokens before it (Mistral), a bidirectional one w tokens on each side
    # (Longformer's local attention); generation keeps a rolling cache of w entries.
    sliding_window: int | None = None
    global_tokens: int = 0  # bidirectional stacks with a window: the first k tokens attend everywhere (Longformer)
    # linear: phi(q) phi(k)^T with phi = elu + 1 (Katharopoulos et al. 2020), O(T) time and memory
    attention_kind: AttentionKind = "softmax"

    def __post_init__(self):
        for name in _FIELD_TYPES:
            allowed = get_args(_FIELD_TYPES[name])
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"model.{name}={value!r} is not one of {list(allowed)}{closest(str(value), allowed)}")
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_seq_len"):
            _check_positive_int(name, getattr(self, name))
        for name in ("n_decoder_layers", "n_kv_heads", "head_dim"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ConfigError(f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ConfigError(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.kv_heads}")
        if self.position == "rope" and self.dim_per_head % 2:
            raise ConfigError(f"rope needs an even head dimension, got head_dim={self.dim_per_head}")
        if self.position == "t5_relative" and (self.relative_buckets < 2 or self.relative_max_distance < 2):
            raise ConfigError("model.relative_buckets and model.relative_max_distance must be at least 2")
        for name in ("dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"model.{name}={value} is outside [0, 1)")
        if self.type_vocab_size < 0:
            raise ConfigError(f"model.type_vocab_size={self.type_vocab_size} is negative")
        if self.norm_eps <= 0 or self.init_std <= 0 or self.rope_base <= 0:
            raise ConfigError("model.norm_eps, model.init_std and model.rope_base must be positive")
        self._check_efficient_attention()
        if self.n_decoder_layers is not None and self.arch != "encoder_decoder":
            raise ConfigError(f"model.n_decoder_layers is only for arch=encoder_decoder, not {self.arch!r}")

    def _check_efficient_attention(self) -> None:
        if self.sliding_window is not None:
            _check_positive_int("sliding_window", self.sliding_window)
        if isinstance(self.global_tokens, bool) or not isinstance(self.global_tokens, int) or self.global_tokens < 0:
            raise ConfigError(f"model.global_tokens={self.global_tokens!r} must be a non-negative integer")
        if self.global_tokens and self.arch == "decoder":
            raise ConfigError(
                "model.global_tokens is for bidirectional stacks (arch=encoder or encoder_decoder), not arch='decoder'"
            )
        if self.global_tokens and self.sliding_window is None:
            raise ConfigError(
                "model.global_tokens needs model.sliding_window (without a window every token "
                "already attends everywhere)"
            )
        if self.attention_kind == "linear":
            if self.position in ("alibi", "t5_relative"):
                raise ConfigError(
                    f"model.attention_kind='linear' cannot add model.position={self.position!r}'s "
                    "score bias (there are no scores); use rope, learned, sinusoidal or none"
                )
            if self.sliding_window is not None:
                raise ConfigError(
                    "model.sliding_window is for attention_kind='softmax'; linear attention already costs O(T)"
                )
            if self.attention_dropout:
                raise ConfigError(
                    "model.attention_dropout is for attention_kind='softmax'; linear attention "
                    "has no attention weights to drop"
                )

    # Derived sizes: properties so that they can never disagree with the fields.
    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def decoder_layers(self) -> int:
        return self.n_decoder_layers or self.n_layers

    @property
    def gated(self) -> bool:
        return self.activation in GATED_ACTIVATIONS

    @property
    def causal(self) -> bool:
        """Whether the model's own (first) stack is causal: only plain decoders are."""
        return self.arch == "decoder"

    def replace(self, **changes: Any) -> TransformerConfig:
        """A copy with some fields changed; an unknown field is a ConfigError naming it."""
        check_keys(changes, "model")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: str = "model") -> TransformerConfig:
        check_keys(values, where)
        return cls(**values)


_FIELD_TYPES = {
    "arch": Arch,
    "position": Position,
    "norm": Norm,
    "norm_position": NormPosition,
    "activation": Activation,
    "lm_head": LMHeadKind,
    "attention_impl": AttentionImpl,
    "attention_kind": AttentionKind,
}
FIELD_NAMES = tuple(f.name for f in dataclasses.fields(TransformerConfig))


def check_keys(values: dict[str, Any], where: str = "model") -> None:
    for key in values:
        if key not in FIELD_NAMES:
            raise ConfigError(f"unknown key {where}.{key}{closest(key, FIELD_NAMES)}")


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"model.{name}={value!r} must be a positive integer")


# ----------------------------------------------------------------------------- presets
# Each preset cites its source. Sizes are the published ones; dropout is the paper's.


def transformer_base() -> TransformerConfig:
    """Vaswani et al. 2017, Table 3 'base': 65M parameters, shared 37k BPE vocabulary (en-de)."""
    return TransformerConfig(
        arch="encoder_decoder",
        vocab_size=37000,
        d_model=512,
        n_heads=8,
        n_layers=6,
        d_ff=2048,
        max_seq_len=1024,
        position="sinusoidal",
        norm="layernorm",
        norm_position="post",
        activation="relu",
        dropout=0.1,
        scale_embeddings=True,
        tie_embeddings=True,
    )


def transformer_big() -> TransformerConfig:
    """Vaswani et al. 2017, Table 3 'big': 213M parameters, dropout 0.3."""
    return transformer_base().replace(d_model=1024, n_heads=16, d_ff=4096, dropout=0.3)


def bert_base() -> TransformerConfig:
    """Devlin et al. 2019 BERT-base (uncased vocabulary 30522): 110M parameters."""
    return TransformerConfig(
        arch="encoder",
        vocab_size=30522,
        d_model=768,
        n_heads=12,
        n_layers=12,
        d_ff=3072,
        max_seq_len=512,
        position="learned",
        norm="layernorm",
        norm_eps=1e-12,
        norm_position="post",
        embedding_norm=True,
        activation="gelu",
        dropout=0.1,
        attention_dropout=0.1,
        type_vocab_size=2,
        tie_embeddings=True,
        lm_head="bert_mlm",
    )


def gpt2_small() -> TransformerConfig:
    """Radford et al. 2019 GPT-2 small: 124M parameters, 1024 context."""
    return TransformerConfig(
        arch="decoder",
        vocab_size=50257,
        d_model=768,
        n_heads=12,
        n_layers=12,
        d_ff=3072,
        max_seq_len=1024,
        position="learned",
        norm="layernorm",
        norm_eps=1e-5,
        norm_position="pre",
        activation="gelu_tanh",
        dropout=0.1,
        attention_dropout=0.1,
        tie_embeddings=True,
    )


def t5_base() -> TransformerConfig:
    """Raffel et al. 2020 T5-base (v1.0): 220M parameters, ReLU, tied embeddings."""
    return TransformerConfig(
        arch="encoder_decoder",
        vocab_size=32128,
        d_model=768,
        n_heads=12,
        head_dim=64,
        n_layers=12,
        d_ff=3072,
        max_seq_len=512,
        position="t5_relative",
        norm="rmsnorm",
        norm_eps=1e-6,
        norm_position="pre",
        activation="relu",
        bias=False,
        dropout=0.1,
        scale_attention=False,
        tie_embeddings=True,
        scale_decoder_output=True,
    )


def t5_v1_1_base() -> TransformerConfig:
    """T5 v1.1 base: gated-GELU feed-forward (d_ff 2048), untied LM head, no dropout in pretraining."""
    return t5_base().replace(
        d_ff=2048,
        activation="geglu_tanh",
        tie_embeddings=False,
        scale_decoder_output=False,
        dropout=0.0,
    )


def tinyllama_1b() -> TransformerConfig:
    """LLaMA-style decoder (TinyLlama 1.1B: RMSNorm, SwiGLU, RoPE, GQA with 4 KV heads)."""
    return TransformerConfig(
        arch="decoder",
        vocab_size=32000,
        d_model=2048,
        n_heads=32,
        n_kv_heads=4,
        n_layers=22,
        d_ff=5632,
        max_seq_len=2048,
        position="rope",
        norm="rmsnorm",
        norm_eps=1e-5,
        norm_position="pre",
        activation="swiglu",
        bias=False,
        tie_embeddings=False,
    )


def llama2_70b() -> TransformerConfig:
    """Touvron et al. 2023 Llama 2 70B: GQA with 8 KV heads, 4096 context."""
    return tinyllama_1b().replace(
        d_model=8192,
        n_heads=64,
        n_kv_heads=8,
        n_layers=80,
        d_ff=28672,
        max_seq_len=4096,
    )


def gpt3_175b() -> TransformerConfig:
    """Brown et al. 2020 GPT-3 175B, Table 2.1: 96 layers, d_model 12288, 96 heads, 2048 context."""
    return gpt2_small().replace(
        d_model=12288,
        n_heads=96,
        n_layers=96,
        d_ff=4 * 12288,
        max_seq_len=2048,
    )


PRESETS: dict[str, Callable[[], TransformerConfig]] = {
    "transformer-base": transformer_base,
    "transformer-big": transformer_big,
    "bert-base": bert_base,
    "gpt2-small": gpt2_small,
    "t5-base": t5_base,
    "t5-v1_1-base": t5_v1_1_base,
    "tinyllama-1.1b": tinyllama_1b,
    "llama2-70b": llama2_70b,
    "gpt3-175b": gpt3_175b,
}


def preset(name: str, **overrides: Any) -> TransformerConfig:
    """A fresh config for a named preset, with optional field overrides."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}{closest(name, PRESETS)}; presets: {', '.join(PRESETS)}")
    config = PRESETS[name]()
    return config.replace(**overrides) if overrides else config
