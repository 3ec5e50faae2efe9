"""Properties of the shared core, on odd tiny sizes:
batch 3, length 7, vocabulary 99, so that a transposed axis crashes instead of broadcasting."""

import math

import pytest
import torch
from helpers import assert_causal, seeded_model, tiny_config

from lit_transformer.model import ConfigError, LanguageModel, TransformerConfig, init_weights, preset
from lit_transformer.model.attention import Attention
from lit_transformer.model.positions import alibi_slopes, apply_rope, rope_cos_sin, sinusoidal

B, T, V = 3, 7, 99
POSITIONS = ["sinusoidal", "learned", "rope", "alibi", "t5_relative", "none"]


def tiny(arch="decoder", position="learned", **kw) -> TransformerConfig:
    return tiny_config(arch, position=position, **kw)


def forward(model, ids, mask=None, dec=None, dec_mask=None):
    if model.config.arch == "encoder_decoder":
        return model(ids, mask, decoder_input_ids=dec if dec is not None else ids, decoder_attention_mask=dec_mask)
    return model(ids, mask)


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_causality_by_gradients(position, impl):
    """d output[t] / d embedding[t'] is exactly zero for every t' > t."""
    model = seeded_model(tiny("decoder", position, attention_impl=impl, n_kv_heads=1))
    assert_causal(model, B, T)


