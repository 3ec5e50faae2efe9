"""The training objectives: losses against references, schedules against hand-computed
formulas, optimizer groups, metric arithmetic, the non-finite guard, and each objective
overfitting a fixed batch (MaskedLM through a real Lightning Trainer)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_config
from torch.utils.data import DataLoader

from lit_transformer.model import LanguageModel, TransformerConfig
from lit_transformer.model.accounting import train_flops
from lit_transformer.objectives import (
    CausalLM,
    MaskedLM,
    OptimConfig,
    Seq2SeqLM,
    SequenceClassifier,
    bits_per_byte,
    evaluate_batches,
    lr_multiplier,
    make_scheduler,
    parameter_groups,
    token_cross_entropy,
)
from lit_transformer.objectives.metrics import CorpusBLEU

B, T, V = 3, 7, 99


@pytest.fixture(autouse=True)
def _seeded_and_quiet(one_thread):
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*GPU available but not used.*")


def tiny(arch: str, **overrides) -> TransformerConfig:
    return tiny_config(arch, **{"d_model": 30, "d_ff": 44, **overrides})


def fast_optim(lr: float = 1e-2, **overrides) -> OptimConfig:
    values = dict(lr=lr, weight_decay=0.0, schedule="constant", warmup_steps=0)
    values.update(overrides)
    return OptimConfig(**values)


def mlm_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(4, V, (B, T))
    labels = torch.full((B, T), -100)
    labels[:, 1::3] = ids[:, 1::3]  # the "masked" positions: 2 per row
    labels[2, 5] = ids[2, 5]  # an uneven count per row
    inputs = ids.clone()
    inputs[labels != -100] = 3  # [MASK]
    return {
        "input_ids": inputs,
        "attention_mask": torch.ones(B, T, dtype=torch.long),
        "labels": labels,
        "token_type_ids": torch.zeros(B, T, dtype=torch.long),
    }


def clm_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(4, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[2, 5:] = 0  # a right-padded row
    ids[2, 5:] = 0
    labels = torch.full((B, T), -100)
    labels[:, :-1] = ids[:, 1:]
    labels[2, 4:] = -100  # no target after the last real token
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def seq2seq_batch(eos: int = 1, pad: int = 0) -> dict[str, torch.Tensor]:
    source = torch.randint(4, V, (B, T))
    source_mask = torch.ones(B, T, dtype=torch.long)
    source_mask[1, 6:] = 0
    lengths = [4, 5, 3]  # target tokens before eos
    T_dec = max(lengths) + 1
    labels = torch.full((B, T_dec), -100)
    for row, n in enumerate(lengths):
        labels[row, :n] = torch.randint(4, V, (n,))
        labels[row, n] = eos
    decoder_input_ids = torch.full((B, T_dec), pad)
    decoder_input_ids[:, 1:] = labels[:, :-1].clamp(min=pad)  # start token (pad, as T5), then labels shifted right
    decoder_input_ids[decoder_input_ids == -100] = pad
    decoder_mask = torch.zeros(B, T_dec, dtype=torch.long)
    for row, n in enumerate(lengths):
        decoder_mask[row, : n + 1] = 1
    return {
        "input_ids": source,
        "attention_mask": source_mask,
        "decoder_input_ids": decoder_input_ids,
        "decoder_attention_mask": decoder_mask,
        "labels": labels,
    }


def manual_fit(module, batch, steps: int, lr: float) -> tuple[float, float]:
    """Plain loop over training_step; returns (first loss, last loss)."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.0)
    module.train()
    first = last = None
    for step in range(steps):
        loss = module.training_step(batch, step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        first = float(loss.detach()) if first is None else first
        last = float(loss.detach())
    return first, last


def trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def repeat(batch, n: int) -> DataLoader:
    return DataLoader([batch] * n, batch_size=None)


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


# ----------------------------------------------------------------------------- losses and metrics


def test_label_smoothing_matches_torch_reference():
    logits = torch.randn(B * T, V, requires_grad=True)
    labels = torch.randint(0, V, (B * T,))
    labels[::4] = -100
    loss_sum, nll_sum, count = token_cross_entropy(logits, labels, 0.1)
    reference = F.cross_entropy(logits, labels, ignore_index=-100, label_smoothing=0.1)
    assert int(count) == int((labels != -100).sum())
    torch.testing.assert_close(loss_sum / count, reference)
    torch.testing.assert_close(nll_sum / count, F.cross_entropy(logits, labels, ignore_index=-100).detach())
    (grad,) = torch.autograd.grad(loss_sum / count, logits)
    (reference_grad,) = torch.autograd.grad(reference, logits)
    torch.testing.assert_close(grad, reference_grad)


def test_bits_per_byte_arithmetic():
    assert bits_per_byte(2 * math.log(2), 4.0) == pytest.approx(0.5)
    assert bits_per_byte(math.log(256), 1.0) == pytest.approx(8.0)  # uniform over bytes: 8 bits each


def test_validation_loss_is_a_token_average_not_a_mean_of_batch_means():
    module = CausalLM(tiny("decoder"), bytes_per_token=3.5)
    first, second = clm_batch(), clm_batch()
    second["labels"][:, 1:] = -100  # 3 predicted tokens against the first batch's 16
    values = evaluate_batches(module, [first, second])
    with torch.no_grad():
        sums, counts = [], []
        for batch in (first, second):
            logits = module.model(batch["input_ids"], batch["attention_mask"])
            sums.append(F.cross_entropy(logits.reshape(-1, V), batch["labels"].reshape(-1), reduction="sum"))
            counts.append(int((batch["labels"] != -100).sum()))
    token_average = float(sum(sums)) / sum(counts)
    assert values["loss"] == pytest.approx(token_average, rel=1e-5)
    assert values["ppl"] == pytest.approx(math.exp(token_average), rel=1e-5)
    assert values["bpb"] == pytest.approx(token_average / math.log(2) / 3.5, rel=1e-5)
    batch_means = (float(sums[0]) / counts[0] + float(sums[1]) / counts[1]) / 2
    assert abs(batch_means - token_average) > 1e-3  # the distinction is real for these batches


def test_only_a_loss_over_the_text_in_order_reports_bits_per_byte():
    """bpb = loss / ln 2 / bytes per token holds only when the loss covers every token of the
    text, predicted in order: a masked or span loss covers the corrupted tokens alone."""
    causal = evaluate_batches(CausalLM(tiny("decoder"), bytes_per_token=3.5), [clm_batch()])
    masked = evaluate_batches(MaskedLM(tiny("encoder"), bytes_per_token=3.5), [mlm_batch()])
    span = Seq2SeqLM(tiny("encoder_decoder"), task="span", bytes_per_token=3.5)
    spans = evaluate_batches(span, [seq2seq_batch()])
    assert causal["bpb"] == pytest.approx(causal["loss"] / math.log(2) / 3.5)
    assert "bpb" not in masked and "masked_accuracy" in masked
    assert "bpb" not in spans and "token_accuracy" in spans


def test_corpus_bleu_from_summed_statistics_equals_sacrebleu():
    import sacrebleu

    hyps = ["the cat sat on the mat", "a dog runs", "hello there world", "one two three four five"]
    refs = ["the cat is on the mat", "the dog runs fast", "hello world", "one two three four five"]
    metric = CorpusBLEU()
    metric.update(hyps[:1], refs[:1])
    metric.update(hyps[1:], refs[1:])
    assert float(metric.compute()) == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)


