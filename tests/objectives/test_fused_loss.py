"""The fused LM-head projection + cross-entropy (objectives/fused_loss.py) against the plain
logits path it replaces: values, gradients (tied weights included), autocast, and what it keeps
for backward. Odd sizes (vocabulary 99, 37 rows) so a transposed axis fails."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_config

from lit_transformer.model import TransformerConfig
from lit_transformer.objectives import CausalLM, Seq2SeqLM, fused_loss
from lit_transformer.objectives.fused_loss import linear_cross_entropy
from lit_transformer.objectives.metrics import IGNORE_INDEX, token_cross_entropy

N, C, V = 37, 24, 99


def plain(x, w, b, labels, eps):
    logits = F.linear(x, w, b)
    loss, nll, count = token_cross_entropy(logits, labels, eps)
    correct = ((logits.argmax(-1) == labels) & (labels != IGNORE_INDEX)).sum()
    return loss, nll, count, correct


def leaves(bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=g).requires_grad_()
    w = (torch.randn(V, C, generator=g) * 0.3).requires_grad_()
    b = torch.randn(V, generator=g).requires_grad_() if bias else None
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::4] = IGNORE_INDEX
    return x, w, b, labels


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunk_rows", [1, 8, 1000])
@pytest.mark.parametrize("piece_rows", [3, None])
@pytest.mark.parametrize("vocab_multiple", [1, 64])
def test_equals_the_plain_path_in_float32(eps, bias, chunk_rows, piece_rows, vocab_multiple, monkeypatch):
    if piece_rows is not None:  # float32 pieces of 3 rows, uneven in chunks of 8 and 1000
        monkeypatch.setattr(fused_loss, "PIECE_BYTES", 4 * V * piece_rows)
    # the products over a vocabulary padded to 128 with zero rows (CUDA's path) change nothing
    monkeypatch.setattr(fused_loss, "VOCAB_MULTIPLE", {"cpu": vocab_multiple})
    results = []
    for fn in (plain, lambda *a: linear_cross_entropy(*a, chunk_rows=chunk_rows)):
        x, w, b, labels = leaves(bias)
        loss, nll, count, correct = fn(x, w, b, labels, eps)
        (3.0 * loss).backward()  # an upstream gradient other than 1 must scale every gradient
        grads = [t.grad for t in (x, w, b) if t is not None]
        results.append((loss.detach(), nll, count, correct, grads))
    (loss, nll, count, correct, grads), (loss_ref, nll_ref, count_ref, correct_ref, grads_ref) = results[1], results[0]
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(nll, nll_ref, rtol=1e-6, atol=1e-4)
    assert int(count) == int(count_ref) == N - len(range(0, N, 4)) and int(correct) == int(correct_ref)
    assert not nll.requires_grad
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("piece_rows", [3, None])
@pytest.mark.parametrize("vocab_multiple", [1, 64])
def test_under_bf16_autocast_it_matches_the_plain_path(piece_rows, vocab_multiple, monkeypatch):
    """Logits in bf16 by the same kernel, softmax in float32: the loss is identical, the
    gradients differ only by bf16 rounding (the weight's is summed per chunk)."""
    if piece_rows is not None:
        monkeypatch.setattr(fused_loss, "PIECE_BYTES", 4 * V * piece_rows)
    monkeypatch.setattr(fused_loss, "VOCAB_MULTIPLE", {"cpu": vocab_multiple})
    out = []
    for fn in (plain, lambda *a: linear_cross_entropy(*a, chunk_rows=8)):
        x, w, b, labels = leaves(True, seed=1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(x, w, b, labels, 0.1)[0]
        loss.backward()
        out.append((loss.detach(), [t.grad for t in (x, w, b)]))
    (loss, grads), (loss_ref, grads_ref) = out[1], out[0]
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-3)
    for got, want in zip(grads, grads_ref):
        assert got.dtype == want.dtype == torch.float32
        assert (got - want).norm() / want.norm() < 1e-2


def tiny(arch: str) -> TransformerConfig:
    extra = (
        dict(
            position="t5_relative",
            relative_buckets=8,
            relative_max_distance=16,
            norm="rmsnorm",
            scale_decoder_output=True,
        )
        if arch == "encoder_decoder"
        else dict(position="learned")
    )
    return tiny_config(
        arch, vocab_size=V, d_model=C, max_seq_len=80, dropout=0.0, attention_dropout=0.0, tie_embeddings=True, **extra
    )


def batch_for(arch: str, length: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(4, V, (4, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, length // 2 :] = 0
    labels = torch.randint(4, V, (4, length), generator=g).masked_fill(mask == 0, IGNORE_INDEX)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if arch == "encoder_decoder":
        batch["decoder_input_ids"] = torch.randint(4, V, (4, 9), generator=g)
        batch["labels"] = torch.randint(4, V, (4, 9), generator=g)
        batch["labels"][2, 6:] = IGNORE_INDEX
    return batch


OBJECTIVES = {"decoder": CausalLM, "encoder_decoder": Seq2SeqLM}


@pytest.mark.parametrize("arch", list(OBJECTIVES))
def test_objectives_train_fused_with_the_plain_loss_and_gradients(arch, monkeypatch):
    """CausalLM and Seq2SeqLM (tied embeddings; T5's output scale) take the fused path in
    training: the loss and every parameter's gradient equal the plain path's, and autograd
    keeps no (N, V) tensor for backward (the plain path keeps logits and their float copies)."""
    torch.manual_seed(0)
    module = OBJECTIVES[arch](tiny(arch), skip_nonfinite=False)
    batch = batch_for(arch)
    assert module.fuse_head_and_loss()
    with torch.no_grad():
        assert not module.fuse_head_and_loss()  # evaluation: the plain path

    def run(fused: bool):
        monkeypatch.setattr(type(module), "fuse_head_and_loss", lambda self: fused)
        module.zero_grad(set_to_none=True)
        saved = []

        def pack(t):
            saved.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = module.training_step(batch, 0)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}, saved

    loss, grads, saved = run(True)
    loss_ref, grads_ref, saved_ref = run(False)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-6)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-4, atol=1e-6, msg=name)
    rows = batch["labels"].numel()

    def logit_sized(shapes):  # tensors of one vocabulary row per label position (or more)
        return [s for s in shapes if s and s[-1] == V and torch.Size(s).numel() >= rows * V]

    assert logit_sized(saved_ref) and not logit_sized(saved), logit_sized(saved)
