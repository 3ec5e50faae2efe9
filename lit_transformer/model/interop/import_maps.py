"""How each transformers family's config.json and tensor names map onto the core.

This is a file-format table, not a model branch: the core never looks at a family. Each
`Family` says how to read a transformers config into a TransformerConfig (and back, refusing
what the family cannot express), and lists `Rule`s pairing transformers tensor names with
core parameter names (rules.py defines both). `directories.py` does the file I/O and the
strict bookkeeping.

Shape legend: C model width, F feed-forward width, V vocabulary, P positions.
GPT-2's Conv1D stores its weight as (in, out), the transpose of nn.Linear's (out, in).
"""

from __future__ import annotations

from typing import Any

from lit_transformer.model.config import TransformerConfig
from lit_transformer.model.interop.export_maps import bert_to_hf, gpt2_to_hf, llama_to_hf, t5_to_hf
from lit_transformer.model.interop.rules import (
    PLAIN_ACTIVATIONS,
    Family,
    InteropError,
    Rule,
    embedding_and_head_rules,
    hf_value,
    linear_rules,
    lookup,
)


# ----------------------------------------------------------------------------- BERT
def _bert_config(hf: dict[str, Any], head: bool) -> TransformerConfig:
    activation = lookup(PLAIN_ACTIVATIONS, hf_value(hf, "hidden_act", "gelu"), "hidden_act")
    if head and activation != "gelu":
        raise InteropError(
            f"BERT hidden_act={hf['hidden_act']!r} with an MLM head: the head's transform uses "
            "hidden_act too, while the core's bert_mlm head is always exact GELU"
        )
    if hf_value(hf, "position_embedding_type", "absolute") != "absolute":
        raise InteropError(
            f"BERT position_embedding_type={hf['position_embedding_type']!r} is not supported (only 'absolute')"
        )
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise InteropError("BERT with is_decoder/add_cross_attention is not supported (encoder only)")
    return TransformerConfig(
        arch="encoder",
        vocab_size=hf_value(hf, "vocab_size", 30522),
        d_model=hf_value(hf, "hidden_size", 768),
        n_heads=hf_value(hf, "num_attention_heads", 12),
        n_layers=hf_value(hf, "num_hidden_layers", 12),
        d_ff=hf_value(hf, "intermediate_size", 3072),
        max_seq_len=hf_value(hf, "max_position_embeddings", 512),
        position="learned",
        norm="layernorm",
        norm_eps=hf_value(hf, "layer_norm_eps", 1e-12),
        norm_position="post",
        embedding_norm=True,
        activation=activation,
        dropout=hf_value(hf, "hidden_dropout_prob", 0.1),
        attention_dropout=hf_value(hf, "attention_probs_dropout_prob", 0.1),
        type_vocab_size=hf_value(hf, "type_vocab_size", 2),
        tie_embeddings=hf_value(hf, "tie_word_embeddings", True),
        lm_head="bert_mlm",
        init_std=hf_value(hf, "initializer_range", 0.02),
    )


def _bert_rules(cfg: TransformerConfig, head: bool) -> list[Rule]:
    e = "transformer.encoder"
    rules = embedding_and_head_rules(
        cfg, ("bert.embeddings.word_embeddings.weight",), "cls.predictions.decoder.weight", head
    )
    rules += [Rule(("bert.embeddings.position_embeddings.weight",), (f"{e}.embed.positions.weight",))]
    if cfg.type_vocab_size:
        rules += [Rule(("bert.embeddings.token_type_embeddings.weight",), (f"{e}.embed.token_types.weight",))]
    else:
        rules += [Rule(("bert.embeddings.token_type_embeddings.weight",), (), "zeros", (1, cfg.d_model))]
    rules += linear_rules("bert.embeddings.LayerNorm", f"{e}.embed.norm", True)
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
            rules += linear_rules(f"{h}.{hf_name}", f"{c}.{core_name}", True)
    if head:
        rules += linear_rules("cls.predictions.transform.dense", "lm_head.dense", True)
        rules += linear_rules("cls.predictions.transform.LayerNorm", "lm_head.norm", True)
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
    config_to_hf=bert_to_hf,
    rules=_bert_rules,
)