def test_peak_flops_table_and_config_errors():
    from lit_transformer.errors import RecipeError
    from lit_transformer.training.throughput import peak_flops_for

    assert peak_flops_for("NVIDIA H100 80GB HBM3", "bf16-mixed") == 989.4e12
    assert peak_flops_for("NVIDIA H100 PCIe", "16-mixed") == 756e12
    assert peak_flops_for("NVIDIA H200", "bf16-true") == 989.4e12
    assert peak_flops_for("NVIDIA A100-SXM4-80GB", "bf16-mixed") == 312e12
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert peak_flops_for("NVIDIA A100-SXM4-80GB", "32-true") == 19.5e12
        torch.set_float32_matmul_precision("high")  # TF32 tensor cores
        assert peak_flops_for("NVIDIA A100-SXM4-80GB", "32-true") == 156e12
    finally:
        torch.set_float32_matmul_precision(precision)
    assert peak_flops_for("Tesla T4", "bf16-mixed") is None
    with pytest.raises(RecipeError, match="warmup_steps"):
        OptimConfig.from_dict({"lr": 1.0, "warmup_step": 3})
    with pytest.raises(RecipeError, match=r"optim\.schedule='cosin' is not one of .*\(did you mean `cosine`\?\)"):
        OptimConfig(schedule="cosin")


