"""Translation end to end (issue 13): batched beam search equals one sentence at a time, GNMT
length normalisation, `generate --input` in input order, context limits said out loud,
checkpoint averaging, and evaluate's BLEU equal to sacrebleu on `generate --input`'s output.

Tiny random models with odd sizes (vocabulary 99, prompt lengths 7, 3, 5, 1); init_std raised
so that beams differ and stay away from ties.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from lit_transformer.cli import main
from lit_transformer.model import LanguageModel
from lit_transformer.model.generate import generate

V = 99
LENGTHS = (7, 3, 5, 1)
PAD = 0
EOS = list(range(2, 14))  # a dozen eos ids: hypotheses end at different lengths, so length penalties matter

pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(arch: str, seed: int = 0) -> LanguageModel:
    torch.manual_seed(seed)
    extra = dict(position="sinusoidal", norm_position="post") if arch == "encoder_decoder" else dict(position="rope")
    return LanguageModel.from_config(tiny_config(arch, vocab_size=V, init_std=0.3, **extra)).eval()


def batch(lengths=LENGTHS, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(14, V, (n,), generator=g).tolist() for n in lengths]


def padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) ids and mask; generate accepts either side."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    return ids, mask


def new_tokens(model, out: torch.Tensor, width: int, row: int) -> list[int]:
    """The generated ids of one output row, up to and including eos."""
    new = out[row, 1:] if model.config.arch == "encoder_decoder" else out[row, width:]
    ids = []
    for t in new.tolist():
        ids.append(t)
        if t in EOS:
            break
    return ids if ids[-1] in EOS else [t for t in ids if t != PAD]


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder"])
@pytest.mark.parametrize("normalization,alpha", [("gnmt", 0.6), ("power", 1.0), ("gnmt", 0.0)])
def test_batched_beam_search_equals_one_at_a_time(arch, normalization, alpha):
    model = make_model(arch)
    rows = batch()
    options = dict(max_new_tokens=9, num_beams=3, length_penalty=alpha, length_normalization=normalization,
                   eos_token_id=EOS, pad_token_id=PAD, decoder_start_token_id=PAD)
    ids, mask = padded(rows)
    together = generate(model, ids, mask, **options)
    for i, row in enumerate(rows):
        alone = generate(model, torch.tensor([row]), **options)
        assert new_tokens(model, together, ids.shape[1], i) == new_tokens(model, alone, len(row), 0), i


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder"])
def test_beam_width_one_equals_greedy_in_a_padded_batch(arch):
    model = make_model(arch, seed=3)
    ids, mask = padded(batch(seed=4))
    common = dict(max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD, decoder_start_token_id=PAD)
    greedy = generate(model, ids, mask, **common)
    beam1 = generate(model, ids, mask, num_beams=1, length_penalty=0.6, length_normalization="gnmt", **common)
    assert torch.equal(greedy, beam1)


def test_gnmt_normalisation_prefers_longer_hypotheses_than_none():
    """alpha = 0 scores by summed log-probability (short hypotheses win); GNMT's alpha > 0
    divides by ((5 + |Y|) / 6) ** alpha, so hypotheses can only get longer on average."""
    model = make_model("encoder_decoder", seed=5)
    ids, mask = padded(batch((6, 4, 5, 3, 7, 2), seed=6))
    common = dict(max_new_tokens=12, num_beams=4, eos_token_id=EOS, pad_token_id=PAD, decoder_start_token_id=PAD,
                  length_normalization="gnmt")
    short = generate(model, ids, mask, length_penalty=0.0, **common)
    long = generate(model, ids, mask, length_penalty=2.0, **common)
    length = lambda out: sum(len(new_tokens(model, out, 0, i)) for i in range(out.shape[0]))  # noqa: E731
    assert length(long) >= length(short)
