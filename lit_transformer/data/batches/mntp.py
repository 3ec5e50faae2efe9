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
- the rate falls linearly from `mask_rate_start` at optimizer step 0 to `mask_rate_end` at
  `schedule_steps` and stays there (GPT-BERT: 30% -> 15%). It is a pure function of the step
  the data module passes with each batch, so a resumed run masks exactly as an uninterrupted
  one. Without a step (validation, evaluation) the rate is the end rate: GPT-BERT validates at
  15%, and every validation of a run then measures the same task.

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


def mask_rate(step: int | None, start: float, end: float, steps: int | None) -> float:
    """The mask rate at optimizer step `step`: linear from `start` at 0 to `end` at `steps`,
    `end` after; `end` without a step or without a horizon."""
    if step is None or not steps:
        return end
    return start + (end - start) * min(max(step, 0) / steps, 1.0)


def span_mask(
    eligible: torch.Tensor, rate: float, max_span_length: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """eligible (n,) bool -> (chosen (n,) bool, span (n,) long: each position's span, 0, 1, ...
    in order). Exactly floor(rate m + u) of the m eligible positions are chosen, u uniform in
    [0, 1): whole spans in the order of their random scores, the last one cut short (module
    docstring). Always n + 1 + n draws from `gen`, whatever is chosen."""
    n = eligible.numel()
    m = int(eligible.sum())
    k = min(int(rate * m + float(torch.rand((), generator=gen))), m)
    lengths = torch.randint(1, max_span_length + 1, (n,), generator=gen)  # (n,): more spans than needed
    scores = torch.rand(n, generator=gen)
    ends = lengths.cumsum(0)  # (n,) where each span ends
    span = torch.searchsorted(ends, torch.arange(n), right=True)  # (n,)
    if n == 0:
        return eligible.clone(), span
    count = int(span[-1]) + 1  # spans that cover the row, S
    elig = eligible.long()
    per_span = torch.zeros(count, dtype=torch.long).index_add_(0, span, elig)  # (S,) eligible tokens
    order = scores[:count].argsort(stable=True)  # (S,) spans in the order they are taken
    taken_before = torch.empty_like(per_span)
    taken_before[order] = per_span[order].cumsum(0) - per_span[order]  # (S,) chosen before the span's turn
    span_start = per_span.cumsum(0) - per_span  # (S,) eligible tokens left of each span
    within = elig.cumsum(0) - elig - span_start[span]  # (n,) eligible tokens before p in its span
    return eligible & (taken_before[span] + within < k), span


class MNTPCollator:
    """Next-token blocks of T + 1 tokens -> GPT-BERT's masked rows with shifted targets (module
    docstring). `schedule_steps`: the optimizer steps the rate falls over (None: the end rate)."""

    takes_step = True  # TaskCollator passes each training batch's optimizer step

    def __init__(
        self,
        *,
        special: SpecialTokens,
        vocab_size: int,
        mask_rate_start: float = 0.15,
        mask_rate_end: float = 0.15,
        schedule_steps: int | None = None,
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
        self.schedule_steps = schedule_steps
        self.max_span_length = int(max_span_length)
        self.mask_replace_prob, self.random_replace_prob = mask_replace_prob, random_replace_prob

    def rate(self, step: int | None) -> float:
        return mask_rate(step, *self.rates, self.schedule_steps)

    def __call__(self, examples, generators=None, step: int | None = None) -> dict[str, torch.Tensor]:
        gens = per_example(generators, len(examples))
        ids = pad(examples, self.pad_id)  # (B, T+1)
        B, n = ids.shape
        lengths = torch.tensor([len(ex) for ex in examples])
        real = torch.arange(n)[None, :] < lengths[:, None]  # (B, T+1)
        eligible = real & ~torch.isin(ids, self.never)
        eligible[:, 0] = False  # nothing before it to read its prediction at
        rate = self.rate(step)
        chosen = torch.zeros(B, n, dtype=torch.bool)
        inputs = ids.clone()
        keep_below = self.mask_replace_prob + self.random_replace_prob
        for row, gen in enumerate(gens):
            L = int(lengths[row])
            picked, span = span_mask(eligible[row, :L], rate, self.max_span_length, gen)
            r = torch.rand(L, generator=gen)[span]  # (L,): one draw per span
            random_tokens = self.random_ids[torch.randint(len(self.random_ids), (L,), generator=gen)]
            to_mask = picked & (r < self.mask_replace_prob)
            to_random = picked & (r >= self.mask_replace_prob) & (r < keep_below)
            inputs[row, :L] = torch.where(to_mask, self.mask_id, torch.where(to_random, random_tokens, ids[row, :L]))
            chosen[row, :L] = picked
        labels = ids[:, 1:].masked_fill(~chosen[:, 1:], IGNORE_INDEX)  # (B, T): the token after each position
        return {"input_ids": inputs[:, :-1], "attention_mask": real[:, :-1].long(), "labels": labels}