@pytest.mark.parametrize("arch", ["encoder", "decoder", "encoder_decoder"])
@pytest.mark.parametrize("position", POSITIONS)
def test_right_padding_does_not_change_unpadded_outputs(arch, position):
    model = seeded_model(tiny(arch, position, type_vocab_size=2 if arch == "encoder" else 0))
    lengths = [T, 4, 2]
    ids = torch.randint(1, V, (B, T))
    mask = torch.zeros(B, T, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    ids = ids.masked_fill(mask == 0, 0)
    batched = forward(model, ids, mask, ids, mask)
    for row, n in enumerate(lengths):
        alone = forward(model, ids[row : row + 1, :n])
        torch.testing.assert_close(batched[row, :n], alone[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("position", ["learned", "rope", "alibi", "sinusoidal"])
def test_left_padding_with_position_ids_matches_unpadded(position):
    """Left-padded prompts (generation) give the same outputs when positions skip the pads."""
    model = seeded_model(tiny("decoder", position))
    ids = torch.randint(1, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :5] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    out = model(ids, mask, position_ids=positions)
    for row in range(B):
        start = int((mask[row] == 0).sum())
        alone = model(ids[row : row + 1, start:])
        torch.testing.assert_close(out[row, start:], alone[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_no_positions_means_permutation_equivariance(norm_position):
    model = seeded_model(tiny("encoder", "none", norm_position=norm_position))
    ids = torch.randint(0, V, (B, T))
    perm = torch.randperm(T)
    torch.testing.assert_close(model(ids)[:, perm], model(ids[:, perm]), atol=1e-5, rtol=1e-5)
    # ...and positions break it: the same check with learned positions must fail.
    positioned = seeded_model(tiny("encoder", "learned"))
    assert not torch.allclose(positioned(ids)[:, perm], positioned(ids[:, perm]), atol=1e-3)


def test_rope_scores_depend_only_on_relative_offset():
    D = 10
    q, k = torch.randn(1, 2, 1, D), torch.randn(1, 2, 1, D)

    def score(m, n):
        cos_q, sin_q = rope_cos_sin(torch.tensor([[m]]), D)
        cos_k, sin_k = rope_cos_sin(torch.tensor([[n]]), D)
        return (apply_rope(q, cos_q, sin_q) * apply_rope(k, cos_k, sin_k)).sum(-1)

    for m, n, shift in [(5, 2, 11), (0, 7, 3), (13, 13, 40)]:
        torch.testing.assert_close(score(m, n), score(m + shift, n + shift), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(score(5, 2), score(5, 3), atol=1e-4)
    # rotation preserves the norm of each head vector
    cos, sin = rope_cos_sin(torch.tensor([[9]]), D)
    torch.testing.assert_close(apply_rope(q, cos, sin).norm(dim=-1), q.norm(dim=-1))


@pytest.mark.parametrize("n_kv_heads", [6, 2, 1])  # MHA, GQA, MQA
@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_attention_heads_equal_an_explicit_reference(n_kv_heads, impl):
    """Query head h attends with key/value head h // (H / K), written out head by head."""
    H, D, C = 6, 4, 26
    torch.manual_seed(0)
    attn = Attention(C, H, n_kv_heads, D, bias=True, dropout=0.0, scale=True, impl=impl)
    x = torch.randn(B, T, C)
    q = attn.q(x).view(B, T, H, D)
    k, v = attn.k(x).view(B, T, n_kv_heads, D), attn.v(x).view(B, T, n_kv_heads, D)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)  # (T, S)
    heads = []
    for h in range(H):
        group = h // (H // n_kv_heads)
        scores = q[:, :, h] @ k[:, :, group].transpose(1, 2) / D**0.5  # (B, T, S)
        heads.append(scores.masked_fill(future, float("-inf")).softmax(-1) @ v[:, :, group])  # (B, T, D)
    expected = attn.o(torch.stack(heads, dim=2).reshape(B, T, H * D))  # (B, T, C)
    torch.testing.assert_close(attn(x, is_causal=True), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_gqa_equals_mha_with_shared_key_value_heads(impl):
    """GQA with K groups is MHA whose key/value heads are copied within each group of H/K heads."""
    H, K, D = 6, 2, 4
    gqa = seeded_model(tiny("decoder", "rope", d_model=24, n_heads=H, n_kv_heads=K, attention_impl=impl))
    mha = seeded_model(tiny("decoder", "rope", d_model=24, n_heads=H, attention_impl=impl))
    state = gqa.state_dict()
    for name, value in list(state.items()):
        if name.endswith(("attn.k.weight", "attn.v.weight", "attn.k.bias", "attn.v.bias")):
            per_head = value.view(K, D, *value.shape[1:])  # (K, D, ...)
            state[name] = per_head.repeat_interleave(H // K, dim=0).reshape(H * D, *value.shape[1:])
    mha.load_state_dict(state)
    ids = torch.randint(0, V, (B, T))
    torch.testing.assert_close(gqa(ids), mha(ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["encoder", "decoder", "encoder_decoder"])
@pytest.mark.parametrize("position", POSITIONS)
def test_sdpa_path_equals_math_path(arch, position):
    cfg = tiny(arch, position, n_heads=4, n_kv_heads=2, d_model=32)
    sdpa, math_path = seeded_model(cfg), seeded_model(cfg.replace(attention_impl="math"))
    ids = torch.randint(1, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 5:] = 0
    torch.testing.assert_close(
        forward(sdpa, ids, mask, ids, mask), forward(math_path, ids, mask, ids, mask), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(forward(sdpa, ids), forward(math_path, ids), atol=1e-5, rtol=1e-5)


def test_sinusoidal_matches_the_paper_formula():
    table = sinusoidal(torch.arange(50)[None], 16)[0]  # (T, C)
    for pos, i in [(0, 0), (3, 2), (49, 7)]:
        angle = pos / 10000 ** (2 * i / 16)
        assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-5)
        assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-5)


def test_alibi_slopes_follow_the_paper():
    assert alibi_slopes(8).tolist() == pytest.approx([2 ** -(i + 1) for i in range(8)])
    twelve = alibi_slopes(12).tolist()
    assert twelve[:8] == pytest.approx([2 ** -(i + 1) for i in range(8)])
    assert twelve[8:] == pytest.approx([2 ** -(0.5 + i) for i in range(4)])


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "swiglu", "geglu", "geglu_tanh"])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_every_block_variant_builds_runs_and_learns(activation, norm):
    cfg = tiny("decoder", "rope", activation=activation, norm=norm, bias=False, tie_embeddings=False)
    model = seeded_model(cfg).train()
    ids = torch.randint(0, V, (B, T))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_tied_head_shares_the_embedding_and_untied_does_not():
    tied = seeded_model(tiny(tie_embeddings=True))
    assert tied.lm_head.decoder.weight is tied.transformer.tokens.weight
    untied = seeded_model(tiny(tie_embeddings=False))
    assert untied.lm_head.decoder.weight is not untied.transformer.tokens.weight


def test_encoder_decoder_stacks_share_the_token_embedding():
    model = seeded_model(tiny("encoder_decoder", "t5_relative", n_decoder_layers=3))
    t = model.transformer
    assert t.encoder.embed.tokens is t.decoder.embed.tokens is t.tokens
    assert len(t.encoder.blocks) == 2 and len(t.decoder.blocks) == 3
    assert t.decoder.blocks[0].cross_attn is not None and t.encoder.blocks[0].cross_attn is None


def test_meta_device_build_then_materialise_and_init():
    cfg = tiny("encoder_decoder", "sinusoidal")
    model = LanguageModel.from_config(cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    init_weights(model, cfg)
    assert model.lm_head.decoder.weight is model.transformer.tokens.weight, "to_empty untied the LM head"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    weight = model.transformer.encoder.blocks[0].ffn.up.weight
    assert abs(weight.std().item() - cfg.init_std) < 0.005
    out = model(torch.randint(0, V, (B, T)), decoder_input_ids=torch.randint(0, V, (B, 5)))
    assert out.shape == (B, 5, V)


def test_big_presets_build_on_meta_with_published_sizes():
    expected = {
        "transformer-base": 65e6,
        "transformer-big": 213e6,
        "bert-base": 110e6,
        "gpt2-small": 124e6,
        "t5-base": 220e6,
        "gpt3-175b": 175e9,
    }
    for name, published in expected.items():
        model = LanguageModel.from_config(preset(name), device="meta")
        n = sum(p.numel() for p in model.parameters())
        assert abs(n - published) / published < 0.05, (name, n)


def test_learned_positions_past_the_table_fail_clearly():
    model = seeded_model(tiny(max_seq_len=8))
    with pytest.raises(ValueError, match="max_seq_len=8"):
        model(torch.randint(0, V, (1, 9)))


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(d_model=25), "d_model=25 is not divisible by model.n_heads=3"),
        (dict(n_heads=3, n_kv_heads=2), "n_heads=3 is not divisible by model.n_kv_heads=2"),
        (dict(dropout=1.0), r"dropout=1.0 is outside \[0, 1\)"),
        (dict(attention_dropout=-0.1), "attention_dropout=-0.1 is outside"),
        (dict(position="sinusiodal"), r"did you mean `sinusoidal`"),
        (dict(n_layers=0), "n_layers=0 must be a positive integer"),
        (dict(position="rope", head_dim=5), "even head dimension"),
        (dict(arch="decoder", n_decoder_layers=2), "only for arch=encoder_decoder"),
    ],
)
def test_impossible_configs_fail_with_the_values_named(changes, message):
    with pytest.raises(ConfigError, match=message):
        tiny().replace(**changes)


def test_unknown_keys_and_presets_name_the_closest_valid_one():
    with pytest.raises(ConfigError, match=r"unknown key model.n_head \(did you mean `n_heads`\?\)"):
        tiny().replace(n_head=4)
    with pytest.raises(ConfigError, match=r"unknown key model.d_modle"):
        TransformerConfig.from_dict({**tiny().to_dict(), "d_modle": 3})
    with pytest.raises(ConfigError, match=r"did you mean `gpt2-small`"):
        preset("gpt2-smal")
    assert TransformerConfig.from_dict(tiny().to_dict()) == tiny()
