"""How long T5 span corruption's pieces are (Raffel et al. 2020, section 3.1.4): the raw block,
the encoder input and the target, for a given input length, noise density and mean span
length. Plain arithmetic, below both the tokenizer checks and the collator (span.py).

`span_lengths(L)` finds the longest raw length whose input is exactly L tokens, so packed raw
blocks of that length give fixed-size encoder inputs and targets (T5's
`compute_input_and_target_lengths`, reimplemented here from its description).
"""

from __future__ import annotations

from dataclasses import dataclass

from lit_transformer.errors import DataError


@dataclass(frozen=True)
class SpanLengths:
    raw_length: int  # tokens taken from the packed stream per example
    input_length: int  # encoder input, eos included
    target_length: int  # labels, eos included
    noise_tokens: int
    noise_spans: int


def _lengths(raw: int, density: float, mean_span: float) -> SpanLengths:
    noise = min(max(int(round(raw * density)), 1), raw - 1)  # at least one of each kind
    spans = max(int(round(noise / mean_span)), 1)
    return SpanLengths(raw, raw - noise + spans + 1, noise + spans + 1, noise, spans)


def span_lengths(input_length: int, noise_density: float = 0.15, mean_span_length: float = 3.0) -> SpanLengths:
    """The longest raw block whose corrupted encoder input has exactly `input_length` tokens."""
    if input_length < 4:
        raise DataError(f"data.block_size={input_length} is too short for span corruption (need >= 4)")
    if not 0.0 < noise_density < 1.0:
        raise DataError(f"data.noise_density={noise_density} must be in (0, 1) for span corruption")
    raw = 2
    # the input length grows by 0 or 1 per raw token, so the search lands on input_length exactly
    while _lengths(raw + 1, noise_density, mean_span_length).input_length <= input_length:
        raw += 1
    out = _lengths(raw, noise_density, mean_span_length)
    if out.input_length != input_length or out.raw_length - out.noise_tokens < out.noise_spans:
        raise DataError(
            f"span corruption cannot give inputs of exactly data.block_size={input_length} tokens with "
            f"data.noise_density={noise_density}, data.mean_span_length={mean_span_length}"
        )
    return out
