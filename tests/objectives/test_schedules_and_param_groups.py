"""Learning-rate schedules against hand-computed formulas (the 2017 paper's inverse square root,
cosine, linear, WSD), and the optimizer's parameter groups: which tensors decay, and the
classifier's backbone and layer-wise learning rates."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from helpers import fast_optim
from helpers import tiny_objective_config as tiny

from lit_transformer.model import LanguageModel
from lit_transformer.objectives import (
    MaskedLM,
    OptimConfig,
    Seq2SeqLM,
    SequenceClassifier,
    lr_multiplier,
    make_scheduler,
    parameter_groups,
)


@pytest.fixture(autouse=True)
def _seeded_and_quiet(one_thread):
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*GPU available but not used.*")


# ----------------------------------------------------------------------------- schedules


def test_inverse_sqrt_matches_the_2017_formula():
    optim = OptimConfig(lr=1.0, schedule="inverse_sqrt", warmup_steps=4000)
    d = 512

    def paper(step_num):
        return d**-0.5 * min(step_num**-0.5, step_num * 4000**-1.5)

    assert lr_multiplier(0, optim, d_model=d) == pytest.approx(d**-0.5 * 4000**-1.5)  # finite, non-zero
    for step_num in (1, 100, 3999, 4000, 4001, 16000, 100000):
        assert lr_multiplier(step_num - 1, optim, d_model=d) == pytest.approx(paper(step_num), rel=1e-12)
    values = [lr_multiplier(i, optim, d_model=d) for i in range(0, 20000, 7)] + [lr_multiplier(3999, optim, d_model=d)]
    assert max(values) == pytest.approx((d * 4000) ** -0.5)  # the peak at step_num = warmup
    assert lr_multiplier(3999, optim, d_model=d) == pytest.approx((d * 4000) ** -0.5)


def test_cosine_linear_constant_with_warmup():
    cos = OptimConfig(lr=1.0, schedule="cosine", warmup_steps=10, min_lr_ratio=0.1)
    lin = OptimConfig(lr=1.0, schedule="linear", warmup_steps=10, min_lr_ratio=0.1)
    const = OptimConfig(lr=1.0, schedule="constant", warmup_steps=10)
    for optim in (cos, lin, const):
        assert lr_multiplier(0, optim, 110) == pytest.approx(0.1)  # step_num 1 of 10
        assert lr_multiplier(4, optim, 110) == pytest.approx(0.5)
        assert lr_multiplier(9, optim, 110) == pytest.approx(1.0)  # the peak at step_num = warmup
    assert lr_multiplier(59, cos, 110) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_multiplier(34, cos, 110) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert lr_multiplier(59, lin, 110) == pytest.approx(0.1 + 0.9 * 0.5)
    for optim in (cos, lin):
        assert lr_multiplier(109, optim, 110) == pytest.approx(0.1)  # the last step ends at the floor
        assert lr_multiplier(500, optim, 110) == pytest.approx(0.1)
    assert lr_multiplier(500, const, 110) == 1.0


def test_wsd_holds_the_peak_then_cools_down_as_one_minus_sqrt():
    """Warmup 10, then 100 decay steps: the peak until the last 20% (step_num 90), then
    floor + (1 - floor)(1 - sqrt(t)) over the cooldown's fraction t; by time, the same shape
    over max_time with warmup's ramp beneath it."""
    wsd = OptimConfig(lr=1.0, schedule="wsd", warmup_steps=10, min_lr_ratio=0.1, cooldown_fraction=0.2)
    assert lr_multiplier(4, wsd, 110) == pytest.approx(0.5)
    assert [lr_multiplier(i, wsd, 110) for i in (9, 50, 89)] == [1.0, 1.0, 1.0]
    assert lr_multiplier(94, wsd, 110) == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(0.25)))  # 5 of 20 cooldown steps
    assert lr_multiplier(109, wsd, 110) == pytest.approx(0.1)
    assert lr_multiplier(500, wsd, 110) == pytest.approx(0.1)
    by_time = [lr_multiplier(100, wsd, elapsed=t, max_time=60.0) for t in (0.0, 47.9, 54.0, 60.0, 90.0)]
    assert by_time == pytest.approx([1.0, 1.0, 0.1 + 0.9 * (1 - math.sqrt(0.5)), 0.1, 0.1])
    with pytest.raises(ValueError, match="cooldown_fraction"):
        OptimConfig(schedule="wsd", cooldown_fraction=0.0)


def test_scheduler_drives_the_optimizer_lr_per_step():
    optim = OptimConfig(lr=3e-3, schedule="cosine", warmup_steps=3, min_lr_ratio=0.2)
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW(
        [{"params": [param]}, {"params": [torch.nn.Parameter(torch.ones(1))], "lr": 1e-3}], lr=optim.lr
    )
    scheduler = make_scheduler(optimizer, optim, max_steps=13)
    for step in range(15):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * lr_multiplier(step, optim, 13))
        assert optimizer.param_groups[1]["lr"] == pytest.approx(1e-3 * lr_multiplier(step, optim, 13))
        optimizer.step()
        scheduler.step()
    with pytest.raises(ValueError, match="max_steps"):
        make_scheduler(optimizer, optim, max_steps=None)


# ----------------------------------------------------------------------------- optimizer groups


