"""What each transformers family's config.json holds when a core model is exported as that
family: the inverse of import_maps.py's readers, refusing in one line every field the family
cannot express (InteropError names the model key and its value).
"""

from __future__ import annotations

from typing import Any

from lit_transformer.model.config import TransformerConfig
from lit_transformer.model.interop.rules import (
    EXPORT_ACTIVATIONS,
    InteropError,
    lookup,
    require,
    require_standard_heads,
)


def bert_to_hf(cfg: TransformerConfig) -> dict[str, Any]:
    require(
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
    require_standard_heads(cfg, "BERT")
    # BERT's MLM transform uses hidden_act while the core's bert_mlm head is always exact GELU.
    require(cfg, "BERT (its MLM head shares hidden_act)", activation="gelu")
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


def gpt2_to_hf(cfg: TransformerConfig) -> dict[str, Any]:
    require(
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
    require_standard_heads(cfg, "GPT-2")
    return {
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.d_model,
        "n_head": cfg.n_heads,
        "n_layer": cfg.n_layers,
        "n_inner": cfg.d_ff,
        "n_positions": cfg.max_seq_len,
        "activation_function": lookup(EXPORT_ACTIVATIONS, cfg.activation, "model.activation (GPT-2 export)"),
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


T5_EXPORT_PROJ = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_tanh": "gelu_new",
    "geglu_tanh": "gated-gelu",
    "geglu": "gated-gelu_python",
    "swiglu": "gated-silu",
}


def t5_to_hf(cfg: TransformerConfig) -> dict[str, Any]:
    require(
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
        "feed_forward_proj": lookup(T5_EXPORT_PROJ, cfg.activation, "model.activation (T5 export)"),
        "is_encoder_decoder": True,
        "tie_word_embeddings": cfg.tie_embeddings,
        # Read by transformers >= 5; transformers 4 rescales exactly when embeddings are tied.
        "scale_decoder_outputs": cfg.scale_decoder_output,
    }


def llama_to_hf(cfg: TransformerConfig) -> dict[str, Any]:
    require(
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
