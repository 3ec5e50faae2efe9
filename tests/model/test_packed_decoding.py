"""Decoding's fast paths: oneDNN-packed linear weights (model/packed_linear.py), the KV cache
reordered in place, finished beam-search prompts leaving the batch, and bf16 decoding within
a stated tolerance of float32."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import V, seeded_model, tiny_config
from torch import nn

import lit_transformer.model.generate as generate_module
import lit_transformer.model.packed_linear as packed_module
from lit_transformer.model.attention import KVCache
from lit_transformer.model.generate import StepDecoder, generate
from lit_transformer.model.packed_linear import packed_is_faster, packed_linears, packing_available

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def odd_model(arch: str = "decoder"):
    return seeded_model(tiny_config(arch, init_std=0.2, n_decoder_layers=3 if arch == "encoder_decoder" else None))


def linears(model) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear]


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_forward_equals_plain_and_is_undone(dtype):
    model = odd_model().to(dtype)
    ids = torch.randint(0, V, (3, 7))
    # oneDNN packs bf16 only with AVX512 (BW, VL, DQ) or AVX-NE-CONVERT: on an AVX2-only CPU
    # nothing is packed and the products stay F.linear (its reorder raised there before)
    packs = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    with torch.inference_mode():
        plain = model(ids)
        with packed_linears(model, when="always") as count:
            assert count == (len(linears(model)) if packs else 0) and len(linears(model)) > 0
            assert all(("forward" in m.__dict__) == packs for m in linears(model))
            packed = model(ids)
            with packed_linears(model, when="always") as inner:
                assert inner == 0  # already packed: nothing packed twice
    assert not any("forward" in m.__dict__ for m in linears(model))
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(packed.float(), plain.float(), **tolerance)


@needs_onednn
def test_a_changed_weight_is_never_read_from_a_stale_pack():
    layer = nn.Linear(13, 5)
    x = torch.randn(3, 13)
    with torch.inference_mode(), packed_linears(layer, when="always"):
        before = layer(x)
        with torch.no_grad():
            layer.weight.mul_(2)  # in place: the version counter moves
        after = layer(x)
    torch.testing.assert_close(after, torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert not torch.allclose(after, before)


@needs_onednn
def test_gradients_still_flow_inside_the_block():
    layer = nn.Linear(13, 5)
    x = torch.randn(3, 13, requires_grad=True)
    with packed_linears(layer, when="always"):
        layer(x).sum().backward()
    assert layer.weight.grad is not None and x.grad is not None


def test_nothing_is_packed_where_it_does_not_apply(monkeypatch):
    model = odd_model().to(torch.float16)
    assert not packing_available(model)
    with packed_linears(model, when="always") as count:
        assert count == 0
    # bf16 weights on a CPU whose oneDNN cannot pack them (AVX2 only), wherever the suite runs
    monkeypatch.setattr(packed_module, "_packed_dtypes", lambda: (torch.float32,))
    model = odd_model().to(torch.bfloat16)
    assert not packing_available(model)
    with torch.inference_mode(), packed_linears(model, when="always") as count:
        assert count == 0 and model(torch.randint(0, V, (3, 7))).dtype == torch.bfloat16
    monkeypatch.undo()

    class Wrapped(torch.Tensor):  # stands for a DTensor: a weight that is not a plain tensor
        pass

    layer = nn.Linear(5, 3)
    layer.weight = nn.Parameter(layer.weight.detach().as_subclass(Wrapped))
    with packed_linears(layer, when="always") as count:
        assert count == 0 and "forward" not in layer.__dict__
    compiled = odd_model()
    compiled.transformer.decoder.blocks[0].compile()  # as trainer.compile does per block
    assert not packing_available(compiled)


def test_the_choice_is_the_side_with_the_lower_median():
    # packed's best pass (1.0) beats every plain one, but its median (3.0) does not
    assert not packed_is_faster([1.0, 3.0, 3.0, 9.0, 3.0], [2.0, 2.0, 2.5, 2.0, 2.0])
    assert packed_is_faster([2.0, 2.0, 2.5, 2.0, 2.0], [1.0, 3.0, 3.0, 9.0, 3.0])
    assert not packed_is_faster([2.0], [2.0])  # a tie keeps plain F.linear: no second copy of the weights
    with pytest.raises(ValueError, match="no timings to choose from: 0 packed, 1 plain"):
        packed_is_faster([], [1.0])


@needs_onednn
@pytest.mark.parametrize("packed_wins", [True, False])
def test_faster_packs_by_the_measurement_once_per_shape_class(packed_wins, monkeypatch):
    """when="faster" times packed against plain once per (rows, threads, weight shapes), packs
    only where packed won, and reuses the answer for another model of the same shapes."""
    monkeypatch.setattr(packed_module, "_CHOICES", {})
    monkeypatch.setattr(packed_module, "_MEDIANS", {})
    measured = []

    def fake_measure(forwards, rows):
        measured.append((len(forwards), rows))
        return ([1.0], [2.0]) if packed_wins else ([2.0], [1.0])

    monkeypatch.setattr(packed_module, "_measure", fake_measure)
    model, twin = odd_model(), odd_model()
    expected = len(linears(model)) if packed_wins else 0
    assert packed_module.measured_choice(model, rows=6) is None
    with torch.inference_mode():
        for m in (model, twin, model):
            with packed_linears(m, rows=6) as count:
                assert count == expected
                assert all(("forward" in x.__dict__) == packed_wins for x in linears(m))
            assert not any("forward" in x.__dict__ for x in linears(m))
        with packed_linears(model, rows=2) as count:  # another row count: measured again
            assert count == expected
    assert measured == [(len(linears(model)), 6), (len(linears(model)), 2)]
    assert list(packed_module.choices().values()) == [packed_wins, packed_wins]
    seconds = {"packed_s": 1.0, "plain_s": 2.0} if packed_wins else {"packed_s": 2.0, "plain_s": 1.0}
    assert packed_module.measured_choice(twin, rows=6) == {"packed": packed_wins, **seconds}
    assert packed_module.measured_choice(model.to(torch.bfloat16), rows=6) is None  # another dtype: not measured
    with pytest.raises(ValueError, match="when='sometimes'"):
        with packed_linears(model, when="sometimes"):
            pass


@needs_onednn
def test_the_measurement_times_both_sides_in_alternation_without_changing_results():
    model = odd_model()
    with packed_linears(model, rows=4, when="always"):
        forwards = [m.forward for m in linears(model)]
    packed, plain = packed_module._measure(forwards, rows=4)
    assert len(packed) == len(plain) == packed_module.MEASURE_ROUNDS and min(packed + plain) > 0
    ids = torch.randint(0, V, (4, 7))
    with torch.inference_mode():
        plain_logits = model(ids)
        with packed_linears(model, rows=4) as count:  # the real measurement, whichever side wins
            chosen_logits = model(ids)
    assert count in (0, len(linears(model)))
    torch.testing.assert_close(chosen_logits, plain_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
@pytest.mark.parametrize("num_beams", [1, 3])
def test_generation_tokens_are_unchanged_by_packing(arch, num_beams, monkeypatch):
    """float32: the packed products round differently in the last bits only, so greedy and
    beam search pick the same tokens as with plain F.linear."""
    model = odd_model(arch)
    ids = torch.randint(1, V, (3, 7), generator=torch.Generator().manual_seed(3))
    packed_calls = []

    def always(model, rows=1):
        packed_calls.append(rows)
        return packed_linears(model, rows, when="always")

    monkeypatch.setattr(generate_module, "packed_linears", always)  # packed whatever this machine measures
    packed = generate(model, ids, max_new_tokens=9, num_beams=num_beams)
    assert packed_calls == [3 * num_beams]
    monkeypatch.setattr(generate_module, "packed_linears", lambda model, rows=1: contextlib.nullcontext(0))
    assert torch.equal(packed, generate(model, ids, max_new_tokens=9, num_beams=num_beams))


def test_in_place_reorder_equals_selecting_rows():
    cache = KVCache(n_layers=2, batch=4, kv_heads=3, head_dim=5, capacity=11, dtype=torch.float32, device="cpu")
    cache.keys.normal_(), cache.values.normal_()
    cache.length = 6
    index = torch.tensor([2, 2, 0, 3])
    expected = cache.keys[:, index, :, :6].clone(), cache.values[:, index, :, :6].clone()
    keys_storage = cache.keys.data_ptr()
    cache.reorder(index, within_groups=True)
    assert cache.keys.data_ptr() == keys_storage  # rewritten in place, no new cache
    assert torch.equal(cache.keys[:, :, :, :6], expected[0]) and torch.equal(cache.values[:, :, :, :6], expected[1])
    cache.reorder(torch.tensor([1, 3]))  # fewer rows: prompts finished
    assert cache.keys.shape[1] == 2 and torch.equal(cache.keys[:, :, :, :6], expected[0][:, [1, 3]])
    assert cache.keys.data_ptr() == keys_storage  # the front of the same cache, no new one
    cache.reorder(torch.tensor([1, 0, 0]))  # more rows than it holds: a new cache
    assert cache.keys.shape[1] == 3 and torch.equal(cache.keys[:, :, :, :6], expected[0][:, [3, 1, 1]])


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_finished_prompts_leave_the_beam_batch(arch):
    """With a third of the vocabulary as eos, prompts finish at different steps: the model then
    sees fewer rows, and every prompt's output is still the one it gets alone."""
    model = odd_model(arch)
    ids = torch.randint(1, V, (4, 5), generator=torch.Generator().manual_seed(5))
    eos = list(range(1, V, 3))
    rows_seen = []
    hook = model.lm_head.register_forward_hook(lambda module, inputs, output: rows_seen.append(output.shape[0]))
    try:
        batch = generate(model, ids, max_new_tokens=12, num_beams=3, eos_token_id=eos, length_penalty=0.0)
    finally:
        hook.remove()
    assert rows_seen[0] == 12 and min(rows_seen) < 12 and rows_seen == sorted(rows_seen, reverse=True)
    for row in range(4):
        alone = generate(
            model, ids[row : row + 1], max_new_tokens=12, num_beams=3, eos_token_id=eos, length_penalty=0.0
        )[0]
        width = alone.shape[0]
        assert torch.equal(batch[row, :width], alone) and (batch[row, width:] == 0).all()


def test_bf16_decoding_is_within_tolerance_of_float32():
    """bf16 weights (the default for decoding on CPUs with bf16 matrix instructions): next-token
    log-probabilities within 0.1 nats of float32's wherever float32 is sure of its choice, and
    the same argmax wherever float32's top two logits are more than 0.2 apart."""
    model = odd_model()
    ids = torch.randint(1, V, (5, 9), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        exact = StepDecoder(model, ids, max_new_tokens=1).next_logits()
        half = StepDecoder(seeded_model(model.config).to(torch.bfloat16), ids, max_new_tokens=1).next_logits()
    top2 = exact.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.2
    assert clear.any()
    assert torch.equal(half.argmax(-1)[clear], exact.argmax(-1)[clear])
    sure = exact.log_softmax(-1).max(-1).values > -0.5
    diff = (half.log_softmax(-1) - exact.log_softmax(-1)).abs().max(-1).values
    assert (diff[sure] < 0.1).all() if sure.any() else diff.max() < 0.3
