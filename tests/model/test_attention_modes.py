"""Per-row attention modes of a decoder (UniLM, Dong et al. 2019; prefix LM, Raffel et al. 2020):
prefix_lengths 0 is causal, >= T bidirectional, p bidirectional over the first p tokens.

Odd tiny sizes (batch 3, length 7, vocabulary 99), float32, eval mode. Dependence between
positions is read off gradients with respect to the embedding output, so "sees" and "does not
see" are both exact.

Shape legend: B batch, T length, C model width, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from helpers import seeded_model, tiny_config

from lit_transformer.model import LanguageModel, TransformerConfig
from lit_transformer.model.generate import GenerationConfig, StepDecoder, beam_search, generate, positions_from_mask

B, T, V = 3, 7, 99
POSITIONS = ["rope", "learned", "alibi", "t5_relative"]

pytestmark = pytest.mark.usefixtures("one_thread")


def config(arch="decoder", position="rope", **kw) -> TransformerConfig:
    """tiny_config at width 32, 4 heads, d_ff 64 and length 64."""
    return tiny_config(arch, **{"d_model": 32, "n_heads": 4, "d_ff": 64, "max_seq_len": 64, "position": position, **kw})


def dependence(model: LanguageModel, ids: torch.Tensor, prefix: torch.Tensor | None) -> torch.Tensor:
    """(B, T, T): norm of d logits[b, t] / d embedding output[b, t'] (rows are independent, so
    summing a position's logits over the batch keeps each row's gradient its own)."""
    captured = {}

    def keep(module, inputs, output):
        output.retain_grad()
        captured["x"] = output

    handle = model.transformer.decoder.embed.register_forward_hook(keep)
    rows = []
    try:
        for t in range(ids.shape[1]):
            model.zero_grad()
            logits = model(ids, prefix_lengths=prefix)  # (B, T, V)
            logits[:, t].sum().backward()
            rows.append(captured["x"].grad.norm(dim=-1))  # (B, T)
    finally:
        handle.remove()
    return torch.stack(rows, dim=1)  # (B, T, T): [b, output t, input t']


def expected_visible(prefix: list[int], length: int) -> torch.Tensor:
    """(B, T, T) bool: query t sees key t' iff t' <= t or t' < prefix[b]."""
    t = torch.arange(length)
    causal = t[None, :] <= t[:, None]  # (T, T)
    return torch.stack([causal | (t[None, :] < p) for p in prefix])


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_bidirectional_gradients_flow_both_ways(impl):
    model = seeded_model(config(attention_impl=impl))
    ids = torch.randint(0, V, (B, T))
    dep = dependence(model, ids, torch.full((B,), T))
    assert torch.all(dep[:, 0, T - 1] > 0), "the first output does not see the last token"
    assert torch.all(dep[:, T - 1, 0] > 0), "the last output does not see the first token"
    assert torch.all(dep > 0)


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_prefix_zero_is_causal_and_equals_none(impl):
    model = seeded_model(config(attention_impl=impl))
    ids = torch.randint(0, V, (B, T))
    for prefix in (None, torch.zeros(B, dtype=torch.long)):
        dep = dependence(model, ids, prefix)
        future = torch.ones(T, T, dtype=torch.bool).triu(1)  # (T, T): t' > t
        assert torch.all(dep[:, future] == 0), f"prefix {prefix}: a position sees the future"
        assert torch.all(dep[:, ~future] > 0)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, prefix_lengths=torch.zeros(B, dtype=torch.long)), model(ids), atol=1e-6, rtol=1e-6
        )


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_prefix_is_bidirectional_inside_causal_after(impl):
    """Rows with prefixes 2, 3, 5: exactly the expected pairs depend on each other."""
    model = seeded_model(config(attention_impl=impl))
    ids = torch.randint(0, V, (B, T))
    prefix = [2, 3, 5]
    dep = dependence(model, ids, torch.tensor(prefix))
    for b, p in enumerate(prefix):
        inside = dep[b, :p, :p]
        assert torch.all(inside > 0), f"row {b}: the prefix is not bidirectional"
        after = dep[b, p:, :]  # outputs after the prefix: causal
        assert torch.all(after.triu(p + 1) == 0), f"row {b}: a position after the prefix sees the future"
        assert torch.all(dep[b, :p, p:] == 0), f"row {b}: the prefix sees what follows it"
    visible = expected_visible(prefix, T)
    assert torch.all((dep > 0) == visible)


