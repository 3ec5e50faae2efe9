"""Parameter, FLOP and KV-cache accounting against the built model, FlopCounterMode and the
real KVCache; the `info` command function."""

from __future__ import annotations

import json
import random
import re
from typing import get_args

import pytest
import torch
from helpers import tiny_config
from torch.utils.flop_counter import FlopCounterMode

from lit_transformer.commands.info import format_info, info, load_model_config
from lit_transformer.errors import RecipeError
from lit_transformer.model import PRESETS, ConfigError, LanguageModel, Transformer, TransformerConfig, preset
from lit_transformer.model.accounting import (
    count_parameters,
    cross_kv_cache_bytes_per_source_token,
    kv_cache_bytes_per_token,
    non_embedding_parameters,
    parameter_breakdown,
    train_flops,
    train_flops_per_token,
)

# Every value of every field that changes which parameters exist or their shapes.
GRID = {
    "arch": ("encoder", "decoder", "encoder_decoder"),
    "position": ("sinusoidal", "learned", "rope", "alibi", "t5_relative", "none"),
    "norm": ("layernorm", "rmsnorm"),
    "norm_position": ("pre", "post"),
    "activation": ("relu", "gelu", "gelu_tanh", "relu2", "swiglu", "geglu", "geglu_tanh"),
    "bias": (True, False),
    "tie_embeddings": (True, False),
    "lm_head": ("linear", "bert_mlm"),
    "type_vocab_size": (0, 3),
    "n_kv_heads": (None, 1, 2, 6),
    "head_dim": (None, 6),  # None: 24 // 6 = 4; 6 decouples heads from d_model (T5)
    "embedding_norm": (False, True),
    "n_decoder_layers": (None, 3),
    "qk_norm": (False, True),  # two (D,) scales per attention module, cross-attention included
}


def small_config(**fields) -> TransformerConfig:
    if fields.get("arch") != "encoder_decoder":
        fields["n_decoder_layers"] = None
    return tiny_config(**{"n_heads": 6, "max_seq_len": 13, "relative_max_distance": 20, **fields})


def grid_configs() -> list[TransformerConfig]:
    """Each value of each field at least once (the others drawn at random), plus random mixes."""
    rng = random.Random(0)
    draws = []
    for field, values in GRID.items():
        for value in values:
            draws.append({**{f: rng.choice(v) for f, v in GRID.items()}, field: value})
    draws += [{f: rng.choice(v) for f, v in GRID.items()} for _ in range(150)]
    return [small_config(**d) for d in draws]


def built_parameters(cfg: TransformerConfig) -> int:
    return sum(p.numel() for p in LanguageModel.from_config(cfg, device="meta").parameters())


def test_grid_covers_every_selector_value():
    # If a Literal grows a value, the grid must grow with it.
    from lit_transformer.model import config as config_module

    for field, literal in [
        ("arch", config_module.Arch),
        ("position", config_module.Position),
        ("norm", config_module.Norm),
        ("norm_position", config_module.NormPosition),
        ("activation", config_module.Activation),
        ("lm_head", config_module.LMHeadKind),
    ]:
        assert set(GRID[field]) == set(get_args(literal)), field


# parameter_breakdown's key of each parameter of the built module, by its name
# (transformer.{encoder,decoder}.blocks.<i>.<module>. ...; tied weights are listed once)
PARTS = [
    (r"transformer\.tokens\.", "embeddings.tokens"),
    (r"transformer\.\w+\.embed\.token_types\.", "embeddings.token_types"),
    (r"transformer\.\w+\.(embed\.positions|relative_bias)\.", "embeddings.positions"),
    (r"transformer\.(\w+)\.blocks\.\d+\.attn\.", r"\1.attention"),
    (r"transformer\.(\w+)\.blocks\.\d+\.cross_attn\.", r"\1.cross_attention"),
    (r"transformer\.(\w+)\.blocks\.\d+\.ffn\.", r"\1.ffn"),
    (r"transformer\.(\w+)\.(blocks\.\d+\.norm\w*|final_norm|embed\.norm)\.", r"\1.norms"),
    (r"lm_head\.(dense|norm)\.", "lm_head.transform"),
    (r"lm_head\.decoder\.weight$", "lm_head.unembedding"),
    (r"lm_head\.decoder\.bias$", "lm_head.bias"),
]


