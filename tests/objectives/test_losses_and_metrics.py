"""Losses and metrics of the objectives: label smoothing and the masked head against torch's
cross entropy, validation loss as a token average, bits per byte and where it applies, corpus BLEU
against sacrebleu, and the peak-FLOPs table behind MFU."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import B, T, V, clm_batch, fast_optim, mlm_batch, seq2seq_batch
from helpers import tiny_objective_config as tiny

from lit_transformer.objectives import (
    CausalLM,
    MaskedLM,
    OptimConfig,
    Seq2SeqLM,
    bits_per_byte,
    evaluate_batches,
    token_cross_entropy,
)
from lit_transformer.objectives.metrics import CorpusBLEU


@pytest.fixture(autouse=True)
def _seeded_and_quiet(one_thread):
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*GPU available but not used.*")


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
