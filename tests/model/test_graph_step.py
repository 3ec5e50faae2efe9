"""The fixed-shape decoding step (model/graph_step.py), which a CUDA graph replays on a GPU:
run eagerly on CPU it must give the logits of the usual step at every step, for every kind of
position, padding, GQA, QK-norm, a bidirectional prompt and encoder-decoders. The captured graph
itself needs CUDA: `benchmarks/gpu_check.py` (kv_decoding) compares it with the eager step.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from helpers import seeded_model
from test_generate import CONFIGS, V, prompts

from lit_transformer.model import preset
from lit_transformer.model.generate import GenerationConfig, StepDecoder, beam_search, generate
from lit_transformer.model.graph_step import FixedShapeStep, graph_step_supported

pytestmark = pytest.mark.usefixtures("one_thread")

QK_NORM = {
    "qk_norm": lambda: preset(
        "tinyllama-1.1b", vocab_size=V, d_model=48, n_heads=6, n_kv_heads=3, n_layers=2, d_ff=74, qk_norm=True
    ),
}


def fed_the_same(model, decoders: list[StepDecoder], steps: int) -> None:
    """Feed every decoder the same random continuation and compare their logits at each step."""
    tokens = torch.randint(1, V, (decoders[0].ids.shape[0], steps), generator=torch.Generator().manual_seed(3))
    for column in range(steps):
        reference, *others = (d.next_logits() for d in decoders)
        for logits in others:
            torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)
        for d in decoders:
            d.append(tokens[:, column])


@pytest.mark.parametrize("kind", [*CONFIGS, *QK_NORM])
@pytest.mark.parametrize("bidirectional_prompt", [False, True])
def test_fixed_shape_step_equals_the_usual_step(kind, bidirectional_prompt):
    model = seeded_model({**CONFIGS, **QK_NORM}[kind]()).eval()
    if bidirectional_prompt and model.config.arch != "decoder":
        pytest.skip("a bidirectional prompt is for decoder-only models")
    ids, mask = prompts()
    with torch.no_grad():
        usual, fixed = (
            StepDecoder(model, ids, mask, max_new_tokens=9, bidirectional_prompt=bidirectional_prompt) for _ in range(2)
        )
        fixed.graph_step = FixedShapeStep(fixed, capture=False)  # what the GPU captures, run eagerly
        fed_the_same(model, [usual, fixed], steps=9)
    assert fixed.graph_step is not None and fixed.graph_step.logits is not None  # the fixed step ran
    # the fixed step attends over all M slots: the cache must have been written where the usual one is
    assert fixed.cache.length == usual.cache.length == fixed.length - 1
    torch.testing.assert_close(fixed.cache.keys, usual.cache.keys, atol=1e-5, rtol=1e-5)
    assert torch.equal(fixed.cache.key_mask, usual.cache.key_mask)


@pytest.mark.parametrize("kind", ["rope_gqa", "t5_relative"])
def test_beam_search_with_the_fixed_shape_step_equals_the_usual_one(kind):
    """Beam search moves rows among a prompt's beams (in place, which a captured step needs)
    and drops the rows of finished prompts (a new step at the new shape)."""
    model = seeded_model(CONFIGS[kind]()).eval()
    ids, mask = prompts()
    usual = generate(model, ids, mask, max_new_tokens=9, num_beams=3)
    eos = int(usual[1, -8])  # an early token of prompt 1's best beam: it finishes before the others
    config = GenerationConfig(max_new_tokens=9, num_beams=3, eos_token_id=eos, length_penalty=0.0)
    with torch.no_grad():
        expected = beam_search(StepDecoder(model, ids, mask, max_new_tokens=9, expand=3), config)
        decoder = StepDecoder(model, ids, mask, max_new_tokens=9, expand=3)
        decoder.graph_step = first = FixedShapeStep(decoder, capture=False)
        got = beam_search(decoder, config)
    assert torch.equal(got, expected)
    assert first.logits is not None  # the fixed step ran
    assert decoder.graph_step is not first and decoder.graph_step.rows < 9  # and again with fewer rows


def test_fixed_shape_step_in_bfloat16_stays_close():
    model = seeded_model(CONFIGS["rope_gqa"]()).eval().to(torch.bfloat16)
    ids, mask = prompts()
    with torch.no_grad():
        usual, fixed = (StepDecoder(model, ids, mask, max_new_tokens=6) for _ in range(2))
        fixed.graph_step = FixedShapeStep(fixed, capture=False)
        for column in range(6):
            a, b = usual.next_logits().clone(), fixed.next_logits()
            # the same products over more (masked) keys: bf16 rounding may differ, the argmax rarely
            assert (a - b).abs().max() < 0.1 * a.abs().max()
            for d in (usual, fixed):
                d.append(a.argmax(-1))


def test_unsupported_decoders_keep_the_usual_step():
    windowed = seeded_model(CONFIGS["rope_gqa"]().replace(sliding_window=4)).eval()
    ids, mask = prompts()
    decoder = StepDecoder(windowed, ids, mask, max_new_tokens=3)
    assert "sliding_window" in graph_step_supported(decoder)
    with pytest.raises(ValueError, match="needs full softmax attention with a KV cache; model.sliding_window"):
        FixedShapeStep(decoder, capture=False)
    no_cache = StepDecoder(seeded_model(CONFIGS["learned"]()).eval(), ids, mask, max_new_tokens=3, use_cache=False)
    assert "no KV cache" in graph_step_supported(no_cache)


def test_capture_needs_cuda_and_cpu_generation_ignores_the_flag():
    model = seeded_model(CONFIGS["learned"]()).eval()
    ids, mask = prompts()
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device; the model is on cpu"):
        FixedShapeStep(StepDecoder(model, ids, mask, max_new_tokens=3), capture=True)
    assert StepDecoder(model, ids, mask, max_new_tokens=3, cuda_graph=True).graph_step is None
    assert torch.equal(
        generate(model, ids, mask, max_new_tokens=5, cuda_graph=True),
        generate(model, ids, mask, max_new_tokens=5, cuda_graph=False),
    )


def test_a_finished_decoder_frees_its_step_without_the_cycle_collector():
    """A CUDA graph destroyed by the cycle collector during another graph's capture breaks that
    capture (graph_step.py): a decoder and its step must not form a reference cycle."""
    model = seeded_model(CONFIGS["t5_relative"]()).eval()
    ids, mask = prompts()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.no_grad():
            decoder = StepDecoder(model, ids, mask, max_new_tokens=4, expand=2)
            decoder.graph_step = FixedShapeStep(decoder, capture=False)
            beam_search(decoder, GenerationConfig(max_new_tokens=4, num_beams=2))
        step = weakref.ref(decoder.graph_step)
        del decoder
        assert step() is None  # freed by its reference count, not left for the collector
    finally:
        if collecting:
            gc.enable()


def test_a_fixed_step_takes_exactly_one_new_token():
    model = seeded_model(CONFIGS["learned"]()).eval()
    ids, mask = prompts()
    decoder = StepDecoder(model, ids, mask, max_new_tokens=3)
    step = FixedShapeStep(decoder, capture=False)
    with torch.no_grad(), pytest.raises(ValueError, match="takes one new token; 7 are uncached"):
        step(decoder)  # the prompt is not cached yet
