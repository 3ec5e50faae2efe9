"""Generation: KV cache equals recomputation, padding invariance, beam search properties,
sampling distribution, eos handling, and HF parity (when the interop module is present).

Tiny random models with odd sizes (batch 3, prompt length 7, vocabulary 99). init_std is
raised from 0.02 so that logits are spread out: greedy paths then vary and stay far from ties.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import optional, seeded_model

from lit_transformer.model import preset
from lit_transformer.model.generate import (
    GenerationConfig,
    StepDecoder,
    beam_search,
    generate,
    left_pad,
    positions_from_mask,
)
from lit_transformer.model.interop.directories import load_pretrained

V = 99
CONFIGS = {
    "learned": lambda: preset(
        "gpt2-small", vocab_size=V, d_model=48, n_heads=3, n_layers=2, d_ff=74, max_seq_len=64, init_std=0.2
    ),
    "rope_gqa": lambda: preset(
        "tinyllama-1.1b",
        vocab_size=V,
        d_model=48,
        n_heads=6,
        n_kv_heads=2,
        n_layers=2,
        d_ff=74,
        max_seq_len=64,
        init_std=0.2,
    ),
    "alibi": lambda: preset(
        "gpt2-small",
        vocab_size=V,
        d_model=48,
        n_heads=3,
        n_layers=2,
        d_ff=74,
        max_seq_len=64,
        position="alibi",
        init_std=0.2,
    ),
    "t5_relative": lambda: preset(
        "t5-base",
        vocab_size=V,
        d_model=48,
        n_heads=3,
        head_dim=16,
        n_layers=2,
        n_decoder_layers=3,
        d_ff=74,
        relative_buckets=8,
        relative_max_distance=20,
        init_std=0.2,
    ),
    "sinusoidal": lambda: preset(
        "transformer-base", vocab_size=V, d_model=48, n_heads=3, n_layers=2, d_ff=74, init_std=0.2
    ),
}
SEQ2SEQ = ("t5_relative", "sinusoidal")
LENGTHS = (7, 4, 6)


pytestmark = pytest.mark.usefixtures("one_thread")


def prompts(seed: int = 1, lengths=LENGTHS, side: str = "right"):
    """A padded batch (3, 7) of prompts with the given real lengths; padding id 0."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    tokens = torch.randint(1, V, (len(lengths), T), generator=g)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for row, n in enumerate(lengths):
        where = slice(0, n) if side == "right" else slice(T - n, T)
        ids[row, where], mask[row, where] = tokens[row, :n], 1
    return ids, mask


def new_tokens(model, out: torch.Tensor, prompt_width: int) -> torch.Tensor:
    return out[:, 1:] if model.config.arch == "encoder_decoder" else out[:, prompt_width:]


