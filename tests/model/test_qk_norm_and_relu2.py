"""Model options from the speedrun work: QK-norm and the squared-ReLU feed-forward.

Odd tiny sizes (batch 3, length 7, vocabulary 99) so that a transposed axis crashes instead
of broadcasting. init_std is raised for the generation tests so that greedy paths vary.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_causal, seeded_model, tiny_config

from lit_transformer.model import LanguageModel
from lit_transformer.model import attention as attention_module
from lit_transformer.model.accounting import count_parameters, parameter_breakdown
from lit_transformer.model.attention import Attention
from lit_transformer.model.generate import StepDecoder, generate
from lit_transformer.model.interop.directories import InteropError, export_hf
from lit_transformer.model.layers import FeedForward
from lit_transformer.model.positions import rope_cos_sin

B, T, V = 3, 7, 99

pytestmark = pytest.mark.usefixtures("one_thread")


def capture_attend(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Record the (q, k) that every Attention call hands to the attention kernel."""
    seen, original = [], attention_module.attend

    def spy(q, k, v, bias, **kwargs):
        seen.append((q.detach(), k.detach()))
        return original(q, k, v, bias, **kwargs)

    monkeypatch.setattr(attention_module, "attend", spy)
    return seen


# ----------------------------------------------------------------------------- QK-norm


def per_head_rms(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).mean(-1).sqrt()  # (B, H, T): over the head dimension D only


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_qk_norm_gives_queries_and_keys_unit_rms_per_head(monkeypatch, impl):
    # 3 query heads, 1 kv head, head_dim 6 decoupled from d_model 21: a norm over H*D or over
    # the wrong axis would not give unit RMS per (head, position).
    C, H, K, D = 21, 3, 1, 6
    torch.manual_seed(0)
    x, memory = torch.randn(B, T, C) * 3, torch.randn(B, 5, C) * 3
    rope = rope_cos_sin(torch.arange(T).expand(B, T), D, 10000.0)
    seen = capture_attend(monkeypatch)
    plain = Attention(C, H, K, D, bias=True, dropout=0.0, scale=True, impl=impl)
    normed = Attention(C, H, K, D, bias=True, dropout=0.0, scale=True, impl=impl, qk_norm=True, norm_eps=1e-6)
    normed.load_state_dict(plain.state_dict(), strict=False)  # same projections; the scales stay at 1
    with torch.no_grad():
        plain(x, rope=rope)
        plain(x, memory=memory)
        out_self = normed(x, rope=rope)  # self-attention, RoPE after the norm keeps the RMS
        out_cross = normed(x, memory=memory)  # cross-attention
    (pq, pk), _, (q, k), (cq, ck) = seen
    assert q.shape == (B, H, T, D) and k.shape == (B, K, T, D) and ck.shape == (B, K, 5, D)
    for t in (q, k, cq, ck):
        torch.testing.assert_close(per_head_rms(t), torch.ones(t.shape[:-1]), atol=1e-4, rtol=0)
    assert (per_head_rms(pq) - 1).abs().max() > 0.1 and (per_head_rms(pk) - 1).abs().max() > 0.1
    assert out_self.shape == out_cross.shape == (B, T, C)
    # The learned (D,) scale multiplies every head's normalised features.
    seen.clear()
    scale = torch.linspace(0.5, 2.0, D)
    with torch.no_grad():
        normed.q_norm.weight.copy_(scale)
        normed.k_norm.weight.copy_(2 * scale)
        normed(x)
    q, k = seen[0]
    torch.testing.assert_close(per_head_rms(q / scale), torch.ones(B, H, T), atol=1e-4, rtol=0)
    torch.testing.assert_close(per_head_rms(k / (2 * scale)), torch.ones(B, K, T), atol=1e-4, rtol=0)


def test_qk_norm_keeps_the_autocast_dtype(monkeypatch):
    # The float32 scale must not promote bf16 queries and keys (attention._normed).
    model = seeded_model(tiny_config("encoder_decoder", position="rope", norm="rmsnorm", qk_norm=True))
    seen = capture_attend(monkeypatch)
    ids = torch.randint(0, V, (B, T))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids, decoder_input_ids=ids[:, :5]).float().sum().backward()
    assert len(seen) == 3 * 2  # encoder, decoder self- and cross-attention, 2 layers each
    assert all(q.dtype == k.dtype == torch.bfloat16 for q, k in seen)


@pytest.mark.parametrize(
    "arch, position", [("decoder", "rope"), ("encoder", "learned"), ("encoder_decoder", "t5_relative")]
)
def test_qk_norm_changes_outputs_with_the_same_weights(arch, position):
    cfg = tiny_config(arch, position=position, init_std=0.2)
    plain = seeded_model(cfg)
    normed = LanguageModel(cfg.replace(qk_norm=True)).eval()
    missing, unexpected = normed.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all(name.endswith(("q_norm.weight", "k_norm.weight")) for name in missing)
    n_attention = cfg.n_layers * (3 if arch == "encoder_decoder" else 1)  # enc-dec: encoder, decoder self + cross
    assert len(missing) == 2 * n_attention
    ids = torch.randint(0, V, (B, T))
    dec = {"decoder_input_ids": ids[:, :5]} if arch == "encoder_decoder" else {}
    with torch.no_grad():
        a, b = plain(ids, **dec), normed(ids, **dec)
    assert a.shape == b.shape
    assert (a - b).abs().max() > 1e-2
    assert torch.isfinite(b).all()


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_qk_norm_keeps_causality(impl):
    """d output[t] / d embedding[t'] is exactly zero for every t' > t."""
    model = seeded_model(tiny_config("decoder", position="rope", qk_norm=True, attention_impl=impl, n_kv_heads=1))
    assert_causal(model, B, T)