def test_decay_groups_bert_style_tied():
    module = MaskedLM(tiny("encoder", type_vocab_size=2, embedding_norm=True, lm_head="bert_mlm", norm_position="post"))
    groups = parameter_groups(module, 0.1)
    decay = {n for g in groups if g["weight_decay"] > 0 for n in g["names"]}
    no_decay = {n for g in groups if g["weight_decay"] == 0 for n in g["names"]}
    block = "model.transformer.encoder.blocks.{}."
    expected_decay = {
        block.format(i) + f"{part}.weight"
        for i in range(2)
        for part in ("attn.q", "attn.k", "attn.v", "attn.o", "ffn.up", "ffn.down")
    }
    expected_decay.add("model.lm_head.dense.weight")
    assert decay == expected_decay
    expected_no_decay = {
        block.format(i) + f"{part}.{kind}"
        for i in range(2)
        for kind in ("weight", "bias")
        for part in ("norm1", "norm2")
    }
    expected_no_decay |= {
        block.format(i) + f"{part}.bias"
        for i in range(2)
        for part in ("attn.q", "attn.k", "attn.v", "attn.o", "ffn.up", "ffn.down")
    }
    expected_no_decay |= {
        "model.transformer.tokens.weight",  # tied to the LM head's decoder: once, as an embedding
        "model.transformer.encoder.embed.token_types.weight",
        "model.transformer.encoder.embed.positions.weight",
        "model.transformer.encoder.embed.norm.weight",
        "model.transformer.encoder.embed.norm.bias",
        "model.lm_head.dense.bias",
        "model.lm_head.norm.weight",
        "model.lm_head.norm.bias",
        "model.lm_head.decoder.bias",
    }
    assert no_decay == expected_no_decay
    assert sum(len(g["params"]) for g in groups) == len(list(module.parameters()))  # each tensor once


def test_decay_groups_untied_t5_style():
    module = Seq2SeqLM(
        tiny(
            "encoder_decoder",
            position="t5_relative",
            norm="rmsnorm",
            bias=False,
            tie_embeddings=False,
            n_decoder_layers=1,
        )
    )
    groups = parameter_groups(module, 0.1)
    decay = {n for g in groups if g["weight_decay"] > 0 for n in g["names"]}
    no_decay = {n for g in groups if g["weight_decay"] == 0 for n in g["names"]}
    assert "model.lm_head.decoder.weight" in decay  # an untied head is a Linear matrix
    assert "model.transformer.encoder.relative_bias.embedding.weight" in no_decay
    assert "model.transformer.decoder.blocks.0.cross_attn.k.weight" in decay
    assert all(n.endswith(".weight") and "norm" not in n for n in decay)
    assert {n for n in no_decay if "norm" not in n} == {
        "model.transformer.tokens.weight",
        "model.transformer.encoder.relative_bias.embedding.weight",
        "model.transformer.decoder.relative_bias.embedding.weight",
    }


def test_classifier_from_backbone_keeps_weights_and_scales_backbone_lr():
    lm = LanguageModel.from_config(tiny("encoder"))
    clf = SequenceClassifier.from_backbone(lm.transformer, 3, optim=fast_optim(), backbone_lr_ratio=0.1)
    assert clf.backbone is lm.transformer
    optimizer = clf.configure_optimizers()["optimizer"]
    for group in optimizer.param_groups:
        expected = 1e-3 if all(n.startswith("backbone.") for n in group["names"]) else 1e-2
        assert all(n.startswith("backbone.") == (expected == 1e-3) for n in group["names"])
        assert group["lr"] == pytest.approx(expected)
    enc_dec = LanguageModel.from_config(tiny("encoder_decoder"))
    clf = SequenceClassifier.from_backbone(enc_dec.transformer, 2)
    assert not any(n.startswith("backbone.decoder") for n, _ in clf.named_parameters())


@pytest.mark.parametrize("arch", ["encoder", "decoder", "encoder_decoder"])
def test_classifier_layer_lr_decay_scales_each_block_by_depth(arch):
    """ELECTRA's layer-wise decay: block i of L at ratio x decay^(L - i), the embeddings at
    ratio x decay^(L + 1), the final norm at ratio, the head at the full lr."""
    cfg = tiny(arch, n_layers=3)
    clf = SequenceClassifier(cfg, 2, optim=fast_optim(), backbone_lr_ratio=0.5, layer_lr_decay=0.8)
    stack = "decoder" if arch == "decoder" else "encoder"
    lrs = {n: g["lr"] for g in clf.configure_optimizers()["optimizer"].param_groups for n in g["names"]}
    for name, lr in lrs.items():
        if name.startswith(f"backbone.{stack}.blocks."):
            depth = int(name.split(".")[3])
            expected = 1e-2 * 0.5 * 0.8 ** (3 - depth)
        elif name.startswith(("backbone.tokens.", f"backbone.{stack}.embed.")):
            expected = 1e-2 * 0.5 * 0.8**4
        elif name.startswith("backbone."):
            expected = 1e-2 * 0.5
        else:
            expected = 1e-2
        assert lr == pytest.approx(expected), name
    assert lrs[f"backbone.{stack}.blocks.2.ffn.up.weight"] > lrs[f"backbone.{stack}.blocks.0.ffn.up.weight"]
    with pytest.raises(ValueError, match="layer_lr_decay=1.5"):
        SequenceClassifier(cfg, 2, layer_lr_decay=1.5)
