"""T5 span corruption (Raffel et al. 2020, section 3.1.4; the "random spans" noise of the T5 code).

A raw block of `raw_length` tokens is split into alternating non-noise / noise spans, starting
with non-noise. The encoder input keeps the non-noise tokens and puts sentinel i where noise
span i was; the target lists sentinel i followed by noise span i, for every span, then eos:

    raw      a b c d e f g h i
    mask     . . x x . . . x .          (x = noise)
    input    a b <0> e f g <1> i </s>
    target   <0> c d <1> h </s>

The lengths of the pieces come from span_sizes.py (`span_lengths`).
"""

from __future__ import annotations

import numpy as np
import torch

from lit_transformer.data.batches.collate import per_example
from lit_transformer.data.batches.span_sizes import SpanLengths, span_lengths  # noqa: F401  (re-exported)
from lit_transformer.errors import DataError


def _segment(total: int, parts: int, rng: np.random.Generator) -> np.ndarray:
    """A uniformly random composition of `total` into `parts` positive lengths."""
    if parts == 1:
        return np.array([total])
    cuts = np.sort(rng.choice(total - 1, size=parts - 1, replace=False)) + 1
    return np.diff(np.concatenate([[0], cuts, [total]]))


def noise_mask(lengths: SpanLengths, rng: np.random.Generator) -> np.ndarray:
    """(raw_length,) bool: True on noise tokens, exactly `noise_spans` spans, never first."""
    noise = _segment(lengths.noise_tokens, lengths.noise_spans, rng)
    keep = _segment(lengths.raw_length - lengths.noise_tokens, lengths.noise_spans, rng)
    runs = np.stack([keep, noise], axis=1).reshape(-1)  # (2 * spans,): keep_0, noise_0, keep_1, ...
    flags = np.tile([False, True], lengths.noise_spans)
    return np.repeat(flags, runs)


def corrupt(tokens: np.ndarray, mask: np.ndarray, sentinel_ids: np.ndarray, eos_id: int):
    """(input ids, target ids) of one raw block for a noise mask (module docstring)."""
    prev = np.concatenate([[False], mask[:-1]])
    noise_start = mask & ~prev
    # a non-noise run starts at 0 (always non-noise) or after noise; run i pairs with sentinel i
    keep_start = ~mask & np.concatenate([[True], mask[:-1]])
    span_of_noise = np.maximum(np.cumsum(noise_start) - 1, 0)
    inputs = np.where(noise_start, sentinel_ids[span_of_noise], tokens)[~mask | noise_start]
    span_of_keep = np.maximum(np.cumsum(keep_start) - 1, 0)
    targets = np.where(keep_start, sentinel_ids[span_of_keep], tokens)[mask | keep_start]
    return np.append(inputs, eos_id), np.append(targets, eos_id)


class SpanCorruptionCollator:
    """Raw blocks (raw_length,) -> T5 batch of fixed lengths.

    Returns input_ids (B, L_in), attention_mask (B, L_in), labels (B, L_tgt),
    decoder_input_ids (B, L_tgt) = labels shifted right after the decoder start token (pad),
    decoder_attention_mask (B, L_tgt).
    """

    def __init__(
        self,
        *,
        block_size: int,
        sentinel_ids,
        eos_id: int,
        decoder_start_id: int,
        noise_density: float = 0.15,
        mean_span_length: float = 3.0,
    ):
        self.lengths = span_lengths(block_size, noise_density, mean_span_length)
        if len(sentinel_ids) < self.lengths.noise_spans:
            raise DataError(
                f"span corruption of data.block_size={block_size} needs {self.lengths.noise_spans} "
                f"sentinel tokens; the tokenizer has {len(sentinel_ids)}"
            )
        self.sentinel_ids = np.asarray(list(sentinel_ids), dtype=np.int64)
        self.eos_id = eos_id
        self.decoder_start_id = decoder_start_id

    def __call__(self, examples, generators=None) -> dict[str, torch.Tensor]:
        inputs, targets = [], []
        for ex, gen in zip(examples, per_example(generators, len(examples))):
            # numpy: torch's per-call overhead dominates on these tiny per-example arrays
            # (docs/defaults.md, "Span corruption's noise in numpy"); one draw from the
            # example's torch generator seeds it, so the row stays a function of that generator
            rng = np.random.default_rng(int(torch.randint(2**62, (1,), generator=gen)))
            tokens = np.asarray(ex, dtype=np.int64)
            if tokens.shape != (self.lengths.raw_length,):
                raise DataError(
                    f"span corruption expects raw blocks of {self.lengths.raw_length} tokens, got {tokens.shape}"
                )
            i, t = corrupt(tokens, noise_mask(self.lengths, rng), self.sentinel_ids, self.eos_id)
            inputs.append(i)
            targets.append(t)
        input_ids = torch.as_tensor(np.stack(inputs))  # (B, L_in)
        labels = torch.as_tensor(np.stack(targets))  # (B, L_tgt)
        start = torch.full((labels.shape[0], 1), self.decoder_start_id, dtype=torch.long)
        return {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "labels": labels,
            "decoder_input_ids": torch.cat([start, labels[:, :-1]], dim=1),  # (B, L_tgt)
            "decoder_attention_mask": torch.ones_like(labels),
        }
