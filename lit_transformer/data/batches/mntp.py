"""Masked next-token prediction (MNTP): GPT-BERT's masked rows on a decoder (Charpentier and
Samuel 2024, "BERT or GPT: why not both?"; the masking of their public training code, written
anew here). A row is read bidirectionally, and the prediction for a masked token at position i
is read from the output at position i - 1: the causal head's convention (shifted targets), so
one head and one output layout serve the causal rows and the masked ones.

Per next-token block of n = T + 1 tokens (as CLMCollator reads it):
- spans: the block is cut into consecutive spans of 1..max_span_length tokens (uniform, as
  GPT-BERT's), each span gets a random score, and spans are taken in score order until k
  tokens are chosen, the last one cut short so that exactly k are. k is the rate times the
  row's eligible tokens, rounded stochastically (GPT-BERT's `int(n p + u)`), so a row's
  expected share is the rate. Eligible: positions 1..n-1 (position 0 has no position before
  it to predict it from) that hold no special token.
- replacement, one draw per span so that a span is never half revealed (as GPT-BERT's):
  [MASK] with mask_replace_prob, a random non-special token per position with
  random_replace_prob, else the span stays as it is (GPT-BERT: 80/10/10).
- the rate falls linearly from `mask_rate_start` at the run's start to `mask_rate_end` at its
  end (GPT-BERT: 30% -> 15%). It is a pure function of the share of the run done, which the
  data module passes with each training batch (progress.py): its optimizer step over
  trainer.max_steps, or under trainer.max_time the seconds of training spent over the budget,
  the clock the learning rate reads. A resumed run goes on from where it stopped: without a
  time budget it masks exactly as an uninterrupted one. Without a share (validation,
  evaluation) the rate is the end rate: GPT-BERT validates at 15%, and every validation of a
  run then measures the same task.

Every row draws from its own generator over its own length (collate.py), so a row is masked
the same whatever batch, rank or padding it lands in.

Batch keys (B batch, T length): input_ids (B,T) the masked block[:-1]; attention_mask (B,T);
labels (B,T): labels[t] = block[t+1] where position t+1 was chosen, else IGNORE_INDEX. The
mixture's TaskCollator adds prefix_lengths = T (every row fully visible).
"""

from __future__ import annotations

import torch

from lit_transformer.data.batches.collate import IGNORE_INDEX, masking_ids, pad, per_example
from lit_transformer.data.tokens.tokenizer import SpecialTokens
from lit_transformer.errors import DataError

MAX_SPAN_LENGTH = 3  # GPT-BERT's SpanMaskingStrategy.max_span_length


def mask_rate(done: float | None, start: float, end: float) -> float:
    """The mask rate once the share `done` of the run is done (progress.py): linear from `start`
    at 0 to `end` at 1; `end` without a share."""
    if done is None:
        return end
    return start + (end - start) * min(max(done, 0.0), 1.0)