def test_masked_head_on_masked_positions_equals_full_logits():
    module = MaskedLM(tiny("encoder", lm_head="bert_mlm", type_vocab_size=2), fast_optim(label_smoothing=0.1))
    batch = mlm_batch()
    masked_loss = module.training_step(batch, 0)
    full = module(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])  # (B, T, V)
    reference = F.cross_entropy(full.reshape(-1, V), batch["labels"].reshape(-1), label_smoothing=0.1)
    torch.testing.assert_close(masked_loss, reference)
    grads = torch.autograd.grad(masked_loss, list(module.parameters()))
    reference_grads = torch.autograd.grad(reference, list(module.parameters()))
    for g, r in zip(grads, reference_grads):
        torch.testing.assert_close(g, r)


# ----------------------------------------------------------------------------- objectives learn


def test_masked_lm_overfits_with_lightning_trainer(tmp_path):
    batch = mlm_batch()
    module = MaskedLM(tiny("encoder", type_vocab_size=2), fast_optim(), max_steps=120, peak_flops=1e12)
    before = evaluate_batches(module, [batch])
    fit = trainer(max_steps=120, log_every_n_steps=10)
    fit.fit(module, train_dataloaders=repeat(batch, 120))
    after = evaluate_batches(module, [batch])
    assert after["loss"] < 0.1 * before["loss"]
    assert after["masked_accuracy"] == 1.0
    metrics = fit.callback_metrics
    for name in (
        "train/loss",
        "train/ppl",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "train/mfu",
        "train/masked_accuracy",
        "train/skipped_steps",
    ):
        assert name in metrics, name
    assert float(metrics["train/lr"]) == pytest.approx(1e-2)
    # MFU counts the body on every token and the LM head only on the masked positions.
    flops = train_flops(module.model_config, T)
    masked = int((batch["labels"] != -100).sum())
    per_batch = (flops.total - flops.lm_head) * B + flops.lm_head / T * masked
    tokens_per_s, mfu = float(metrics["train/tokens_per_s"]), float(metrics["train/mfu"])
    assert mfu * 1e12 / tokens_per_s == pytest.approx(per_batch / (B * T), rel=1e-4)
    # validation through the Trainer logs what evaluate_batches returns
    logged = fit.validate(module, dataloaders=repeat(batch, 2), verbose=False)[0]
    assert logged["val/loss"] == pytest.approx(after["loss"], rel=1e-5)
    assert logged["val/masked_accuracy"] == 1.0
    # the checkpoint rebuilds the module from its plain hyperparameters
    path = tmp_path / "mlm.ckpt"
    fit.save_checkpoint(path)
    restored = MaskedLM.load_from_checkpoint(path)
    assert restored.model_config == module.model_config
    assert evaluate_batches(restored, [batch])["loss"] == pytest.approx(after["loss"], rel=1e-5)


def test_grad_norm_is_logged_before_clipping():
    batch = mlm_batch()
    module = MaskedLM(tiny("encoder"), fast_optim())
    reference = MaskedLM(tiny("encoder"), fast_optim())
    reference.load_state_dict(module.state_dict())
    loss = reference.training_step(batch, 0)
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters() if p.grad is not None]))
    fit = trainer(max_steps=1, log_every_n_steps=1, gradient_clip_val=1e-3)
    fit.fit(module, train_dataloaders=repeat(batch, 1))
    assert float(fit.callback_metrics["train/grad_norm"]) == pytest.approx(float(norm), rel=1e-4)
    assert float(norm) > 1e-2  # far above the clipping threshold