def built_breakdown(cfg: TransformerConfig) -> dict[str, int]:
    """The built module's parameters summed by part, read off their names."""
    parts: dict[str, int] = {}
    for name, p in LanguageModel.from_config(cfg, device="meta").named_parameters():
        keys = [match.expand(key) for pattern, key in PARTS if (match := re.match(pattern, name))]
        assert len(keys) == 1, (name, keys)
        parts[keys[0]] = parts.get(keys[0], 0) + p.numel()
    return parts


def assert_accounting_matches_the_module(cfg: TransformerConfig) -> None:
    built = built_breakdown(cfg)
    assert {k: v for k, v in parameter_breakdown(cfg).items() if v} == built, cfg
    assert count_parameters(cfg) == sum(built.values()), cfg


def test_parameter_count_equals_built_model_on_grid():
    for cfg in grid_configs():
        assert_accounting_matches_the_module(cfg)


@pytest.mark.parametrize("name", list(PRESETS))
def test_parameter_count_equals_built_model_for_presets(name):
    assert_accounting_matches_the_module(preset(name))


@pytest.mark.parametrize(
    "name, attention_modules", [("gpt2-small", 12), ("t5-base", 12 + 2 * 12), ("tinyllama-1.1b", 22)]
)
def test_parameter_count_with_qk_norm_equals_built_model(name, attention_modules):
    cfg = preset(name, qk_norm=True)
    assert count_parameters(cfg) == built_parameters(cfg)
    # a (D,) scale for queries and one for keys in every attention module (T5: cross-attention too)
    assert count_parameters(cfg) - count_parameters(preset(name)) == attention_modules * 2 * cfg.dim_per_head


def test_non_embedding_parameters_are_the_blocks():
    # GPT-2 small: 12 layers of 12*C^2 + 13*C (attention and FFN matrices, biases, 2 LayerNorms)
    # plus the final LayerNorm; nothing vocabulary- or position-sized (Kaplan et al. 2020).
    cfg, C = preset("gpt2-small"), 768
    assert non_embedding_parameters(cfg) == 12 * (12 * C * C + 13 * C) + 2 * C
    untied = cfg.replace(tie_embeddings=False)
    assert count_parameters(untied) == count_parameters(cfg) + 50257 * C
    assert non_embedding_parameters(untied) == non_embedding_parameters(cfg)