def span_mask(
    eligible: torch.Tensor, rate: float, u: torch.Tensor, span_lengths: torch.Tensor, scores: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's spans and chosen positions from its draws, all rows at once (B batch, n row
    length, S = n span slots): eligible (B, n) bool, u (B,) uniform in [0, 1), span_lengths (B, n) in
    1..max_span_length and scores (B, n) uniform -> (chosen (B, n) bool, span (B, n) long: each
    position's span, 0, 1, ... in order). Exactly floor(rate m + u) of a row's m eligible
    positions are chosen: whole spans in the order of their scores (span j's score is
    scores[:, j]), the last one cut short (module docstring).

    Ragged rows are padded: padding is not eligible, and its span lengths may be anything >= 1
    (the spans stay in order, and every span index stays below n). A row's chosen positions
    then depend on its own draws over its own length alone: a span past the row's end holds no
    eligible token, so wherever it sorts it moves no other span's count."""
    elig = eligible.long()  # (B, n)
    m = elig.sum(1)  # (B,)
    k = torch.minimum((rate * m.double() + u.double()).long(), m)  # (B,): int(rate m + u) as a float64 sum
    n = eligible.shape[1]
    ends = span_lengths.cumsum(1)  # (B, n) where each span ends
    positions = torch.arange(n).expand_as(ends).contiguous()  # (B, n)
    span = torch.searchsorted(ends, positions, right=True)  # (B, n)
    per_span = torch.zeros_like(elig).scatter_add_(1, span, elig)  # (B, S) eligible tokens
    order = scores.argsort(dim=1, stable=True)  # (B, S) spans in the order they are taken
    in_order = per_span.gather(1, order)  # (B, S)
    taken_before = torch.empty_like(per_span).scatter_(1, order, in_order.cumsum(1) - in_order)  # (B, S)
    span_start = per_span.cumsum(1) - per_span  # (B, S) eligible tokens left of each span
    within = elig.cumsum(1) - elig - span_start.gather(1, span)  # (B, n) eligible tokens before p in its span
    return eligible & (taken_before.gather(1, span) + within < k[:, None]), span


def row_draws(
    gens: list[torch.Generator], lengths: list[int], n: int, max_span_length: int, vocab: int
) -> tuple[torch.Tensor, ...]:
    """Each row's random numbers from its own generator over its own length, padded to n (B
    batch): u (B,), span lengths (B, n), span scores (B, n), replacement draws (B, n) and random
    token picks (B, n) in [0, vocab), in this order per row: 1 + L + L + L + L draws for a row of
    L tokens, so a row is masked the same in any batch. Only the draws loop over rows (the span
    logic runs on all rows at once, span_mask); they write in place into the padded tensors,
    as torch.rand and torch.randint would draw them. Padding keeps span length 1 (span_mask).
    The rows' views come from one unbind, and only a ragged row is sliced: indexing each
    buffer per row was a measurable share of the loop (benchmarks/collate_speed.py)."""
    B = len(gens)
    u, scores, r = torch.zeros(B), torch.zeros(B, n), torch.zeros(B, n)
    span_lengths, picks = torch.ones(B, n, dtype=torch.long), torch.zeros(B, n, dtype=torch.long)
    rows = zip(gens, lengths, u.unbind(), span_lengths.unbind(), scores.unbind(), r.unbind(), picks.unbind())
    for gen, L, u_row, *row in rows:
        if L < n:
            row = [x[:L] for x in row]
        lengths_row, scores_row, r_row, picks_row = row  # (L,) each
        u_row.uniform_(generator=gen)
        lengths_row.random_(1, max_span_length + 1, generator=gen)  # more spans than needed
        scores_row.uniform_(generator=gen)
        r_row.uniform_(generator=gen)
        picks_row.random_(0, vocab, generator=gen)
    return u, span_lengths, scores, r, picks


class MNTPCollator:
    """Next-token blocks of T + 1 tokens -> GPT-BERT's masked rows with shifted targets (module
    docstring). The rate follows the share of the run done that each training batch brings (as
    `step`, progress.py); the end rate without one."""

    follows_progress = True  # TaskCollator passes each training batch's share of the run done

    def __init__(
        self,
        *,
        special: SpecialTokens,
        vocab_size: int,
        mask_rate_start: float = 0.15,
        mask_rate_end: float = 0.15,
        max_span_length: int = MAX_SPAN_LENGTH,
        mask_replace_prob: float = 0.8,
        random_replace_prob: float = 0.1,
    ):
        if special.mask_id is None:
            raise DataError("masked next-token prediction needs a mask token ([MASK] or <mask>) in the tokenizer")
        for name, value in (("mask_rate_start", mask_rate_start), ("mask_rate_end", mask_rate_end)):
            if not 0.0 < value < 1.0:
                raise DataError(f"{name}={value} is outside (0, 1)")
        if isinstance(max_span_length, bool) or int(max_span_length) != max_span_length or max_span_length < 1:
            raise DataError(f"max_span_length={max_span_length!r} must be a positive integer")
        if not (0 <= mask_replace_prob and 0 <= random_replace_prob and mask_replace_prob + random_replace_prob <= 1):
            raise DataError(
                f"mask_replace_prob={mask_replace_prob} and random_replace_prob={random_replace_prob} "
                "must be non-negative with a sum of at most 1"
            )
        self.mask_id = special.mask_id
        self.pad_id = special.pad_id if special.pad_id is not None else 0
        self.never, self.random_ids = masking_ids(special, vocab_size)
        self.rates = (float(mask_rate_start), float(mask_rate_end))
        self.max_span_length = int(max_span_length)
        self.mask_replace_prob, self.random_replace_prob = mask_replace_prob, random_replace_prob

    def rate(self, done: float | None) -> float:
        return mask_rate(done, *self.rates)

    def __call__(self, examples, generators=None, done: float | None = None) -> dict[str, torch.Tensor]:
        gens = per_example(generators, len(examples))
        ids = pad(examples, self.pad_id)  # (B, T+1)
        n = ids.shape[1]
        lengths = torch.tensor([len(ex) for ex in examples])
        real = torch.arange(n)[None, :] < lengths[:, None]  # (B, T+1)
        eligible = real & ~torch.isin(ids, self.never)
        eligible[:, 0] = False  # nothing before it to read its prediction at
        draws = row_draws(gens, lengths.tolist(), n, self.max_span_length, len(self.random_ids))
        u, span_lengths, scores, r, picks = draws  # (B,), then (B, T+1) each
        chosen, span = span_mask(eligible, self.rate(done), u, span_lengths, scores)  # (B, T+1) each
        r = r.gather(1, span)  # (B, T+1): one draw per span
        to_mask = chosen & (r < self.mask_replace_prob)
        to_random = chosen & (r >= self.mask_replace_prob) & (r < self.mask_replace_prob + self.random_replace_prob)
        inputs = torch.where(to_mask, self.mask_id, torch.where(to_random, self.random_ids[picks], ids))
        labels = ids[:, 1:].masked_fill(~chosen[:, 1:], IGNORE_INDEX)  # (B, T): the token after each position
        return {"input_ids": inputs[:, :-1], "attention_mask": real[:, :-1].long(), "labels": labels}
