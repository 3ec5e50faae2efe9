"""A mixture's rows grouped by attention mode (masks.mode_groups): each group on its mode's fused
path equals the one dense (B, 1, T, S) bias it replaces, in outputs and in gradients, for causal,
prefix, bidirectional and mixed rows, with padding; a mode sent down the wrong path is caught.

The reference is the dense path itself (Stack._self_bias, which decoding with a cache and the
position-bias models still take), forced by turning the grouping off. Decoding with a KV cache
keeps the dense path, and test_attention_modes.py's bidirectional-prompt tests check that it
equals the (now grouped) recomputation. Odd tiny sizes (batch 5, length 7, vocabulary 99), float32.

Shape legend: B batch, T length, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import seeded_model, tiny_config

from lit_transformer.model import masks
from lit_transformer.model.transformer import Stack

B, T, V = 5, 7, 99
BATCHES = {
    "causal": [0, 0, 1, 0, 0],
    "bidirectional": [T] * 5,
    "prefix": [2, 3, 5, 4, 6],
    "gptbert": [0, 0, 0, T, T],  # a row-mixed batch: each task's rows together
    "interleaved": [T, 0, 3, 100, 0],  # every mode, out of order
}

pytestmark = pytest.mark.usefixtures("one_thread")


def model_for(impl: str = "sdpa", dropout: float = 0.0):
    cfg = tiny_config("decoder", d_model=32, n_heads=4, d_ff=64, max_seq_len=64, attention_impl=impl, dropout=dropout)
    return seeded_model(cfg)


def batch(padding: str | None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    if padding == "right":
        for row, n in enumerate([T, 6, 4, T, 5]):
            mask[row, n:] = 0
    elif padding == "left":
        for row, n in enumerate([T, 6, 4, T, 5]):
            mask[row, : T - n] = 0
    return ids.masked_fill(mask == 0, 0), mask


def run(model, ids, mask, prefix, *, grouped: bool, monkeypatch):
    """Logits and the gradients of the embedding table and of the first block's query weights."""
    with monkeypatch.context() as patch:
        if not grouped:
            patch.setattr(Stack, "_groups_modes", lambda self, prefix_lengths, cache: False)
        model.zero_grad()
        logits = model(ids, mask, prefix_lengths=prefix)  # (B, T, V)
        (logits * mask[..., None]).square().mean().backward()  # padded queries left out, as losses leave them
    block = model.transformer.decoder.blocks[0].attn
    return logits.detach(), model.transformer.tokens.weight.grad.clone(), block.q.weight.grad.clone()


@pytest.mark.parametrize("impl", ["sdpa", "math"])
@pytest.mark.parametrize("padding", [None, "right", "left"])
@pytest.mark.parametrize("name", list(BATCHES))
def test_grouped_attention_equals_the_dense_bias(name, padding, impl, monkeypatch):
    model = model_for(impl)
    ids, mask = batch(padding)
    prefix = torch.tensor(BATCHES[name])
    dense = run(model, ids, mask, prefix, grouped=False, monkeypatch=monkeypatch)
    grouped = run(model, ids, mask, prefix, grouped=True, monkeypatch=monkeypatch)
    real = mask.bool()
    torch.testing.assert_close(grouped[0][real], dense[0][real], atol=1e-5, rtol=1e-5)
    for got, want in zip(grouped[1:], dense[1:]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_each_mode_takes_its_fused_path(monkeypatch):
    """A row-mixed batch: causal rows through SDPA's causal kernel with no mask, bidirectional rows
    with no mask at all; only prefix rows carry a bias, of their own rows."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((q.shape[0], kw.get("is_causal", False), None if attn_mask is None else tuple(attn_mask.shape)))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = model_for()
    ids, mask = batch(None)
    with torch.no_grad():
        model(ids, mask, prefix_lengths=torch.tensor([0, 0, 0, T, T]))
        assert calls == [(3, True, None), (2, False, None)] * 2  # two layers
        calls.clear()
        model(ids, mask, prefix_lengths=torch.tensor([0, 4, 0, 100, 3]))
        assert calls == [(2, True, None), (2, False, (2, 1, T, T)), (1, False, None)] * 2


def test_groups_keep_batch_order():
    groups = masks.mode_groups(torch.tensor([0, 0, 0, T, T]), None, T, torch.float32, "cpu")
    assert groups.order is None and [g.rows for g in groups.groups] == [slice(0, 3), slice(3, 5)]
    groups = masks.mode_groups(torch.tensor([T, 0, 3, 100, 0]), None, T, torch.float32, "cpu")
    rows = [list(range(B))[g.rows] if isinstance(g.rows, slice) else g.rows.tolist() for g in groups.groups]
    assert rows == [[0, 3], [1, 4], [2]]
    assert groups.order.tolist() == [0, 2, 4, 1, 3]  # batch row i is concatenated row order[i]


def test_a_bidirectional_row_on_the_causal_path_is_caught(monkeypatch):
    """The mutation the equivalence test must catch: bidirectional rows read as causal."""
    model = model_for()
    ids, mask = batch(None)
    prefix = torch.tensor(BATCHES["gptbert"])
    dense = run(model, ids, mask, prefix, grouped=False, monkeypatch=monkeypatch)[0]
    real_mode = masks.row_mode
    monkeypatch.setattr(
        masks, "row_mode", lambda p, n: masks.CAUSAL if real_mode(p, n) == masks.FULL else real_mode(p, n)
    )
    mutated = run(model, ids, mask, prefix, grouped=True, monkeypatch=monkeypatch)[0]
    assert (mutated[3:] - dense[3:]).abs().max() > 1e-2  # the bidirectional rows changed ...
    torch.testing.assert_close(mutated[:3], dense[:3], atol=1e-5, rtol=1e-5)  # ... the causal ones did not