QK_GENERATION = {
    "rope_gqa": dict(arch="decoder", position="rope", n_kv_heads=1),
    "learned_window": dict(arch="decoder", position="learned", sliding_window=4),  # the rolling cache
    "t5_cross": dict(arch="encoder_decoder", position="t5_relative", norm="rmsnorm", bias=False),
}


@pytest.mark.parametrize("kind", list(QK_GENERATION))
def test_qk_norm_kv_cache_generation_equals_recomputation(kind):
    model = seeded_model(tiny_config(qk_norm=True, init_std=0.2, **QK_GENERATION[kind]))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 5:], mask[2, 3:] = 0, 0  # right padding: rows of length 7, 5 and 3
    cached = generate(model, ids, mask, max_new_tokens=9, use_cache=True)
    recomputed = generate(model, ids, mask, max_new_tokens=9, use_cache=False)
    assert torch.equal(cached, recomputed)
    # Greedy paths of tiny random models can agree by chance: compare every step's logits too,
    # both decoders fed the same varied continuation.
    continuation = torch.randint(1, V, (B, 9), generator=g)
    with torch.no_grad():
        steps = [StepDecoder(model, ids, mask, max_new_tokens=9, use_cache=use) for use in (True, False)]
        for column in range(continuation.shape[1]):
            with_cache, without = (s.next_logits() for s in steps)
            torch.testing.assert_close(with_cache, without, atol=1e-4, rtol=0)
            for s in steps:
                s.append(continuation[:, column])


# ----------------------------------------------------------------------------- relu2


def test_relu2_feed_forward_is_squared_relu():
    torch.manual_seed(0)
    ffn = FeedForward(21, 37, "relu2", bias=True)
    assert ffn.gate is None  # relu2 is not gated
    x = torch.randn(B, T, 21)
    expected = ffn.down(F.relu(ffn.up(x)) ** 2)
    torch.testing.assert_close(ffn(x), expected, atol=0, rtol=0)
    plain = FeedForward(21, 37, "relu", bias=True)
    plain.load_state_dict(ffn.state_dict())
    assert (plain(x) - ffn(x)).abs().max() > 1e-3
    assert not tiny_config(activation="relu2").gated


def test_relu2_model_trains():
    cfg = tiny_config("decoder", position="rope", activation="relu2", qk_norm=True, bias=False)
    model = seeded_model(cfg).train()
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    qk = [p for name, p in model.named_parameters() if name.endswith("q_norm.weight")]
    assert qk and any((p - 1).abs().max() > 0 for p in qk)  # the scales are trained


# ----------------------------------------------------------------------------- export


@pytest.mark.parametrize(
    "arch, position, field, change",
    [
        ("decoder", "learned", "qk_norm", dict(qk_norm=True)),  # GPT-2 layout otherwise
        ("decoder", "rope", "qk_norm", dict(qk_norm=True, norm="rmsnorm", activation="swiglu", bias=False)),  # LLaMA
        ("decoder", "learned", "activation", dict(activation="relu2")),
        (
            "encoder_decoder",
            "t5_relative",
            "activation",
            dict(activation="relu2", norm="rmsnorm", bias=False, scale_attention=False),
        ),  # T5 otherwise
    ],
)
def test_export_refuses_levers_naming_the_key(tmp_path, arch, position, field, change):
    cfg = tiny_config(arch, position=position, **change)
    with pytest.raises(InteropError, match=rf"model\.{field}=") as error:
        export_hf(LanguageModel(cfg), tmp_path / "out")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()
    without = cfg.replace(qk_norm=False) if field == "qk_norm" else cfg.replace(activation="relu")
    export_hf(LanguageModel(without), tmp_path / "out")  # the same model without the lever exports


# ----------------------------------------------------------------------------- accounting


@pytest.mark.parametrize("arch", ["encoder", "decoder", "encoder_decoder"])
def test_parameter_count_with_qk_norm_equals_the_module(arch):
    decoder_layers = 3 if arch == "encoder_decoder" else None
    cfg = tiny_config(arch, position="rope", qk_norm=True, n_kv_heads=1, head_dim=10, n_decoder_layers=decoder_layers)
    model = LanguageModel(cfg)
    assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())
    scales = sum(p.numel() for name, p in model.named_parameters() if name.endswith(("q_norm.weight", "k_norm.weight")))
    n_attention = {"encoder": 2, "decoder": 2, "encoder_decoder": 2 + 2 * 3}[arch]
    assert scales == n_attention * 2 * 10
    assert count_parameters(cfg) - count_parameters(cfg.replace(qk_norm=False)) == scales
    assert sum(parameter_breakdown(cfg).values()) == count_parameters(cfg)
