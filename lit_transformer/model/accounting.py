"""Size, training compute and KV-cache memory of a model, from its TransformerConfig alone.

Nothing is allocated (not even on the meta device): every number is arithmetic on the
config, mirroring module by module what `LanguageModel(cfg)` builds, and the tests check
each one against the built model (parameter numel, `FlopCounterMode`, `KVCache` tensors).

Symbols: C d_model, F d_ff, H query heads, K key/value heads, D head dim, V vocabulary,
L layers of one stack, S encoder (source) length, T decoder length (the sequence length of
decoder-only and encoder-only models).

Parameters
    `count_parameters` equals `sum(p.numel() for p in LanguageModel(cfg).parameters())`
    (tied weights counted once). `non_embedding_parameters` follows Kaplan et al. 2020
    (section 2.1): it leaves out everything sized by the vocabulary or by positions: token,
    token-type and position embeddings, T5's relative-bias tables, an untied unembedding
    matrix and BERT's vocabulary-sized output bias.

Training FLOPs (`train_flops`, `train_flops_per_token`)
    Each multiply-accumulate is 2 FLOPs; training costs forward + backward = 3x forward,
    since backward computes the gradient with respect to both the input and the weight of
    every matrix product (Kaplan et al. 2020, 2.1; Hoffmann et al. 2022 "Chinchilla",
    appendix F). Hence:

    * dense: 6 FLOPs per weight of every matrix a token passes through, per token. This
      includes the LM head's unembedding (2CV per output token, tied or not: the matmul
      happens either way) and BERT's MLM transform, and leaves out embedding lookups,
      norms (QK-norm's too), biases, activations, softmax and RoPE (elementwise, O(C) per
      token, not matrix products).
    * attention: QK^T and softmax(.)V each cost 2*H*D FLOPs per (query, key) pair, so
      training costs 12*H*D per pair and layer: per decoder-only token 12*L*H*D*T.
      This is PaLM's `6N + 12*L*H*Q*T` (Chowdhery et al. 2022, appendix B). Like PaLM we
      count the full T x T score matrix, NOT the causal half: it is what the math path
      and `FlopCounterMode` compute, and what PaLM-style MFU figures assume; a causal flash
      kernel skips about half of these pairs, so its hardware FLOPs are lower.
      With GQA/MQA the projections shrink (K < H) but the scores are still per query head.

    Encoder-only (MLM): the LM head runs over all T positions in our LanguageModel (the
    loss then picks the masked ones), so all T are counted. Decoder-only: per token of
    the sequence.

    Encoder-decoder: per token of the ENCODER INPUT (source), the T5 paper's token count
    (Raffel et al. 2020, 3.1.2: 2^35 tokens = 2^19 steps x 128 sequences x 512 input
    tokens). The total per example is divided by `seq_len` = S, with the decoder's work
    on `decoder_seq_len` = T target tokens amortised into it:
        encoder  6 * (encoder weights) * S + 12*L_enc*H*D*S*S
        decoder  6 * (self-attention + FFN + cross-attention q,o weights + LM head) * T
                 + 12*L_dec*H*D*T*T                      (causal self-attention, full T x T)
        cross    6 * (cross-attention k,v weights) * L_dec * S   (keys and values are
                   projected once per SOURCE token, from the encoder output)
                 + 12*L_dec*H*D*T*S                      (target queries x source keys)
    `decoder_seq_len` defaults to `seq_len` (translation: source and target of similar
    length). For T5 span corruption pass the target length: with 15% noise and mean span
    3, 512 inputs give 114 targets (about 0.22 x; `random_spans_helper` in t5.data.preprocessors).

KV cache
    Per cached decoder token: K and V of every decoder layer, 2 * L_dec * K * D * bytes;
    encoder-only models have no cache. An encoder-decoder also caches the cross-attention
    keys and values of the encoder output: the same amount per SOURCE token
    (`cross_kv_cache_bytes_per_source_token`). Our KVCache additionally keeps a bool key
    mask and an int64 position per cached token and batch row (9 bytes, layer-independent),
    not counted here.
"""

from __future__ import annotations

from dataclasses import dataclass

from lit_transformer.model.config import ConfigError, TransformerConfig

# ----------------------------------------------------------------------------- parameters


def _norm_params(cfg: TransformerConfig) -> int:
    return 2 * cfg.d_model if cfg.norm == "layernorm" else cfg.d_model  # LayerNorm has a bias; RMSNorm not


def _attention_weights(cfg: TransformerConfig) -> tuple[int, int]:
    """(q and o weights, k and v weights) of one attention module."""
    C, H, K, D = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.dim_per_head
    return 2 * C * H * D, 2 * C * K * D