# Published sizes: Vaswani et al. 2017 Table 3; Devlin et al. 2019; Radford et al. 2019;
# Raffel et al. 2020; Brown et al. 2020 Table 2.1; TinyLlama; Touvron et al. 2023.
PUBLISHED = {
    "transformer-base": 65e6,
    "transformer-big": 213e6,
    "bert-base": 110e6,
    "gpt2-small": 124e6,
    "t5-base": 220e6,
    "tinyllama-1.1b": 1.1e9,
    "llama2-70b": 70e9,
    "gpt3-175b": 175e9,
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameters_match_published_sizes(name):
    assert count_parameters(preset(name)) == pytest.approx(PUBLISHED[name], rel=0.05)


def test_gpt3_flops_are_dominated_by_6n():
    cfg = preset("gpt3-175b")
    L, C, V, T = 96, 12288, 50257, 2048
    matmul_weights = L * 12 * C * C + V * C  # 4 C^2 attention + 8 C^2 FFN per layer, plus unembedding
    per_token = train_flops_per_token(cfg, T)
    assert per_token == 6 * matmul_weights + 12 * L * C * T  # PaLM appendix B: 6N + 12 L H Q T
    flops = train_flops(cfg, T)
    assert 0.02 < flops.attention / flops.total < 0.035  # 2T/(12C) of the dense part at T=2048
    assert per_token == pytest.approx(6 * 175e9, rel=0.05)  # the Kaplan / Chinchilla C = 6N estimate
    # Attention grows linearly with context: doubling T adds exactly the T=2048 attention term again.
    assert train_flops_per_token(cfg, 2 * T) - per_token == 12 * L * C * T


MEASURED = {
    "gpt2-like": dict(arch="decoder", position="learned", activation="gelu_tanh"),
    "llama-like": dict(
        arch="decoder",
        position="rope",
        norm="rmsnorm",
        activation="swiglu",
        n_kv_heads=2,
        bias=False,
        tie_embeddings=False,
    ),
    "alibi-mqa": dict(arch="decoder", position="alibi", n_kv_heads=1, head_dim=6),
    "bert-like": dict(arch="encoder", norm_position="post", embedding_norm=True, type_vocab_size=2, lm_head="bert_mlm"),
    "t5-like": dict(
        arch="encoder_decoder",
        position="t5_relative",
        norm="rmsnorm",
        bias=False,
        head_dim=6,
        n_decoder_layers=3,
        n_kv_heads=3,
        activation="geglu_tanh",
        tie_embeddings=False,
    ),
    "vaswani-like": dict(arch="encoder_decoder", position="sinusoidal", norm_position="post", activation="relu"),
    # QK-norm and relu2 are elementwise: they add no matrix-product FLOPs
    "speedrun-like": dict(
        arch="encoder_decoder",
        position="rope",
        norm="rmsnorm",
        qk_norm=True,
        activation="relu2",
        bias=False,
        n_kv_heads=2,
    ),
}


@pytest.mark.parametrize("name", list(MEASURED))
def test_train_flops_equal_flop_counter(name):
    """One forward + backward under FlopCounterMode (math attention: CPU SDPA kernels are not
    counted by it) equals the accounting exactly: every matmul, incl. both attention products
    over the full score matrix, forward once and backward twice."""
    torch.manual_seed(0)
    cfg = small_config(attention_impl="math", **MEASURED[name])
    model = LanguageModel.from_config(cfg)
    B, S, T = 3, 11, 7
    ids = torch.randint(0, 99, (B, S))
    kwargs = {"decoder_input_ids": torch.randint(0, 99, (B, T))} if cfg.arch == "encoder_decoder" else {}
    with FlopCounterMode(display=False) as counter:
        model(ids, **kwargs).float().square().mean().backward()
    flops = train_flops(cfg, S, T if cfg.arch == "encoder_decoder" else None)
    assert counter.get_total_flops() == B * flops.total
    assert train_flops_per_token(cfg, S, flops.decoder_seq_len) * B * S == pytest.approx(counter.get_total_flops())


def test_encoder_decoder_flops_terms():
    # The cross-attention terms scale with source and target lengths as documented.
    cfg = preset("t5-base")
    a, b = train_flops(cfg, 512, 114), train_flops(cfg, 512, 228)
    assert b.cross_attention == 2 * a.cross_attention
    assert b.cross_kv_projection == a.cross_kv_projection  # per source token only
    assert b.encoder_dense == a.encoder_dense and b.encoder_attention == a.encoder_attention
    assert b.decoder_attention == 4 * a.decoder_attention
    # By hand, per source token (C = 12 heads x 64 = 768, d_ff = 4C, no gate, tied unembedding):
    # each encoder layer's 4C^2 attention + 8C^2 FFN weights see the S source tokens; each decoder
    # layer's 4C^2 self-attention + 8C^2 FFN + 2C^2 cross-attention query and output weights, and
    # the V x C unembedding, see the T targets; the cross-attention keys and values (2C^2) see S.
    # Score products over every (query, key) pair: 12 L C (S^2 + T^2 + T S).
    L, C, V = 12, 768, 32128

    def by_hand(S: int, T: int) -> float:
        dense = 6 * (L * (12 + 2) * C * C * S + (L * 14 * C * C + V * C) * T)
        return (dense + 12 * L * C * (S * S + T * T + T * S)) / S

    assert a.per_token == pytest.approx(by_hand(512, 114), rel=1e-12)
    assert train_flops_per_token(cfg, 512) == pytest.approx(by_hand(512, 512), rel=1e-12)
    with pytest.raises(ConfigError, match="decoder_seq_len"):
        train_flops(preset("gpt2-small"), 1024, 100)


@pytest.mark.parametrize("name", ["gpt2-like", "llama-like", "alibi-mqa", "bert-like", "t5-like"])
def test_kv_cache_bytes_equal_cache_tensors(name):
    cfg = small_config(**MEASURED[name])
    model = Transformer(cfg)
    B, M = 3, 11
    cache = model.new_cache(B, M, dtype=torch.bfloat16)
    cached = cache.keys.nbytes + cache.values.nbytes
    assert cached == B * M * kv_cache_bytes_per_token(cfg, dtype_bytes=2)
    if cfg.arch == "encoder":
        assert kv_cache_bytes_per_token(cfg) == 0
    if cfg.arch == "encoder_decoder":
        S = 7
        memory = model.encode(torch.randint(0, 99, (B, S)))
        cache = model.new_cache(B, M)  # float32, the model's dtype
        model.decode(torch.randint(0, 99, (B, 1)), memory=memory, cache=cache)
        cross = sum(k.nbytes + v.nbytes for k, v in cache.cross)  # float32 memory
        assert cross == B * S * cross_kv_cache_bytes_per_source_token(cfg, dtype_bytes=4)
    else:
        assert cross_kv_cache_bytes_per_source_token(cfg) == 0


# ----------------------------------------------------------------------------- info


@pytest.mark.parametrize("name", list(PRESETS))
def test_info_for_presets(name):
    d = info(name)
    cfg = preset(name)
    assert d["name"] == name and d["arch"] == cfg.arch
    assert d["parameters"] == count_parameters(cfg)
    assert d["non_embedding_parameters"] == non_embedding_parameters(cfg)
    assert d["seq_len"] == cfg.max_seq_len
    assert d["train_flops_per_token"] == train_flops_per_token(cfg, cfg.max_seq_len, d["decoder_seq_len"])
    assert d["kv_cache_bytes_per_token"] == kv_cache_bytes_per_token(cfg, 2)
    assert TransformerConfig.from_dict(d["config"]) == cfg
    json.dumps(d)  # the --json output
    text = format_info(d)
    assert name in text and f"{d['parameters']:,}" in text


def test_info_for_recipe_with_preset_and_overrides(tmp_path):
    """A recipe is read as every command reads it: the vocabulary is the tokenizer's unless
    model.vocab_size is set, and key=value overrides apply."""
    path = tmp_path / "gpt-tiny.yaml"
    path.write_text(
        "objective:\n  name: clm\nmodel:\n  preset: gpt2-small\n  n_layers: 3\n  d_model: 96\n"
        "  n_heads: 3\n  max_seq_len: 77\ntrainer:\n  max_steps: 5\n"
    )
    d = info(str(path), ["tokenizer.vocab_size=5000", "data.block_size=64"])
    cfg = preset("gpt2-small", n_layers=3, d_model=96, n_heads=3, max_seq_len=77, vocab_size=5000)
    assert d["name"] == "gpt-tiny" and d["preset"] == "gpt2-small"
    assert d["parameters"] == count_parameters(cfg) == built_parameters(cfg)
    assert d["seq_len"] == 77
    assert "gpt-tiny" in format_info(d)


def test_info_for_recipe_without_preset(tmp_path):
    path = tmp_path / "t5ish.yaml"
    path.write_text(
        "objective:\n  name: span\nmodel:\n  arch: encoder_decoder\n  vocab_size: 99\n  d_model: 24\n"
        "  n_heads: 6\n  n_layers: 2\n  d_ff: 37\n  max_seq_len: 13\n  position: t5_relative\n"
    )
    d = info(str(path), decoder_seq_len=5)
    assert d["preset"] is None and d["decoder_seq_len"] == 5
    assert d["cross_kv_cache_bytes_per_source_token"] == 2 * 2 * 6 * 4 * 2


def test_info_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="gpt2-small"):  # the closest preset
        info("gpt2-smal")
    with pytest.raises(RecipeError, match="overrides apply to recipes"):
        info("gpt2-small", ["model.n_layers=3"])
    bad = tmp_path / "bad.yaml"
    head = "objective:\n  name: clm\n"
    bad.write_text(head + "model:\n  preset: gpt2-small\n  n_layer: 3\n")
    with pytest.raises(RecipeError, match=r"bad\.yaml: unknown key model\.n_layer \(did you mean `model\.n_layers`"):
        info(str(bad))
    bad.write_text(head + "model:\n  preset: gpt2-smal\n")
    with pytest.raises(RecipeError, match="did you mean `gpt2-small`"):
        info(str(bad))
    bad.write_text("trainer:\n  max_steps: 3\n")
    with pytest.raises(RecipeError, match="missing value for objective.name"):
        load_model_config(str(bad))
    bad.write_text(head + "model:\n  arch: decoder\n  vocab_size: 99\n")
    with pytest.raises(RecipeError, match="d_model"):
        info(str(bad))
    with pytest.raises(RecipeError, match="no such recipe file"):
        info(str(tmp_path / "missing.yaml"))
