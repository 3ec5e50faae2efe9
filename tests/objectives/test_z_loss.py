"""PaLM's z-loss (Chowdhery et al. 2022) in both training-loss paths (the fused head and the plain
logits): values and gradients against the definition, training only. Odd sizes (vocabulary 99,
37 rows) so a transposed axis fails."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_config

from lit_transformer.objectives import CausalLM, MaskedLM
from lit_transformer.objectives.fused_loss import linear_cross_entropy
from lit_transformer.objectives.metrics import IGNORE_INDEX, token_cross_entropy
from lit_transformer.recipe.schema import OptimConfig

# ----------------------------------------------------------------------------- z-loss

N, C, V = 37, 24, 99


def leaves(bias: bool, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(V, C, generator=g, dtype=dtype) * 0.3).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=dtype) + 2.0).requires_grad_() if bias else None  # log Z away from 0
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::4] = IGNORE_INDEX
    return x, w, b, labels


def naive(x, w, b, labels, eps, z):
    """The definition in float64: (smoothed) cross-entropy + z * log(Z)^2, summed over kept rows."""
    logits = F.linear(x.double(), w.double(), None if b is None else b.double())
    keep = labels != IGNORE_INDEX
    ce = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum", label_smoothing=eps)
    return ce + z * (torch.logsumexp(logits, -1)[keep] ** 2).sum()


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("fused", [True, False])
def test_z_loss_values_and_gradients_match_the_definition(eps, bias, fused, monkeypatch):
    from lit_transformer.objectives import fused_loss

    monkeypatch.setattr(fused_loss, "PIECE_BYTES", 4 * V * 3)  # float32 pieces of 3 rows in chunks of 8
    z = 0.01  # large enough to matter at these sizes (PaLM used 1e-4)
    grads = {}
    for name, fn in [
        ("ref", lambda *a: naive(*a, eps, z)),
        (
            "got",
            (lambda x, w, b, y: linear_cross_entropy(x, w, b, y, eps, z_loss=z, chunk_rows=8)[0])
            if fused
            else (lambda x, w, b, y: token_cross_entropy(F.linear(x, w, b), y, eps, z)[0]),
        ),
    ]:
        x, w, b, labels = leaves(bias)
        loss = fn(x, w, b, labels)
        (2.0 * loss).backward()
        grads[name] = (loss.detach().double(), [t.grad.double() for t in (x, w, b) if t is not None])
    (loss, got), (loss_ref, want) = grads["got"], grads["ref"]
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-4)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    without = naive(*leaves(bias), eps, 0.0).detach()
    assert float(loss_ref - without) > 0.03 * float(without)  # the z term is not negligible here


def test_z_loss_leaves_the_nll_alone_and_zero_changes_nothing():
    x, w, b, labels = leaves(True)
    logits = F.linear(x, w, b).detach()
    plain = token_cross_entropy(logits, labels)
    for z in (0.0, 1e-4):
        loss, nll, count = token_cross_entropy(logits, labels, 0.0, z)
        assert torch.equal(nll, plain[1]) and int(count) == int(plain[2])
        assert torch.equal(loss, plain[0]) == (z == 0.0)
    fused = linear_cross_entropy(x, w, b, labels, chunk_rows=8)
    fused_zero = linear_cross_entropy(x, w, b, labels, z_loss=0.0, chunk_rows=8)
    fused_z = linear_cross_entropy(x, w, b, labels, z_loss=1e-4, chunk_rows=8)
    for a, b_ in zip(fused, fused_zero):
        assert torch.equal(a, b_)
    assert torch.equal(fused_z[1], fused[1]) and float(fused_z[0].detach()) > float(fused[0].detach())


def test_the_objectives_add_z_loss_in_training_only(monkeypatch):
    """CausalLM (fused and plain) and MaskedLM: training loss = the mean NLL + z * mean log(Z)^2
    over predicted tokens; validation's loss is the plain NLL."""
    z = 0.05
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 99, (3, 11), generator=g)
    labels = torch.randint(4, 99, (3, 11), generator=g)
    labels[1, 7:] = IGNORE_INDEX
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    for cls, arch in ((CausalLM, "decoder"), (MaskedLM, "encoder")):
        torch.manual_seed(0)
        module = cls(
            tiny_config(arch, dropout=0.0, attention_dropout=0.0), optim=OptimConfig(z_loss=z), skip_nonfinite=False
        )
        with torch.no_grad():
            logits = module.model(ids, batch["attention_mask"])  # (B, T, V)
        keep = labels != IGNORE_INDEX
        nll = F.cross_entropy(logits[keep], labels[keep])
        expected = nll + z * (torch.logsumexp(logits[keep], -1) ** 2).mean()
        for fused in (True, False) if cls is CausalLM else (False,):
            monkeypatch.setattr(cls, "fuse_head_and_loss", lambda self, f=fused: f)
            loss = module.training_step(batch, 0)
            torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
        module.eval_reset()
        with torch.no_grad():
            module.eval_update(batch, 0)
        assert module.eval_compute()["loss"] == pytest.approx(float(nll), rel=1e-5)