def test_fused_path_only_without_prefix():
    """No prefix: no bias tensor (SDPA's fused causal kernel); a prefix: one (B, 1, T, S) bias."""
    stack = seeded_model(config()).transformer.decoder
    positions = torch.arange(T).expand(B, T)
    bias, is_causal, _ = stack._self_bias(None, positions, None, torch.float32)
    assert bias is None and is_causal
    bias, is_causal, _ = stack._self_bias(None, positions, None, torch.float32, torch.tensor([0, 3, T]))
    assert bias.shape == (B, 1, T, T) and not is_causal
    visible = bias[:, 0] == 0  # (B, T, T)
    assert torch.equal(visible, expected_visible([0, 3, T], T))


@pytest.mark.parametrize("position", POSITIONS)
def test_mixed_batch_equals_rows_alone(position):
    """Row 0 causal, row 1 prefix 3 (right-padded to 6 tokens), row 2 bidirectional (a prefix
    past its length, right-padded to 4 tokens): the batch equals each row run alone."""
    model = seeded_model(config(position=position))
    lengths, prefix = [T, 6, 4], torch.tensor([0, 3, 100])
    ids = torch.randint(1, V, (B, T))
    mask = torch.zeros(B, T, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        batched = model(ids, mask, prefix_lengths=prefix)  # (B, T, V)
        for row, n in enumerate(lengths):
            alone = model(ids[row : row + 1, :n], prefix_lengths=prefix[row : row + 1])  # (1, n, V)
            torch.testing.assert_close(batched[row, :n], alone[0], atol=1e-5, rtol=1e-5)
        # the modes matter: the bidirectional row differs from its causal reading
        causal = model(ids[2:3, :4])
        assert not torch.allclose(causal[0, 0], batched[2, 0], atol=1e-4)


def test_logits_at_and_head_features_take_prefix():
    model = seeded_model(config())
    ids, prefix = torch.randint(0, V, (B, T)), torch.tensor([0, 3, T])
    selected = torch.zeros(B, T, dtype=torch.bool)
    selected[:, 1] = True
    with torch.no_grad():
        full = model(ids, prefix_lengths=prefix)
        torch.testing.assert_close(model.logits_at(ids, None, selected, prefix_lengths=prefix), full[selected])
        features = model.head_features(ids, prefix_lengths=prefix)
        torch.testing.assert_close(model.lm_head.decoder(features), full)


# ----------------------------------------------------------------------------- generation


def left_padded_prompts(lengths=(7, 4, 6), seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    tokens = torch.randint(1, V, (len(lengths), width), generator=g)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :], mask[row, width - n :] = tokens[row, :n], 1
    return ids, mask


@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_bidirectional_prompt_first_step_reads_whole_prompt(position):
    """The first generated token's logits are those of a full forward with prefix = prompt width."""
    model = seeded_model(config(position=position, init_std=0.2))
    ids, mask = left_padded_prompts()
    with torch.no_grad():
        reference = model(ids, mask, position_ids=positions_from_mask(mask), prefix_lengths=torch.full((B,), T))[
            :, -1
        ]  # (B, V)
        causal = model(ids, mask, position_ids=positions_from_mask(mask))[:, -1]
    for use_cache in (True, False):
        step = StepDecoder(model, ids, mask, max_new_tokens=4, use_cache=use_cache, bidirectional_prompt=True)
        torch.testing.assert_close(step.next_logits(), reference, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(reference, causal, atol=1e-3), "the prompt's mode made no difference"


@pytest.mark.parametrize("position", ["rope", "learned", "alibi", "t5_relative"])
def test_bidirectional_prompt_cache_equals_recomputation(position):
    model = seeded_model(config(position=position, init_std=0.2))
    ids, mask = left_padded_prompts()
    cached, recomputed = (
        generate(model, ids, mask, max_new_tokens=8, use_cache=use, bidirectional_prompt=True) for use in (True, False)
    )
    assert torch.equal(cached, recomputed)
    beams = [
        generate(model, ids, mask, max_new_tokens=6, num_beams=3, use_cache=use, bidirectional_prompt=True)
        for use in (True, False)
    ]
    assert torch.equal(*beams)


def test_bidirectional_prompt_beam_width_one_equals_greedy():
    model = seeded_model(config(init_std=0.2))
    ids, mask = left_padded_prompts()
    greedy = generate(model, ids, mask, max_new_tokens=9, bidirectional_prompt=True)
    config1 = GenerationConfig(max_new_tokens=9, num_beams=1, bidirectional_prompt=True)
    with torch.inference_mode():
        beam = beam_search(StepDecoder(model, ids, mask, max_new_tokens=9, bidirectional_prompt=True), config1)
    assert torch.equal(beam, greedy)


def test_causal_prompt_unchanged():
    model = seeded_model(config(init_std=0.2))
    ids, mask = left_padded_prompts()
    plain = generate(model, ids, mask, max_new_tokens=8)
    assert torch.equal(generate(model, ids, mask, max_new_tokens=8, bidirectional_prompt=False), plain)
    assert torch.equal(generate(model, ids, mask, max_new_tokens=8, bidirectional_prompt=False, use_cache=False), plain)


def test_bidirectional_prompt_ignored_by_encoder_decoder():
    model = seeded_model(config("encoder_decoder", "t5_relative", init_std=0.2))
    ids, mask = left_padded_prompts()
    plain = generate(model, ids, mask, max_new_tokens=6)
    assert torch.equal(generate(model, ids, mask, max_new_tokens=6, bidirectional_prompt=True), plain)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "options,named",
    [
        (dict(sliding_window=3), "model.sliding_window"),
        (dict(attention_kind="linear"), "model.attention_kind='linear'"),
    ],
)
def test_refuses_efficient_attention(options, named):
    model = seeded_model(config(**options))
    ids = torch.randint(0, V, (B, T))
    with pytest.raises(ValueError, match=r"prefix_lengths .*" + named.replace(".", r"\.").replace("(", r"\(")):
        model(ids, prefix_lengths=torch.full((B,), 3))
    with pytest.raises(ValueError, match="prefix_lengths"):
        generate(model, ids, max_new_tokens=2, bidirectional_prompt=True)


def test_refuses_document_ids_and_bad_shapes():
    model = seeded_model(config())
    ids = torch.randint(0, V, (B, T))
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1]]).expand(B, T)
    with pytest.raises(ValueError, match="document_ids"):
        model(ids, document_ids=documents, prefix_lengths=torch.full((B,), 3))
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        model(ids, prefix_lengths=torch.full((B, 1), 3))
    with pytest.raises(ValueError, match="integers"):
        model(ids, prefix_lengths=torch.full((B,), 3.0))


@pytest.mark.parametrize("arch,named", [("encoder", "already bidirectional"), ("encoder_decoder", "stays causal")])
def test_refuses_models_without_a_decoder_only_stack(arch, named):
    model = seeded_model(config(arch, "learned"))
    ids = torch.randint(0, V, (B, T))
    prefix = torch.full((B,), 3)
    with pytest.raises(ValueError, match=named):
        model(ids, decoder_input_ids=ids if arch == "encoder_decoder" else None, prefix_lengths=prefix)
    if arch == "encoder_decoder":
        memory = model.transformer.encode(ids)
        with pytest.raises(ValueError, match=named):
            model.transformer.decode(ids, memory=memory, prefix_lengths=prefix)
