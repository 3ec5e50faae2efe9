"""How each transformers family's config.json and tensor names map onto the core.

This is a file-format table, not a model branch: the core never looks at a family. Each
`Family` says how to read a transformers config into a TransformerConfig (and back, refusing
what the family cannot express), and lists `Rule`s pairing transformers tensor names with
core parameter names. `interop.py` does the file I/O and the strict bookkeeping.

Shape legend: C model width, F feed-forward width, V vocabulary, P positions.
GPT-2's Conv1D stores its weight as (in, out), the transpose of nn.Linear's (out, in).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lit_transformer.model.config import TransformerConfig


class InteropError(ValueError):
    """A checkpoint or config cannot be mapped; the message names the path, key or field."""


@dataclass(frozen=True)
class Rule:
    """One transformers tensor <-> one or more core parameters.

    hf: names in a transformers checkpoint. Import reads the first one present; the others are
        tied aliases of the same tensor that a checkpoint may also hold. Export writes the first.
    core: core parameter names the tensor becomes.
    kind: copy | transpose (Conv1D) | split3 (fused q|k|v bias) | split3_transpose (fused
        Conv1D q|k|v weight) | zeros (export only: a tensor the core does not have).
    """

    hf: tuple[str, ...]
    core: tuple[str, ...]
    kind: str = "copy"
    shape: tuple[int, ...] = ()  # for kind="zeros"
    write_all: bool = False  # export under every name in `hf`, not only the first

    @property
    def written(self) -> tuple[str, ...]:
        return self.hf if self.write_all else self.hf[:1]


def to_core(rule: Rule, tensor: torch.Tensor) -> list[torch.Tensor]:
    if rule.kind == "copy":
        return [tensor]
    if rule.kind == "transpose":
        return [tensor.t()]  # (in, out) -> (out, in)
    if rule.kind == "split3":
        return list(tensor.chunk(3, dim=0))  # (3C,) -> 3 x (C,)
    if rule.kind == "split3_transpose":
        return list(tensor.t().chunk(3, dim=0))  # (C, 3C) -> (3C, C) -> 3 x (C, C)
    raise InteropError(f"rule kind {rule.kind!r} cannot be imported (tensor {rule.hf[0]})")


def to_hf(rule: Rule, tensors: list[torch.Tensor]) -> torch.Tensor:
    if rule.kind == "copy":
        return tensors[0]
    if rule.kind == "transpose":
        return tensors[0].t()  # (out, in) -> (in, out)
    if rule.kind == "split3":
        return torch.cat(tensors, dim=0)  # 3 x (C,) -> (3C,)
    if rule.kind == "split3_transpose":
        return torch.cat(tensors, dim=0).t()  # 3 x (C, C) -> (3C, C) -> (C, 3C)
    if rule.kind == "zeros":
        return torch.zeros(rule.shape)
    raise InteropError(f"unknown rule kind {rule.kind!r}")


def _linear(hf: str, core: str, bias: bool, kind: str = "copy") -> list[Rule]:
    rules = [Rule((f"{hf}.weight",), (f"{core}.weight",), kind)]
    if bias:
        rules.append(Rule((f"{hf}.bias",), (f"{core}.bias",)))
    return rules


def _embedding_and_head(cfg: TransformerConfig, embedding: tuple[str, ...], head_weight: str, head: bool) -> list[Rule]:
    """Tied: the head's weight is one more alias of the token embedding (read if present,
    never written: transformers re-ties it). Untied: a tensor of its own."""
    if cfg.tie_embeddings:
        return [Rule((*embedding, head_weight), ("transformer.tokens.weight",))]
    rules = [Rule(embedding, ("transformer.tokens.weight",))]
    if head:
        rules.append(Rule((head_weight,), ("lm_head.decoder.weight",)))
    return rules


def _get(hf: dict[str, Any], key: str, default: Any) -> Any:
    value = hf.get(key)
    return default if value is None else value


def _require(cfg: TransformerConfig, family: str, **expected: Any) -> None:
    """Export check: every listed core field must hold the value the family hard-codes."""
    for name, want in expected.items():
        have = getattr(cfg, name)
        if have != want:
            raise InteropError(
                f"cannot export to transformers {family}: model.{name}={have!r}, but {family} always has {want!r}"
            )


def _require_standard_heads(cfg: TransformerConfig, family: str) -> None:
    if cfg.kv_heads != cfg.n_heads:
        raise InteropError(
            f"cannot export to transformers {family}: model.n_kv_heads={cfg.n_kv_heads} "
            f"(grouped-query attention); {family} has one key/value head per query head"
        )
    if cfg.dim_per_head * cfg.n_heads != cfg.d_model:
        raise InteropError(
            f"cannot export to transformers {family}: model.head_dim={cfg.head_dim} "
            f"is not d_model / n_heads = {cfg.d_model // cfg.n_heads}"
        )


def _lookup(table: dict[str, str], value: str, what: str) -> str:
    if value not in table:
        raise InteropError(f"{what}={value!r} has no lit-transformer equivalent; supported: {sorted(table)}")
    return table[value]


# transformers ACT2FN names -> core activations. gelu_new, gelu_pytorch_tanh and gelu_fast are
# all the tanh approximation (Hendrycks & Gimpel 2016, section 2); gelu_python is the exact erf form.
_PLAIN_ACTIVATIONS = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
}
_EXPORT_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new"}


@dataclass(frozen=True)
class Family:
    name: str  # for messages
    model_type: str
    architectures: dict[str, bool]  # transformers class -> whether its checkpoint holds the LM head
    export_architecture: str
    prefix: str  # base-model prefix; a bare base-model checkpoint has its keys without it
    embedding: str  # token embedding's name (with prefix), to decide tying as transformers does
    head_weight: str  # LM head weight's name, tied to `embedding` when the config says so
    head_prefixes: tuple[str, ...]  # names belonging to the LM head (detects a headless checkpoint)
    ignored: tuple[str, ...]  # regexes of tensors knowingly dropped
    config_from_hf: Callable[[dict[str, Any], bool], TransformerConfig]  # (config.json, has LM head)
    config_to_hf: Callable[[TransformerConfig], dict[str, Any]]
    rules: Callable[[TransformerConfig, bool], list[Rule]]
    ignored_note: str = ""  # why the ignored tensors may be dropped

    def is_ignored(self, name: str) -> bool:
        return any(re.fullmatch(pattern, name) for pattern in self.ignored)


# ----------------------------------------------------------------------------- BERT
def _bert_config(hf: dict[str, Any], head: bool) -> TransformerConfig:
    activation = _lookup(_PLAIN_ACTIVATIONS, _get(hf, "hidden_act", "gelu"), "hidden_act")
    if head and activation != "gelu":
        raise InteropError(
            f"BERT hidden_act={hf['hidden_act']!r} with an MLM head: the head's transform uses "
            "hidden_act too, while the core's bert_mlm head is always exact GELU"
        )
    if _get(hf, "position_embedding_type", "absolute") != "absolute":
        raise InteropError(
            f"BERT position_embedding_type={hf['position_embedding_type']!r} is not supported (only 'absolute')"
        )
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise InteropError("BERT with is_decoder/add_cross_attention is not supported (encoder only)")
    return TransformerConfig(
        arch="encoder",
        vocab_size=_get(hf, "vocab_size", 30522),
        d_model=_get(hf, "hidden_size", 768),
        n_heads=_get(hf, "num_attention_heads", 12),
        n_layers=_get(hf, "num_hidden_layers", 12),
        d_ff=_get(hf, "intermediate_size", 3072),
        max_seq_len=_get(hf, "max_position_embeddings", 512),
        position="learned",
        norm="layernorm",
        norm_eps=_get(hf, "layer_norm_eps", 1e-12),
        norm_position="post",
        embedding_norm=True,
        activation=activation,
        dropout=_get(hf, "hidden_dropout_prob", 0.1),
        attention_dropout=_get(hf, "attention_probs_dropout_prob", 0.1),
        type_vocab_size=_get(hf, "type_vocab_size", 2),
        tie_embeddings=_get(hf, "tie_word_embeddings", True),
        lm_head="bert_mlm",
        init_std=_get(hf, "initializer_range", 0.02),
    )


def _bert_to_hf(cfg: TransformerConfig) -> dict[str, Any]:
    _require(
        cfg,
        "BERT",
        arch="encoder",
        position="learned",
        norm="layernorm",
        norm_position="post",
        embedding_norm=True,
        scale_embeddings=False,
        scale_attention=True,
        bias=True,
        lm_head="bert_mlm",
        scale_decoder_output=False,
    )
    _require_standard_heads(cfg, "BERT")
    # BERT's MLM transform uses hidden_act while the core's bert_mlm head is always exact GELU.
    _require(cfg, "BERT (its MLM head shares hidden_act)", activation="gelu")
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_attention_heads": cfg.n_heads,
        "num_hidden_layers": cfg.n_layers,
        "intermediate_size": cfg.d_ff,
        "hidden_act": "gelu",
        "max_position_embeddings": cfg.max_seq_len,
        "position_embedding_type": "absolute",
        # No token types in the core is one all-zero type row in BERT: it adds nothing.
        "type_vocab_size": max(cfg.type_vocab_size, 1),
        "layer_norm_eps": cfg.norm_eps,
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attention_dropout,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "is_decoder": False,
    }


def _bert_rules(cfg: TransformerConfig, head: bool) -> list[Rule]:
    e = "transformer.encoder"
    rules = _embedding_and_head(
        cfg, ("bert.embeddings.word_embeddings.weight",), "cls.predictions.decoder.weight", head
    )
    rules += [Rule(("bert.embeddings.position_embeddings.weight",), (f"{e}.embed.positions.weight",))]
    if cfg.type_vocab_size:
        rules += [Rule(("bert.embeddings.token_type_embeddings.weight",), (f"{e}.embed.token_types.weight",))]
    else:
        rules += [Rule(("bert.embeddings.token_type_embeddings.weight",), (), "zeros", (1, cfg.d_model))]
    rules += _linear("bert.embeddings.LayerNorm", f"{e}.embed.norm", True)
    for i in range(cfg.n_layers):
        h, c = f"bert.encoder.layer.{i}", f"{e}.blocks.{i}"
        for hf_name, core_name in (
            ("attention.self.query", "attn.q"),
            ("attention.self.key", "attn.k"),
            ("attention.self.value", "attn.v"),
            ("attention.output.dense", "attn.o"),
            ("attention.output.LayerNorm", "norm1"),
            ("intermediate.dense", "ffn.up"),
            ("output.dense", "ffn.down"),
            ("output.LayerNorm", "norm2"),
        ):
            rules += _linear(f"{h}.{hf_name}", f"{c}.{core_name}", True)
    if head:
        rules += _linear("cls.predictions.transform.dense", "lm_head.dense", True)
        rules += _linear("cls.predictions.transform.LayerNorm", "lm_head.norm", True)
        # One bias under two names: tied in transformers 4, and in 5 when the embeddings are tied;
        # an untied transformers-5 model uses decoder.bias and leaves predictions.bias unused.
        rules += [
            Rule(("cls.predictions.decoder.bias", "cls.predictions.bias"), ("lm_head.decoder.bias",), write_all=True)
        ]
    return rules


BERT = Family(
    name="BERT",
    model_type="bert",
    architectures={"BertForMaskedLM": True, "BertForPreTraining": True, "BertModel": False},
    export_architecture="BertForMaskedLM",
    prefix="bert.",
    embedding="bert.embeddings.word_embeddings.weight",
    head_weight="cls.predictions.decoder.weight",
    head_prefixes=("cls.predictions.",),
    ignored=(r"bert\.pooler\..*", r"bert\.embeddings\.position_ids", r"cls\.seq_relationship\..*"),
    ignored_note="the pooler and next-sentence head are not part of a language model",
    config_from_hf=_bert_config,
    config_to_hf=_bert_to_hf,
    rules=_bert_rules,
)


# ----------------------------------------------------------------------------- GPT-2
def _gpt2_config(hf: dict[str, Any], head: bool) -> TransformerConfig:
    if hf.get("scale_attn_by_inverse_layer_idx"):
        raise InteropError("GPT-2 scale_attn_by_inverse_layer_idx=true is not supported")
    if hf.get("add_cross_attention"):
        raise InteropError("GPT-2 add_cross_attention=true is not supported")
    d_model = _get(hf, "n_embd", 768)
    return TransformerConfig(
        arch="decoder",
        vocab_size=_get(hf, "vocab_size", 50257),
        d_model=d_model,
        n_heads=_get(hf, "n_head", 12),
        n_layers=_get(hf, "n_layer", 12),
        d_ff=_get(hf, "n_inner", 4 * d_model),
        max_seq_len=_get(hf, "n_positions", 1024),
        position="learned",
        norm="layernorm",
        norm_eps=_get(hf, "layer_norm_epsilon", 1e-5),
        norm_position="pre",
        activation=_lookup(_PLAIN_ACTIVATIONS, _get(hf, "activation_function", "gelu_new"), "activation_function"),
        dropout=_get(hf, "resid_pdrop", 0.1),
        attention_dropout=_get(hf, "attn_pdrop", 0.1),
        scale_attention=_get(hf, "scale_attn_weights", True),
        tie_embeddings=_get(hf, "tie_word_embeddings", True),
        init_std=_get(hf, "initializer_range", 0.02),
    )


def _gpt2_to_hf(cfg: TransformerConfig) -> dict[str, Any]:
    _require(
        cfg,
        "GPT-2",
        arch="decoder",
        position="learned",
        norm="layernorm",
        norm_position="pre",
        embedding_norm=False,
        scale_embeddings=False,
        bias=True,
        lm_head="linear",
        scale_decoder_output=False,
        type_vocab_size=0,
    )
    _require_standard_heads(cfg, "GPT-2")
    return {
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.d_model,
        "n_head": cfg.n_heads,
        "n_layer": cfg.n_layers,
        "n_inner": cfg.d_ff,
        "n_positions": cfg.max_seq_len,
        "activation_function": _lookup(_EXPORT_ACTIVATIONS, cfg.activation, "model.activation (GPT-2 export)"),
        "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.attention_dropout,
        "scale_attn_weights": cfg.scale_attention,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        # Token ids belong to the tokenizer, not the model: pass them in export_hf(extra_config=...).
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }


def _gpt2_rules(cfg: TransformerConfig, head: bool) -> list[Rule]:
    d = "transformer.decoder"
    rules = _embedding_and_head(cfg, ("transformer.wte.weight",), "lm_head.weight", head)
    rules += [Rule(("transformer.wpe.weight",), (f"{d}.embed.positions.weight",))]
    for i in range(cfg.n_layers):
        h, c = f"transformer.h.{i}", f"{d}.blocks.{i}"
        rules += _linear(f"{h}.ln_1", f"{c}.norm1", True)
        rules += [
            Rule((f"{h}.attn.c_attn.weight",), tuple(f"{c}.attn.{p}.weight" for p in "qkv"), "split3_transpose"),
            Rule((f"{h}.attn.c_attn.bias",), tuple(f"{c}.attn.{p}.bias" for p in "qkv"), "split3"),
        ]
        rules += _linear(f"{h}.attn.c_proj", f"{c}.attn.o", True, "transpose")
        rules += _linear(f"{h}.ln_2", f"{c}.norm2", True)
        rules += _linear(f"{h}.mlp.c_fc", f"{c}.ffn.up", True, "transpose")
        rules += _linear(f"{h}.mlp.c_proj", f"{c}.ffn.down", True, "transpose")
    rules += _linear("transformer.ln_f", f"{d}.final_norm", True)
    return rules


GPT2 = Family(
    name="GPT-2",
    model_type="gpt2",
    architectures={"GPT2LMHeadModel": True, "GPT2Model": False},
    export_architecture="GPT2LMHeadModel",
    prefix="transformer.",
    embedding="transformer.wte.weight",
    head_weight="lm_head.weight",
    head_prefixes=("lm_head.",),
    ignored=(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)",),
    ignored_note="attn.bias / attn.masked_bias are causal-mask buffers of older checkpoints",
    config_from_hf=_gpt2_config,
    config_to_hf=_gpt2_to_hf,
    rules=_gpt2_rules,
)


# ----------------------------------------------------------------------------- T5
def _t5_activation(proj: str) -> str:
    """T5Config: 'gated-X' is a gated FFN with act X, except that 'gated-gelu' means gelu_new
    (the tanh approximation T5 v1.1 was trained with)."""
    gated, _, act = proj.rpartition("-")
    if gated not in ("", "gated"):
        raise InteropError(f"T5 feed_forward_proj={proj!r} is not 'X' or 'gated-X'")
    if proj == "gated-gelu":
        act = "gelu_new"
    plain = _lookup(_PLAIN_ACTIVATIONS | {"silu": "silu", "swish": "silu"}, act, "T5 feed_forward_proj activation")
    if not gated:
        if plain == "silu":
            raise InteropError(f"T5 feed_forward_proj={proj!r}: an ungated SiLU FFN has no core equivalent")
        return plain
    gated_table = {"gelu": "geglu", "gelu_tanh": "geglu_tanh", "silu": "swiglu"}
    if plain not in gated_table:
        raise InteropError(
            f"T5 feed_forward_proj={proj!r}: a gated {act} FFN has no core equivalent "
            f"(gated ones: {sorted(gated_table)})"
        )
    return gated_table[plain]


_T5_EXPORT_PROJ = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_tanh": "gelu_new",
    "geglu_tanh": "gated-gelu",
    "geglu": "gated-gelu_python",
    "swiglu": "gated-silu",
}


def _t5_config(hf: dict[str, Any], head: bool) -> TransformerConfig:
    tie = _get(hf, "tie_word_embeddings", True)
    n_layers = _get(hf, "num_layers", 6)
    return TransformerConfig(
        arch="encoder_decoder",
        vocab_size=_get(hf, "vocab_size", 32128),
        d_model=_get(hf, "d_model", 512),
        n_heads=_get(hf, "num_heads", 8),
        head_dim=_get(hf, "d_kv", 64),
        n_layers=n_layers,
        n_decoder_layers=_get(hf, "num_decoder_layers", n_layers),
        d_ff=_get(hf, "d_ff", 2048),
        max_seq_len=_get(hf, "n_positions", 512),
        position="t5_relative",
        relative_buckets=_get(hf, "relative_attention_num_buckets", 32),
        relative_max_distance=_get(hf, "relative_attention_max_distance", 128),
        norm="rmsnorm",
        norm_eps=_get(hf, "layer_norm_epsilon", 1e-6),
        norm_position="pre",
        activation=_t5_activation(_get(hf, "feed_forward_proj", "relu")),
        bias=False,
        dropout=_get(hf, "dropout_rate", 0.1),
        attention_dropout=_get(hf, "dropout_rate", 0.1),
        scale_attention=False,
        tie_embeddings=tie,
        # transformers 5 stores the d_model**-0.5 rescaling separately; 4 tied it to tying.
        scale_decoder_output=_get(hf, "scale_decoder_outputs", tie),
    )


def _t5_to_hf(cfg: TransformerConfig) -> dict[str, Any]:
    _require(
        cfg,
        "T5",
        arch="encoder_decoder",
        position="t5_relative",
        norm="rmsnorm",
        norm_position="pre",
        embedding_norm=False,
        scale_embeddings=False,
        bias=False,
        scale_attention=False,
        lm_head="linear",
        type_vocab_size=0,
    )
    if cfg.kv_heads != cfg.n_heads:
        raise InteropError(
            f"cannot export to transformers T5: model.n_kv_heads={cfg.n_kv_heads} (T5 has one "
            "key/value head per query head)"
        )
    return {
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "d_kv": cfg.dim_per_head,
        "d_ff": cfg.d_ff,
        "num_layers": cfg.n_layers,
        "num_decoder_layers": cfg.decoder_layers,
        "num_heads": cfg.n_heads,
        "relative_attention_num_buckets": cfg.relative_buckets,
        "relative_attention_max_distance": cfg.relative_max_distance,
        "n_positions": cfg.max_seq_len,
        "dropout_rate": cfg.dropout,
        "layer_norm_epsilon": cfg.norm_eps,
        "feed_forward_proj": _lookup(_T5_EXPORT_PROJ, cfg.activation, "model.activation (T5 export)"),
        "is_encoder_decoder": True,
        "tie_word_embeddings": cfg.tie_embeddings,
        # Read by transformers >= 5; transformers 4 rescales exactly when embeddings are tied.
        "scale_decoder_outputs": cfg.scale_decoder_output,
    }


def _t5_ffn(hf: str, core: str, gated: bool) -> list[Rule]:
    if gated:  # DenseGatedActDense: wo(act(wi_0 x) * wi_1 x)
        pairs = (("wi_0", "gate"), ("wi_1", "up"), ("wo", "down"))
    else:
        pairs = (("wi", "up"), ("wo", "down"))
    return [Rule((f"{hf}.DenseReluDense.{a}.weight",), (f"{core}.ffn.{b}.weight",)) for a, b in pairs]


def _t5_attention(hf: str, core: str) -> list[Rule]:
    return [Rule((f"{hf}.{p}.weight",), (f"{core}.{p}.weight",)) for p in "qkvo"]


def _t5_rules(cfg: TransformerConfig, head: bool) -> list[Rule]:
    rules = _embedding_and_head(
        cfg, ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"), "lm_head.weight", head
    )
    for stack, n in (("encoder", cfg.n_layers), ("decoder", cfg.decoder_layers)):
        c = f"transformer.{stack}"
        # HF keeps the stack's single relative-bias table in block 0's self-attention.
        rules += [
            Rule(
                (f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",),
                (f"{c}.relative_bias.embedding.weight",),
            )
        ]
        for i in range(n):
            h, b = f"{stack}.block.{i}.layer", f"{c}.blocks.{i}"
            rules += _t5_attention(f"{h}.0.SelfAttention", f"{b}.attn")
            rules += [Rule((f"{h}.0.layer_norm.weight",), (f"{b}.norm1.weight",))]
            ffn = 1
            if stack == "decoder":
                rules += _t5_attention(f"{h}.1.EncDecAttention", f"{b}.cross_attn")
                rules += [Rule((f"{h}.1.layer_norm.weight",), (f"{b}.norm_cross.weight",))]
                ffn = 2
            rules += _t5_ffn(f"{h}.{ffn}", b, cfg.gated)
            rules += [Rule((f"{h}.{ffn}.layer_norm.weight",), (f"{b}.norm2.weight",))]
        rules += [Rule((f"{stack}.final_layer_norm.weight",), (f"{c}.final_norm.weight",))]
    return rules


T5 = Family(
    name="T5",
    model_type="t5",
    architectures={"T5ForConditionalGeneration": True, "T5Model": False},
    export_architecture="T5ForConditionalGeneration",
    prefix="",
    embedding="shared.weight",
    head_weight="lm_head.weight",
    head_prefixes=("lm_head.",),
    ignored=(r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight",),
    ignored_note="cross-attention never had a relative bias; some old checkpoints carry an unused one",
    config_from_hf=_t5_config,
    config_to_hf=_t5_to_hf,
    rules=_t5_rules,
)


# ----------------------------------------------------------------------------- LLaMA
def _llama_config(hf: dict[str, Any], head: bool) -> TransformerConfig:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise InteropError(f"LLaMA rope_type={rope_type!r} (RoPE scaling) is not supported; only 'default'")
    if _get(hf, "hidden_act", "silu") != "silu":
        raise InteropError(f"LLaMA hidden_act={hf['hidden_act']!r} is not supported; only 'silu' (SwiGLU)")
    attention_bias, mlp_bias = _get(hf, "attention_bias", False), _get(hf, "mlp_bias", False)
    if attention_bias != mlp_bias:
        raise InteropError(
            f"LLaMA attention_bias={attention_bias} with mlp_bias={mlp_bias}: the core has one `bias` switch for both"
        )
    d_model, n_heads = _get(hf, "hidden_size", 4096), _get(hf, "num_attention_heads", 32)
    return TransformerConfig(
        arch="decoder",
        vocab_size=_get(hf, "vocab_size", 32000),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=_get(hf, "num_key_value_heads", n_heads),
        head_dim=_get(hf, "head_dim", d_model // n_heads),
        n_layers=_get(hf, "num_hidden_layers", 32),
        d_ff=_get(hf, "intermediate_size", 11008),
        max_seq_len=_get(hf, "max_position_embeddings", 2048),
        position="rope",
        rope_base=float(rope.get("rope_theta", _get(hf, "rope_theta", 10000.0))),
        norm="rmsnorm",
        norm_eps=_get(hf, "rms_norm_eps", 1e-6),
        norm_position="pre",
        activation="swiglu",
        bias=attention_bias,
        dropout=0.0,
        attention_dropout=_get(hf, "attention_dropout", 0.0),
        tie_embeddings=_get(hf, "tie_word_embeddings", False),
        init_std=_get(hf, "initializer_range", 0.02),
    )


def _llama_to_hf(cfg: TransformerConfig) -> dict[str, Any]:
    _require(
        cfg,
        "LLaMA",
        arch="decoder",
        position="rope",
        norm="rmsnorm",
        norm_position="pre",
        activation="swiglu",
        embedding_norm=False,
        scale_embeddings=False,
        scale_attention=True,
        lm_head="linear",
        scale_decoder_output=False,
        type_vocab_size=0,
    )
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.dim_per_head,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "attention_dropout": cfg.attention_dropout,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }


def _llama_rules(cfg: TransformerConfig, head: bool) -> list[Rule]:
    d = "transformer.decoder"
    rules = _embedding_and_head(cfg, ("model.embed_tokens.weight",), "lm_head.weight", head)
    for i in range(cfg.n_layers):
        h, c = f"model.layers.{i}", f"{d}.blocks.{i}"
        for p in "qkvo":
            rules += _linear(f"{h}.self_attn.{p}_proj", f"{c}.attn.{p}", cfg.bias)
        for p in ("gate", "up", "down"):
            rules += _linear(f"{h}.mlp.{p}_proj", f"{c}.ffn.{p}", cfg.bias)
        rules += [
            Rule((f"{h}.input_layernorm.weight",), (f"{c}.norm1.weight",)),
            Rule((f"{h}.post_attention_layernorm.weight",), (f"{c}.norm2.weight",)),
        ]
    rules += [Rule(("model.norm.weight",), (f"{d}.final_norm.weight",))]
    return rules


LLAMA = Family(
    name="LLaMA",
    model_type="llama",
    architectures={"LlamaForCausalLM": True, "LlamaModel": False},
    export_architecture="LlamaForCausalLM",
    prefix="model.",
    embedding="model.embed_tokens.weight",
    head_weight="lm_head.weight",
    head_prefixes=("lm_head.",),
    ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
    ignored_note="rotary_emb.inv_freq is a recomputable buffer of older checkpoints",
    config_from_hf=_llama_config,
    config_to_hf=_llama_to_hf,
    rules=_llama_rules,
)

FAMILIES: dict[str, Family] = {f.model_type: f for f in (BERT, GPT2, T5, LLAMA)}


def family_for_export(cfg: TransformerConfig) -> Family:
    """The one transformers family whose layout matches the config's architecture and positions;
    the family's own checks then name any remaining field it cannot express."""
    # Every family attends with full softmax attention: a window, global tokens or linear
    # attention exported as one of them would load and run, and compute another function.
    for name, full in (("sliding_window", None), ("global_tokens", 0), ("attention_kind", "softmax")):
        if getattr(cfg, name) != full:
            raise InteropError(
                f"cannot export to transformers: model.{name}={getattr(cfg, name)!r}; BERT, GPT-2, "
                f"T5 and LLaMA have full softmax attention only (model.{name}={full!r})"
            )
    # The speedrun levers (issue #14) have no place in these layouts: QK-norm's scales would be
    # dropped, and relu2 is mapped neither way (_PLAIN_ACTIVATIONS, _EXPORT_ACTIVATIONS).
    if cfg.qk_norm or cfg.activation == "relu2":
        name, value = ("qk_norm", True) if cfg.qk_norm else ("activation", "relu2")
        raise InteropError(
            f"cannot export to transformers: model.{name}={value!r}; BERT, GPT-2, T5 and LLaMA "
            "have no query/key norm and no squared-ReLU feed-forward"
        )
    if cfg.arch == "encoder":
        return BERT
    if cfg.arch == "decoder" and cfg.position == "learned":
        return GPT2
    if cfg.arch == "decoder" and cfg.position == "rope":
        return LLAMA
    if cfg.arch == "encoder_decoder" and cfg.position == "t5_relative":
        return T5
    what = (
        "decoders need position='learned' (GPT-2) or 'rope' (LLaMA)"
        if cfg.arch == "decoder"
        else "encoder_decoder models need position='t5_relative' (T5)"
    )
    raise InteropError(
        f"cannot export to transformers: model.position={cfg.position!r} with model.arch={cfg.arch!r}; {what}"
    )