# ----------------------------------------------------------------------------- GPT-2
def _gpt2_config(hf: dict[str, Any], head: bool) -> TransformerConfig:
    if hf.get("scale_attn_by_inverse_layer_idx"):
        raise InteropError("GPT-2 scale_attn_by_inverse_layer_idx=true is not supported")
    if hf.get("add_cross_attention"):
        raise InteropError("GPT-2 add_cross_attention=true is not supported")
    d_model = hf_value(hf, "n_embd", 768)
    return TransformerConfig(
        arch="decoder",
        vocab_size=hf_value(hf, "vocab_size", 50257),
        d_model=d_model,
        n_heads=hf_value(hf, "n_head", 12),
        n_layers=hf_value(hf, "n_layer", 12),
        d_ff=hf_value(hf, "n_inner", 4 * d_model),
        max_seq_len=hf_value(hf, "n_positions", 1024),
        position="learned",
        norm="layernorm",
        norm_eps=hf_value(hf, "layer_norm_epsilon", 1e-5),
        norm_position="pre",
        activation=lookup(PLAIN_ACTIVATIONS, hf_value(hf, "activation_function", "gelu_new"), "activation_function"),
        dropout=hf_value(hf, "resid_pdrop", 0.1),
        attention_dropout=hf_value(hf, "attn_pdrop", 0.1),
        scale_attention=hf_value(hf, "scale_attn_weights", True),
        tie_embeddings=hf_value(hf, "tie_word_embeddings", True),
        init_std=hf_value(hf, "initializer_range", 0.02),
    )


def _gpt2_rules(cfg: TransformerConfig, head: bool) -> list[Rule]:
    d = "transformer.decoder"
    rules = embedding_and_head_rules(cfg, ("transformer.wte.weight",), "lm_head.weight", head)
    rules += [Rule(("transformer.wpe.weight",), (f"{d}.embed.positions.weight",))]
    for i in range(cfg.n_layers):
        h, c = f"transformer.h.{i}", f"{d}.blocks.{i}"
        rules += linear_rules(f"{h}.ln_1", f"{c}.norm1", True)
        rules += [
            Rule((f"{h}.attn.c_attn.weight",), tuple(f"{c}.attn.{p}.weight" for p in "qkv"), "split3_transpose"),
            Rule((f"{h}.attn.c_attn.bias",), tuple(f"{c}.attn.{p}.bias" for p in "qkv"), "split3"),
        ]
        rules += linear_rules(f"{h}.attn.c_proj", f"{c}.attn.o", True, "transpose")
        rules += linear_rules(f"{h}.ln_2", f"{c}.norm2", True)
        rules += linear_rules(f"{h}.mlp.c_fc", f"{c}.ffn.up", True, "transpose")
        rules += linear_rules(f"{h}.mlp.c_proj", f"{c}.ffn.down", True, "transpose")
    rules += linear_rules("transformer.ln_f", f"{d}.final_norm", True)
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
    config_to_hf=gpt2_to_hf,
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
    plain = lookup(PLAIN_ACTIVATIONS | {"silu": "silu", "swish": "silu"}, act, "T5 feed_forward_proj activation")
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


def _t5_config(hf: dict[str, Any], head: bool) -> TransformerConfig:
    tie = hf_value(hf, "tie_word_embeddings", True)
    n_layers = hf_value(hf, "num_layers", 6)
    return TransformerConfig(
        arch="encoder_decoder",
        vocab_size=hf_value(hf, "vocab_size", 32128),
        d_model=hf_value(hf, "d_model", 512),
        n_heads=hf_value(hf, "num_heads", 8),
        head_dim=hf_value(hf, "d_kv", 64),
        n_layers=n_layers,
        n_decoder_layers=hf_value(hf, "num_decoder_layers", n_layers),
        d_ff=hf_value(hf, "d_ff", 2048),
        max_seq_len=hf_value(hf, "n_positions", 512),
        position="t5_relative",
        relative_buckets=hf_value(hf, "relative_attention_num_buckets", 32),
        relative_max_distance=hf_value(hf, "relative_attention_max_distance", 128),
        norm="rmsnorm",
        norm_eps=hf_value(hf, "layer_norm_epsilon", 1e-6),
        norm_position="pre",
        activation=_t5_activation(hf_value(hf, "feed_forward_proj", "relu")),
        bias=False,
        dropout=hf_value(hf, "dropout_rate", 0.1),
        attention_dropout=hf_value(hf, "dropout_rate", 0.1),
        scale_attention=False,
        tie_embeddings=tie,
        # transformers 5 stores the d_model**-0.5 rescaling separately; 4 tied it to tying.
        scale_decoder_output=hf_value(hf, "scale_decoder_outputs", tie),
    )