def sequence_logprob(model, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Sum of log p(tokens | prompt) from one full forward, no cache. prompt (T,), tokens (G,)."""
    with torch.no_grad():
        if model.config.arch == "encoder_decoder":
            decoder_in = torch.cat((torch.zeros(1, dtype=torch.long), tokens))[None]  # start token 0 (T5)
            logits = model(prompt[None], decoder_input_ids=decoder_in)[0, :-1]
        else:
            seq = torch.cat((prompt, tokens))[None]
            logits = model(seq)[0, len(prompt) - 1 : -1]
        return logits.float().log_softmax(-1).gather(1, tokens[:, None]).sum()


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_kv_cache_equals_recomputation(kind):
    model = seeded_model(CONFIGS[kind]())
    ids, mask = prompts()
    cached = generate(model, ids, mask, max_new_tokens=10)
    recomputed = generate(model, ids, mask, max_new_tokens=10, use_cache=False)
    assert torch.equal(cached, recomputed)
    if model.config.arch == "decoder":  # random seq2seq models repeat one token per row; decoders vary
        assert len(set(new_tokens(model, cached, 7).flatten().tolist())) > 6
    # Logits of every step match, both decoders fed the same varied (random) continuation.
    generated = torch.randint(1, V, (3, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        steps = [StepDecoder(model, ids, mask, max_new_tokens=10, use_cache=use) for use in (True, False)]
        for column in range(generated.shape[1]):
            with_cache, without = (s.next_logits() for s in steps)
            torch.testing.assert_close(with_cache, without, atol=1e-4, rtol=0)
            for s in steps:
                s.append(generated[:, column])


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_padding_invariance(kind):
    model = seeded_model(CONFIGS[kind]())
    right_ids, right_mask = prompts(side="right")
    left_ids, left_mask = prompts(side="left")
    batch_right = new_tokens(model, generate(model, right_ids, right_mask, max_new_tokens=8), 7)
    batch_left = new_tokens(model, generate(model, left_ids, left_mask, max_new_tokens=8), 7)
    assert torch.equal(batch_right, batch_left)
    for row, n in enumerate(LENGTHS):
        alone = generate(model, right_ids[row : row + 1, :n], max_new_tokens=8)
        assert torch.equal(new_tokens(model, alone, n)[0], batch_right[row])


def test_prompt_is_returned_left_padded():
    model = seeded_model(CONFIGS["learned"]())
    ids, mask = prompts(side="right")
    out = generate(model, ids, mask, max_new_tokens=3)
    expected_ids, expected_mask = left_pad(ids, mask, 0)
    assert out.shape == (3, 7 + 3)
    assert torch.equal(out[:, :7], expected_ids)
    for row, n in enumerate(LENGTHS):
        assert torch.equal(expected_ids[row, 7 - n :], ids[row, :n])
        assert expected_mask[row].sum() == n and expected_mask[row, 7 - n :].all()
    assert torch.equal(positions_from_mask(expected_mask)[:, -1], torch.tensor(LENGTHS) - 1)


@pytest.mark.parametrize("kind", ["rope_gqa", "t5_relative"])
def test_beam_width_one_equals_greedy(kind):
    model = seeded_model(CONFIGS[kind]())
    ids, mask = prompts()
    greedy = generate(model, ids, mask, max_new_tokens=9)
    # eos = a token greedy emits mid-way for row 0, so the eos branch of beam search runs.
    eos = int(new_tokens(model, greedy, 7)[0, 3])
    for eos_id, lp in ((None, 1.7), (eos, 0.0)):
        config = GenerationConfig(max_new_tokens=9, num_beams=1, eos_token_id=eos_id, length_penalty=lp)
        with torch.no_grad():
            beam = beam_search(StepDecoder(model, ids, mask, max_new_tokens=9), config)
        expected = generate(model, ids, mask, max_new_tokens=9, eos_token_id=eos_id)
        assert torch.equal(beam, expected)


@pytest.mark.parametrize("kind", ["learned", "t5_relative"])
def test_beam_search_two_steps(kind):
    """Two new tokens: width 4 keeps greedy's first token, so its best sequence is at least
    greedy's; width V (every first token kept) is exhaustive, including an eos hypothesis of
    length 1 scored with the length penalty."""
    model = seeded_model(CONFIGS[kind]())
    ids, mask = prompts()
    greedy = new_tokens(model, generate(model, ids, mask, max_new_tokens=2), 7)
    beam4 = new_tokens(model, generate(model, ids, mask, max_new_tokens=2, num_beams=4, length_penalty=0.0), 7)
    for row, n in enumerate(LENGTHS):
        prompt = ids[row, :n]
        assert sequence_logprob(model, prompt, beam4[row]) >= sequence_logprob(model, prompt, greedy[row]) - 1e-5
    for row, n in enumerate(LENGTHS):
        prompt = ids[row, :n]
        with torch.no_grad():  # brute force: log p(v) + log p(w | v) for all V x V pairs
            if model.config.arch == "encoder_decoder":
                dec = torch.stack((torch.zeros(V, dtype=torch.long), torch.arange(V)), 1)  # (V, 2)
                logp = model(prompt.expand(V, n), decoder_input_ids=dec).log_softmax(-1)  # (V, 2, V)
            else:
                seq = torch.cat((prompt.expand(V, n), torch.arange(V)[:, None]), 1)  # (V, n + 1)
                logp = model(seq)[:, n - 1 :].log_softmax(-1)  # (V, 2, V)
        first, second = logp[0, 0], logp[:, 1]  # (V,), (V, V)
        pairs = first[:, None] + second  # (V, V)
        eos = int(first.topk(2).indices[1])  # a likely first token, so both outcomes happen below
        outcomes = set()
        for lp in (0.0, 2.0, 6.0):
            pair_scores = (pairs / 2**lp).clone()
            pair_scores[eos] = float("-inf")  # after eos there is no second token
            best = int(pair_scores.argmax())
            expected = [best // V, best % V] if pair_scores.max() > first[eos] else [eos, 0]
            out = generate(
                model, ids[row : row + 1, :n], max_new_tokens=2, num_beams=V, length_penalty=lp, eos_token_id=eos
            )
            got = new_tokens(model, out, n)[0].tolist()
            assert got + [0] * (2 - len(got)) == expected, (row, lp)
            outcomes.add(expected[0] == eos)
        if row == 0:
            assert outcomes == {True, False}  # the penalty changed the winner: the test can tell


@pytest.mark.parametrize("kind", ["alibi", "t5_relative"])
def test_beam_search_cache_equals_recomputation(kind):
    model = seeded_model(CONFIGS[kind]())
    ids, mask = prompts()
    greedy = generate(model, ids, mask, max_new_tokens=8)
    eos = int(new_tokens(model, greedy, 7)[1, 2])
    kwargs = dict(max_new_tokens=8, num_beams=3, eos_token_id=eos, length_penalty=0.7)
    cached = generate(model, ids, mask, **kwargs)
    assert torch.equal(cached, generate(model, ids, mask, use_cache=False, **kwargs))
    # Padding invariance holds for beams too.
    for row, n in enumerate(LENGTHS):
        alone = new_tokens(model, generate(model, ids[row : row + 1, :n], **kwargs), n)[0]
        batch = new_tokens(model, cached, 7)[row]
        assert torch.equal(batch[: len(alone)], alone) and (batch[len(alone) :] == 0).all()


@pytest.mark.parametrize("several", [False, True])
def test_eos_stops_row_and_pads(several):
    model = seeded_model(CONFIGS["rope_gqa"]())
    ids, mask = prompts()
    free = new_tokens(model, generate(model, ids, mask, max_new_tokens=12), 7)
    eos = [int(free[0, 2]), int(free[2, 5])] if several else int(free[0, 2])
    out = generate(model, ids, mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=V - 1)
    expected = free.clone()
    ends = []
    for row in range(3):
        hits = torch.isin(free[row], torch.tensor(eos)).nonzero()
        end = int(hits[0]) + 1 if len(hits) else 12
        expected[row, end:] = V - 1
        ends.append(end)
    expected = expected[:, : max(ends)]  # stops as soon as every row is finished
    assert torch.equal(new_tokens(model, out, 7), expected)
    assert ends[0] == 3 and (not several or ends[2] <= 6)


def test_sampling_seeded():
    model = seeded_model(CONFIGS["learned"]())
    ids, mask = prompts()
    greedy = generate(model, ids, mask, max_new_tokens=10)

    def sample(seed, **kw):
        return generate(
            model, ids, mask, max_new_tokens=10, do_sample=True, generator=torch.Generator().manual_seed(seed), **kw
        )

    assert torch.equal(sample(3, temperature=2.0), sample(3, temperature=2.0))
    assert not torch.equal(sample(3, temperature=2.0), sample(4, temperature=2.0))
    assert torch.equal(sample(5, top_k=1, temperature=3.0), greedy)
    assert torch.equal(sample(6, top_p=1e-6, temperature=3.0), greedy)


def _reference_distribution(logits: torch.Tensor, temperature: float, top_k, top_p) -> torch.Tensor:
    """Written out with plain Python, independent of filter_logits."""
    probs = (logits.double() / temperature).softmax(-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep = order[:top_k] if top_k else order
    total = sum(probs[i] for i in keep)
    if top_p is not None:
        nucleus, mass = [], 0.0
        for i in keep:
            nucleus.append(i)
            mass += probs[i] / total
            if mass >= top_p:
                break
        keep = nucleus
    out = torch.zeros(len(probs), dtype=torch.float64)
    for i in keep:
        out[i] = probs[i]
    return out / out.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.5, None, None), (1.3, 20, 0.8)])
def test_sampling_distribution(temperature, top_k, top_p):
    """Empirical first-token frequencies over 20000 draws match the filtered softmax."""
    model = seeded_model(CONFIGS["learned"]())
    prompt = prompts()[0][:1]  # (1, 7)
    with torch.no_grad():
        logits = model(prompt)[0, -1]
    target = _reference_distribution(logits, temperature, top_k, top_p)
    plain = logits.double().softmax(-1)
    assert (target - plain).abs().sum() / 2 > 0.15  # the options matter, so the check can fail
    n = 20000
    out = generate(
        model,
        prompt.expand(n, 7),
        max_new_tokens=1,
        do_sample=True,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=torch.Generator().manual_seed(0),
    )
    counts = torch.bincount(out[:, -1], minlength=V).double() / n
    assert counts[target == 0].sum() == 0  # nothing outside top-k / the nucleus
    assert (counts - target).abs().sum() / 2 < 0.03  # total variation; expected ~0.01 at n=20000


def test_errors():
    ids, mask = prompts()
    encoder = seeded_model(
        preset("bert-base", vocab_size=V, d_model=48, n_heads=3, n_layers=1, d_ff=74, max_seq_len=32)
    )
    with pytest.raises(ValueError, match="encoder"):
        generate(encoder, ids, mask, max_new_tokens=3)
    model = seeded_model(CONFIGS["learned"]())  # max_seq_len 64, longest prompt 7
    with pytest.raises(ValueError, match="max_seq_len=64"):
        generate(model, ids, mask, max_new_tokens=58)
    assert generate(model, ids, mask, max_new_tokens=57).shape[1] == 7 + 57
    generate(seeded_model(CONFIGS["rope_gqa"]()), ids, mask, max_new_tokens=70)  # rope has no table to overrun
    with pytest.raises(ValueError, match="beam"):
        generate(model, ids, mask, max_new_tokens=3, num_beams=2, do_sample=True)
    with pytest.raises(ValueError, match="no real token"):
        generate(model, ids, torch.zeros_like(mask), max_new_tokens=3)


def test_restores_training_mode():
    model = seeded_model(CONFIGS["learned"]()).train()  # dropout 0.1 in the preset: generation must turn it off
    ids, mask = prompts()
    first = generate(model, ids, mask, max_new_tokens=6)
    assert model.training
    assert torch.equal(first, generate(model, ids, mask, max_new_tokens=6))


def _hf_model(family: str):
    transformers = optional("transformers", "dev")
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=V, n_embd=48, n_head=3, n_layer=2, n_inner=74, n_positions=64, initializer_range=0.2
        )
        return transformers.GPT2LMHeadModel(config).eval()
    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=V,
            hidden_size=48,
            intermediate_size=74,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=64,
            initializer_range=0.2,
        )
        return transformers.LlamaForCausalLM(config).eval()
    # transformers 5.23's T5 cache breaks when the decoder has more layers than the encoder.
    config = transformers.T5Config(
        vocab_size=V,
        d_model=48,
        d_kv=16,
        num_heads=3,
        num_layers=3,
        d_ff=74,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
        initializer_factor=5.0,
    )
    return transformers.T5ForConditionalGeneration(config).eval()


@pytest.mark.parametrize("family", ["gpt2", "llama", "t5"])
def test_matches_transformers_generate(tmp_path, family):
    """Greedy and beam search (eos, several length penalties) give HF's tokens exactly.
    HF's early_stopping="never" is the exact stopping rule implemented here. The pad id is
    not 0: HF 5.23 fills finished beams with `pad_token_id or eos`, so a pad of 0 becomes eos."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    hf = _hf_model(family)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path).eval()
    seq2seq = family == "t5"
    pad = V - 1
    ids, mask = prompts(side="right" if seq2seq else "left")  # HF decoder-only generation wants left padding
    ids = ids.masked_fill(mask == 0, pad)
    extra = dict(decoder_start_token_id=pad) if seq2seq else {}
    with torch.no_grad():
        hf_greedy = hf.generate(
            ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=pad, eos_token_id=None, **extra
        )
    right_ids, right_mask = prompts(side="right")  # ours takes either side
    ours = generate(model, right_ids, right_mask, max_new_tokens=12, pad_token_id=pad, **extra)
    assert torch.equal(ours, hf_greedy)
    width = 1 if seq2seq else 7
    eos = int(hf_greedy[1, width + 2])  # a token greedy emits mid-way, so rows stop at different steps
    for num_beams, length_penalty in ((1, 1.0), (3, 1.0), (4, 0.3), (4, 2.0)):
        kwargs = dict(
            max_new_tokens=12,
            num_beams=num_beams,
            length_penalty=length_penalty,
            eos_token_id=eos,
            pad_token_id=pad,
            **extra,
        )
        with torch.no_grad():
            expected = hf.generate(ids, attention_mask=mask, do_sample=False, early_stopping="never", **kwargs)
        assert torch.equal(generate(model, ids, mask, **kwargs), expected), (num_beams, length_penalty)