def _attention_params(cfg: TransformerConfig) -> int:
    qo, kv = _attention_weights(cfg)
    H, K, D = cfg.n_heads, cfg.kv_heads, cfg.dim_per_head
    biases = H * D + 2 * K * D + cfg.d_model if cfg.bias else 0  # q, k, v, o
    qk_norm = 2 * D if cfg.qk_norm else 0  # one (D,) RMSNorm scale each for queries and keys
    return qo + kv + biases + qk_norm


def _ffn_weights(cfg: TransformerConfig) -> int:
    inputs = 2 if cfg.gated else 1  # gated: gate and up
    return (inputs + 1) * cfg.d_model * cfg.d_ff


def _ffn_params(cfg: TransformerConfig) -> int:
    inputs = 2 if cfg.gated else 1
    biases = inputs * cfg.d_ff + cfg.d_model if cfg.bias else 0
    return _ffn_weights(cfg) + biases


def _stacks(cfg: TransformerConfig) -> list[tuple[str, int, bool]]:
    """(name, layers, cross-attends) of each stack, as Transformer builds them."""
    if cfg.arch == "encoder":
        return [("encoder", cfg.n_layers, False)]
    if cfg.arch == "decoder":
        return [("decoder", cfg.n_layers, False)]
    return [("encoder", cfg.n_layers, False), ("decoder", cfg.decoder_layers, True)]


# Breakdown keys that count as embeddings (Kaplan et al. 2020's non-embedding count leaves them out).
EMBEDDING_KEYS = (
    "embeddings.tokens",
    "embeddings.token_types",
    "embeddings.positions",
    "lm_head.unembedding",
    "lm_head.bias",
)


def parameter_breakdown(cfg: TransformerConfig) -> dict[str, int]:
    """Parameters by part; the values sum to `count_parameters(cfg)`.

    Keys: embeddings.{tokens,token_types,positions} (positions: learned tables and T5
    relative-bias tables of every stack), {encoder,decoder}.{attention,cross_attention,ffn,norms}
    (norms: block norms, the pre-norm final norm and the embedding norm of that stack; QK-norm
    scales live inside the attention modules and count under attention),
    lm_head.{transform,unembedding,bias}.
    """
    C = cfg.d_model
    parts = {"embeddings.tokens": cfg.vocab_size * C, "embeddings.token_types": 0, "embeddings.positions": 0}
    for name, layers, cross in _stacks(cfg):
        parts["embeddings.token_types"] += cfg.type_vocab_size * C  # each stack has its own table
        if cfg.position == "learned":
            parts["embeddings.positions"] += cfg.max_seq_len * C
        elif cfg.position == "t5_relative":
            parts["embeddings.positions"] += cfg.relative_buckets * cfg.n_heads  # shared by the stack's layers
        parts[f"{name}.attention"] = layers * _attention_params(cfg)
        if cross:
            parts[f"{name}.cross_attention"] = layers * _attention_params(cfg)
        parts[f"{name}.ffn"] = layers * _ffn_params(cfg)
        norms = layers * (3 if cross else 2) + (cfg.norm_position == "pre") + cfg.embedding_norm
        parts[f"{name}.norms"] = norms * _norm_params(cfg)
    mlm = cfg.lm_head == "bert_mlm"
    parts["lm_head.transform"] = C * C + C + _norm_params(cfg) if mlm else 0  # dense (with bias) + norm
    parts["lm_head.unembedding"] = 0 if cfg.tie_embeddings else cfg.vocab_size * C
    parts["lm_head.bias"] = cfg.vocab_size if mlm else 0
    return parts


def count_parameters(cfg: TransformerConfig) -> int:
    """Trainable parameters of `LanguageModel(cfg)`, tied weights counted once."""
    return sum(parameter_breakdown(cfg).values())


def non_embedding_parameters(cfg: TransformerConfig) -> int:
    """Parameters less everything sized by the vocabulary or by positions (Kaplan et al. 2020)."""
    parts = parameter_breakdown(cfg)
    return sum(value for key, value in parts.items() if key not in EMBEDDING_KEYS)


# ----------------------------------------------------------------------------- FLOPs