def _t5_ffn(hf: str, core: str, gated: bool) -> list[Rule]:
    if gated:  # DenseGatedActDense: wo(act(wi_0 x) * wi_1 x)
        pairs = (("wi_0", "gate"), ("wi_1", "up"), ("wo", "down"))
    else:
        pairs = (("wi", "up"), ("wo", "down"))
    return [Rule((f"{hf}.DenseReluDense.{a}.weight",), (f"{core}.ffn.{b}.weight",)) for a, b in pairs]


def _t5_attention(hf: str, core: str) -> list[Rule]:
    return [Rule((f"{hf}.{p}.weight",), (f"{core}.{p}.weight",)) for p in "qkvo"]


def _t5_rules(cfg: TransformerConfig, head: bool) -> list[Rule]:
    rules = embedding_and_head_rules(
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
    config_to_hf=t5_to_hf,
    rules=_t5_rules,
)


# ----------------------------------------------------------------------------- LLaMA
def _llama_config(hf: dict[str, Any], head: bool) -> TransformerConfig:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise InteropError(f"LLaMA rope_type={rope_type!r} (RoPE scaling) is not supported; only 'default'")
    if hf_value(hf, "hidden_act", "silu") != "silu":
        raise InteropError(f"LLaMA hidden_act={hf['hidden_act']!r} is not supported; only 'silu' (SwiGLU)")
    attention_bias, mlp_bias = hf_value(hf, "attention_bias", False), hf_value(hf, "mlp_bias", False)
    if attention_bias != mlp_bias:
        raise InteropError(
            f"LLaMA attention_bias={attention_bias} with mlp_bias={mlp_bias}: the core has one `bias` switch for both"
        )
    d_model, n_heads = hf_value(hf, "hidden_size", 4096), hf_value(hf, "num_attention_heads", 32)
    return TransformerConfig(
        arch="decoder",
        vocab_size=hf_value(hf, "vocab_size", 32000),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=hf_value(hf, "num_key_value_heads", n_heads),
        head_dim=hf_value(hf, "head_dim", d_model // n_heads),
        n_layers=hf_value(hf, "num_hidden_layers", 32),
        d_ff=hf_value(hf, "intermediate_size", 11008),
        max_seq_len=hf_value(hf, "max_position_embeddings", 2048),
        position="rope",
        rope_base=float(rope.get("rope_theta", hf_value(hf, "rope_theta", 10000.0))),
        norm="rmsnorm",
        norm_eps=hf_value(hf, "rms_norm_eps", 1e-6),
        norm_position="pre",
        activation="swiglu",
        bias=attention_bias,
        dropout=0.0,
        attention_dropout=hf_value(hf, "attention_dropout", 0.0),
        tie_embeddings=hf_value(hf, "tie_word_embeddings", False),
        init_std=hf_value(hf, "initializer_range", 0.02),
    )


def _llama_rules(cfg: TransformerConfig, head: bool) -> list[Rule]:
    d = "transformer.decoder"
    rules = embedding_and_head_rules(cfg, ("model.embed_tokens.weight",), "lm_head.weight", head)
    for i in range(cfg.n_layers):
        h, c = f"model.layers.{i}", f"{d}.blocks.{i}"
        for p in "qkvo":
            rules += linear_rules(f"{h}.self_attn.{p}_proj", f"{c}.attn.{p}", cfg.bias)
        for p in ("gate", "up", "down"):
            rules += linear_rules(f"{h}.mlp.{p}_proj", f"{c}.ffn.{p}", cfg.bias)
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
    config_to_hf=llama_to_hf,
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
    # The speedrun levers (QK-norm, squared ReLU) have no place in these layouts: QK-norm's scales would be
    # dropped, and relu2 is mapped neither way (PLAIN_ACTIVATIONS, EXPORT_ACTIVATIONS).
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