def test_nonfinite_loss_skips_the_step_and_leaves_weights():
    batch = mlm_batch()
    module = MaskedLM(tiny("encoder"), fast_optim(weight_decay=0.1))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    hook = module.model.transformer.register_forward_hook(lambda mod, args, out: out * float("nan"))
    fit = trainer(max_steps=2, log_every_n_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit.fit(module, train_dataloaders=repeat(batch, 2))
    assert module.skipped_steps == 2
    assert float(fit.callback_metrics["train/skipped_steps"]) == 2.0
    for name, value in module.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)
    assert all(not state for state in fit.optimizers[0].state.values())  # no AdamW moments either
    hook.remove()
    module.skipped_steps = 0
    fit = trainer(max_steps=1, log_every_n_steps=1)
    fit.fit(module, train_dataloaders=repeat(batch, 1))
    assert module.skipped_steps == 0
    assert not torch.equal(
        module.state_dict()["model.transformer.tokens.weight"], before["model.transformer.tokens.weight"]
    )


def test_causal_lm_overfits_and_samples():
    batch = clm_batch()
    module = CausalLM(tiny("decoder", position="rope", norm="rmsnorm", activation="swiglu", bias=False), fast_optim())
    first, last = manual_fit(module, batch, 120, 1e-2)
    assert last < 0.1 * first
    values = evaluate_batches(module, [batch])
    assert values["loss"] < 0.1 * first
    prompt = batch["input_ids"][:1, :3]
    out = module.sample(prompt, torch.ones_like(prompt), max_new_tokens=3)
    assert out.shape == (1, 6)
    torch.testing.assert_close(out[0, 3:], batch["input_ids"][0, 3:6])  # it memorised the continuation


def test_seq2seq_overfits_and_scores_bleu():
    batch = seq2seq_batch(eos=1, pad=0)
    module = Seq2SeqLM(
        tiny("encoder_decoder", n_decoder_layers=1, position="sinusoidal", norm_position="post", activation="relu"),
        fast_optim(),
        bleu=True,
        detokenize=lambda ids: " ".join(map(str, ids)),
        generate_kwargs={"max_new_tokens": 8, "eos_token_id": 1, "pad_token_id": 0, "num_beams": 2},
    )
    before = evaluate_batches(module, [batch])
    assert before["bleu"] < 50
    first, last = manual_fit(module, batch, 250, 1e-2)
    assert last < 0.1 * first
    after = evaluate_batches(module, [batch])
    assert after["token_accuracy"] == 1.0
    assert after["bleu"] == pytest.approx(100.0)  # decoding reproduces every memorised target
    assert set(after) == {"loss", "ppl", "token_accuracy", "bleu"}
    with pytest.raises(ValueError, match="num_beams"):
        Seq2SeqLM(tiny("encoder_decoder"), generate_kwargs={"num_beam": 2})


def _separable(problem: str, n: int = 24):
    """Label from token content: class c puts token 10+c at position 1; multi-label j marks
    the presence of token 20+j; the regression target is the count of token 30."""
    ids = torch.randint(40, V, (n, T))
    mask = torch.ones(n, T, dtype=torch.long)
    mask[::3, 5:] = 0  # some right padding
    ids[mask == 0] = 0
    ids[:, 0] = 2  # [CLS]
    if problem == "single_label":
        labels = torch.arange(n) % 3
        ids[:, 1] = 10 + labels
    elif problem == "multi_label":
        labels = (torch.rand(n, 4) > 0.5).float()
        for j in range(4):
            ids[labels[:, j] == 1, 1 + j] = 20 + j
    else:
        counts = torch.arange(n) % 4
        for row, c in enumerate(counts.tolist()):
            ids[row, 1 : 1 + c] = 30
        labels = counts.float()
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize(
    "problem,arch", [("single_label", "encoder"), ("multi_label", "decoder"), ("regression", "encoder_decoder")]
)
def test_classifier_learns_a_separable_problem(problem, arch):
    batch = _separable(problem)
    num_labels = {"single_label": 3, "multi_label": 4, "regression": 1}[problem]
    module = SequenceClassifier(tiny(arch), num_labels, problem, optim=fast_optim(3e-3), classifier_dropout=0.0)
    manual_fit(module, batch, 100, 3e-3)
    values = evaluate_batches(module, [batch])
    if problem == "single_label":
        assert values["accuracy"] == 1.0 and values["macro_f1"] == 1.0
    elif problem == "multi_label":
        assert values["micro_f1"] == 1.0 and values["macro_f1"] == 1.0
    else:
        assert values["mse"] < 0.05 and values["pearson"] > 0.98
    assert values["loss"] < 0.1


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