@dataclass(frozen=True)
class TrainFlops:
    """Training (forward + backward) FLOPs of ONE example, by part. See the module docstring.

    Decoder-only models put their stack in the decoder_* fields, encoder-only ones in encoder_*.
    """

    seq_len: int  # S for encoder-only / encoder-decoder, T for decoder-only
    decoder_seq_len: int | None  # T of an encoder-decoder; None otherwise
    encoder_dense: int = 0  # 6 * encoder matrix weights * S
    encoder_attention: int = 0  # 12 * L_enc * H*D * S*S
    decoder_dense: int = 0  # 6 * (self-attention + FFN [+ cross q, o]) weights * T
    decoder_attention: int = 0  # 12 * L_dec * H*D * T*T (self-attention)
    cross_kv_projection: int = 0  # 6 * L_dec * (cross k, v weights) * S
    cross_attention: int = 0  # 12 * L_dec * H*D * T*S
    lm_head: int = 0  # 6 * (C*V [+ C*C MLM transform]) * output positions

    @property
    def total(self) -> int:
        return (
            self.encoder_dense
            + self.encoder_attention
            + self.decoder_dense
            + self.decoder_attention
            + self.cross_kv_projection
            + self.cross_attention
            + self.lm_head
        )

    @property
    def attention(self) -> int:
        """The score and weighted-sum products, PaLM's 12*L*H*Q*T term (per example)."""
        return self.encoder_attention + self.decoder_attention + self.cross_attention

    @property
    def per_token(self) -> float:
        """Per token of `seq_len`: the sequence, or an encoder-decoder's source."""
        return self.total / self.seq_len


def train_flops(cfg: TransformerConfig, seq_len: int, decoder_seq_len: int | None = None) -> TrainFlops:
    """Training FLOPs of one example of `seq_len` tokens (encoder-decoder: `seq_len` source and
    `decoder_seq_len` target tokens, default `seq_len`)."""
    if seq_len <= 0:
        raise ConfigError(f"seq_len={seq_len} must be positive")
    if decoder_seq_len is not None and cfg.arch != "encoder_decoder":
        raise ConfigError(f"decoder_seq_len is only for arch=encoder_decoder, not {cfg.arch!r}")
    qo, kv = _attention_weights(cfg)
    layer_weights = qo + kv + _ffn_weights(cfg)
    score_flops = 12 * cfg.n_heads * cfg.dim_per_head  # per (query, key) pair and layer, training
    head_weights = cfg.vocab_size * cfg.d_model + (cfg.d_model**2 if cfg.lm_head == "bert_mlm" else 0)
    if cfg.arch == "encoder":
        S = seq_len
        return TrainFlops(
            seq_len=S,
            decoder_seq_len=None,
            encoder_dense=6 * cfg.n_layers * layer_weights * S,
            encoder_attention=cfg.n_layers * score_flops * S * S,
            lm_head=6 * head_weights * S,
        )
    if cfg.arch == "decoder":
        T = seq_len
        return TrainFlops(
            seq_len=T,
            decoder_seq_len=None,
            decoder_dense=6 * cfg.n_layers * layer_weights * T,
            decoder_attention=cfg.n_layers * score_flops * T * T,
            lm_head=6 * head_weights * T,
        )
    S = seq_len
    T = seq_len if decoder_seq_len is None else decoder_seq_len
    if T <= 0:
        raise ConfigError(f"decoder_seq_len={decoder_seq_len} must be positive")
    L_dec = cfg.decoder_layers
    return TrainFlops(
        seq_len=S,
        decoder_seq_len=T,
        encoder_dense=6 * cfg.n_layers * layer_weights * S,
        encoder_attention=cfg.n_layers * score_flops * S * S,
        decoder_dense=6 * L_dec * (layer_weights + qo) * T,  # cross-attention queries and output per target token
        decoder_attention=L_dec * score_flops * T * T,
        cross_kv_projection=6 * L_dec * kv * S,  # cross-attention keys and values per source token
        cross_attention=L_dec * score_flops * T * S,
        lm_head=6 * head_weights * T,
    )


def train_flops_per_token(cfg: TransformerConfig, seq_len: int, decoder_seq_len: int | None = None) -> float:
    """Training FLOPs per token of `seq_len` (for encoder-decoder: per source token, the
    decoder's `decoder_seq_len` targets amortised in); 6N + 12*L*H*D*T for a decoder."""
    return train_flops(cfg, seq_len, decoder_seq_len).per_token


# ----------------------------------------------------------------------------- KV cache


def kv_cache_bytes_per_token(cfg: TransformerConfig, dtype_bytes: int = 2) -> int:
    """Self-attention keys and values cached per decoded token (all layers); 0 for encoders."""
    if cfg.arch == "encoder":
        return 0
    return 2 * cfg.decoder_layers * cfg.kv_heads * cfg.dim_per_head * dtype_bytes


def cross_kv_cache_bytes_per_source_token(cfg: TransformerConfig, dtype_bytes: int = 2) -> int:
    """Cross-attention keys and values cached per encoder token (encoder-decoder only, else 0)."""
    if cfg.arch != "encoder_decoder":
        return 0
    return 2 * cfg.decoder_layers * cfg.kv_heads * cfg.dim_per_head * dtype_bytes