# ----------------------------------------------------------------------------- FSDP2 hook

_FSDP_SCRIPT = r"""
import json, sys, warnings, torch, lightning as L
from torch.utils.data import DataLoader
from lightning.pytorch.strategies import ModelParallelStrategy
from lit_transformer.model import TransformerConfig
from lit_transformer.objectives import CausalLM, OptimConfig
warnings.filterwarnings("ignore")
torch.set_num_threads(1)
torch.manual_seed(0)
cfg = TransformerConfig(arch="decoder", vocab_size=99, d_model=30, n_heads=3, n_layers=2, d_ff=44, max_seq_len=32)
module = CausalLM(cfg, OptimConfig(lr=1e-2, schedule="constant", warmup_steps=0, weight_decay=0.1))
ids = torch.randint(4, 99, (3, 7)); labels = torch.full((3, 7), -100); labels[:, :-1] = ids[:, 1:]
batch = {"input_ids": ids, "labels": labels}
report = {}

class Probe(L.Callback):
    first = True  # the first batch of the first epoch (a DistributedSampler halves the epoch)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.first:  # after configure_model: the sharded initial weights
            self.initial = {n: p.full_tensor().clone() for n, p in pl_module.named_parameters()}
            self.hook = pl_module.model.transformer.register_forward_hook(
                lambda m, a, out: out * float("nan") if trainer.global_rank == 1 else out)
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.first:
            self.first = False
            self.hook.remove()
            report["unchanged"] = all(torch.equal(p.full_tensor(), self.initial[n])
                                      for n, p in pl_module.named_parameters())
            report["no_moments"] = all(not s for s in trainer.optimizers[0].state.values())

fsdp = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
fit = L.Trainer(accelerator="cpu", devices=2, strategy=fsdp, max_steps=8, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1, callbacks=[Probe()])
fit.fit(module, DataLoader([batch] * 16, batch_size=None))
from torch.distributed.tensor import DTensor
report["sharded"] = isinstance(module.model.transformer.decoder.blocks[0].attn.q.weight, DTensor)
report["tied"] = module.model.lm_head.decoder.weight is module.model.transformer.tokens.weight
report["skipped"] = module.skipped_steps
report["loss"] = float(fit.callback_metrics["train/loss"])
with open(f"report_{fit.global_rank}.json", "w") as f:  # the ranks share stdout: one file each
    json.dump(report, f)
"""


@pytest.mark.distributed
def test_fsdp2_two_processes_skip_a_nonfinite_step_together(tmp_path):
    """configure_model shards every block under ModelParallelStrategy (2 gloo processes); a
    NaN on one rank only makes both ranks skip the same step, with weights and AdamW state
    untouched, and training then proceeds."""
    script = tmp_path / "fsdp_run.py"
    script.write_text(_FSDP_SCRIPT)
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(20000 + os.getpid() % 20000),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"report_{rank}.json").read_text())
        assert report["sharded"] and report["tied"]
        assert report["unchanged"] and report["no_moments"]
        assert report["skipped"] == 1
        assert report["loss"] < 0.75 * math.log(99)  # learning after the skip (chance: ln 99)
