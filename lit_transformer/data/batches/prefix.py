"""Collators of a mixture's tasks: prefix LM on a decoder or an encoder-decoder, the wrapper
that puts a task's mode token in front and tags its batches, and `task_collator`, which builds a
task's collator for training and evaluation alike.

Prefix LM (Raffel et al. 2020, 3.2.1; UniLM's seq2seq mask, Dong et al. 2019; UL2's S-denoiser,
Tay et al. 2022): a row of n real tokens is split at p; the first p tokens are context seen in
both directions, the rest is predicted left to right. Each row draws its prefix share f
uniformly in [f0 - w, f0 + w], w = min(f0, 1 - f0) / 2 (so f stays inside (0, 1) around the
task's prefix_fraction f0), and p = clamp(round(f * n), 1, n - 1): at least one token on each side.

Batch keys added to collate.py's (B batch, T length):
- prefix_lengths (B,) long: decoder rows are bidirectional over their first p positions, then
  causal; 0 = causal, >= T = fully bidirectional (the model's convention)
- task: a Python int, the index of the task in the mixture
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lit_transformer.data.batches.collate import IGNORE_INDEX, CLMCollator, Seq2SeqCollator, per_example
from lit_transformer.data.batches.mntp import MNTPCollator
from lit_transformer.data.data_plan import MixtureTask
from lit_transformer.data.tokens.tokenizer import SpecialTokens
from lit_transformer.errors import DataError

ARCHS = ("encoder", "decoder", "encoder_decoder")
BIDIRECTIONAL_TASKS = ("mlm", "mntp")  # task objectives whose decoder rows are fully visible


def prefix_lengths(lengths: list[int], prefix_fraction: float, gens: list[torch.Generator]) -> torch.Tensor:
    """Each row's prefix length (B,) long over its n real tokens (module docstring), one draw
    from each row's generator. Only the draws loop over rows: the arithmetic runs on all rows at
    once in float64, Python's float, with torch.round rounding half to even as round() does."""
    if not 0.0 < prefix_fraction < 1.0:
        raise ValueError(f"prefix_fraction={prefix_fraction} is outside (0, 1)")
    u = torch.empty(len(gens))
    for gen, draw in zip(gens, u.unbind()):
        draw.uniform_(generator=gen)
    width = min(prefix_fraction, 1.0 - prefix_fraction) / 2
    n = torch.tensor(lengths, dtype=torch.float64)  # (B,)
    f = prefix_fraction - width + 2 * width * u.double()  # (B,)
    return torch.minimum((f * n).round().clamp_min(1), (n - 1).clamp_min(1)).long()


class DecoderPrefixCollator:
    """Blocks of T+1 tokens (as CLMCollator) -> input_ids, attention_mask, labels (B,T) and
    prefix_lengths (B,). labels[t] (the token after input t) is kept only for t >= p - 1: the
    loss covers the tokens after the prefix, the first of them predicted from the prefix's end."""

    def __init__(self, special: SpecialTokens, prefix_fraction: float):
        self.clm = CLMCollator(special=special)
        self.prefix_fraction = prefix_fraction

    def __call__(self, examples, generators=None) -> dict[str, torch.Tensor]:
        gens = per_example(generators, len(examples))
        batch = self.clm(examples, gens)
        # input length is one less than the block: the last token is only a label
        prefix = prefix_lengths([len(ex) - 1 for ex in examples], self.prefix_fraction, gens)  # (B,)
        T = batch["labels"].shape[1]
        inside = torch.arange(T)[None, :] < (prefix[:, None] - 1)  # (B, T): targets that lie in the prefix
        batch["labels"] = batch["labels"].masked_fill(inside, IGNORE_INDEX)
        batch["prefix_lengths"] = prefix
        return batch


class EncoderDecoderPrefixCollator:
    """UL2's S-denoiser on an encoder-decoder: plain blocks of T tokens split at p; the encoder
    reads block[:p] + [eos], the decoder writes block[p:] + [eos]. Batch keys and conventions
    as Seq2SeqCollator (decoder inputs start with the decoder start token)."""

    def __init__(self, special: SpecialTokens, prefix_fraction: float):
        self.eos_id = special.eos_id if special.eos_id is not None else special.sep_id
        if self.eos_id is None:
            raise DataError("prefix LM on an encoder-decoder needs an eos token (</s>) in the tokenizer")
        self.seq2seq = Seq2SeqCollator(special=special)
        self.prefix_fraction = prefix_fraction

    def __call__(self, examples, generators=None) -> dict[str, torch.Tensor]:
        gens = per_example(generators, len(examples))
        pairs = []
        for ex, p in zip(examples, prefix_lengths([len(ex) for ex in examples], self.prefix_fraction, gens).tolist()):
            tokens = [int(t) for t in ex]
            pairs.append((tokens[:p] + [self.eos_id], tokens[p:] + [self.eos_id]))
        return self.seq2seq(pairs)


class TaskCollator:
    """`base`'s batch with the task's mode token in front and `task` set.

    The mode token (UL2's [NLU], [NLG], [S2S]) is prepended after `base` ran, so masking never
    touches it: on decoder and encoder models to input_ids (attention 1, label ignored, and inside
    the prefix: prefix_lengths + 1); on an encoder-decoder to the encoder input only. An mlm or
    mntp task on a decoder sees its rows fully bidirectional: prefix_lengths = T, counted with the
    mode token. `done` (the share of the schedule done at a training batch's optimizer step,
    progress.py) reaches a base that schedules by it (`follows_progress`: mntp.py's mask rate);
    validation batches come without one.
    """

    def __init__(self, base: Callable, *, task: int, objective: str, arch: str, mode_token_id: int | None = None):
        if arch not in ARCHS:
            raise ValueError(f"arch={arch!r} is not one of {list(ARCHS)}")
        self.base, self.task, self.objective, self.arch = base, int(task), objective, arch
        self.mode_token_id = mode_token_id
        self.bidirectional = objective in BIDIRECTIONAL_TASKS and arch == "decoder"
        self.follows_progress = bool(getattr(base, "follows_progress", False))

    def __call__(self, examples, generators=None, done: float | None = None) -> dict:
        batch = self.base(examples, generators, done) if self.follows_progress else self.base(examples, generators)
        if self.mode_token_id is not None:
            if "document_ids" in batch:
                raise DataError("a mode token cannot be combined with data.document_mask (it belongs to no document)")
            B = batch["input_ids"].shape[0]
            mode = torch.full((B, 1), self.mode_token_id, dtype=batch["input_ids"].dtype)
            batch["input_ids"] = torch.cat([mode, batch["input_ids"]], dim=1)  # (B, 1 + T)
            batch["attention_mask"] = torch.cat([torch.ones_like(mode), batch["attention_mask"]], dim=1)
            if self.arch != "encoder_decoder":  # enc-dec labels are the decoder's, untouched
                ignored = torch.full_like(mode, IGNORE_INDEX)
                batch["labels"] = torch.cat([ignored, batch["labels"]], dim=1)  # (B, 1 + T)
                if "prefix_lengths" in batch:
                    batch["prefix_lengths"] = batch["prefix_lengths"] + 1
        if self.bidirectional:
            B, T = batch["input_ids"].shape
            batch["prefix_lengths"] = torch.full((B,), T, dtype=torch.long)
        batch["task"] = self.task
        return batch


def task_collator(
    task: MixtureTask,
    index: int,
    *,
    arch: str,
    base: Callable,
    special: SpecialTokens,
    vocab_size: int,
    mode_token_id: int | None = None,
) -> TaskCollator:
    """Task `index`'s collator in a mixture, for training (MixtureDataModule) and evaluation
    (MixtureSplitReader) alike: its pipeline's collator `base`, or the prefix-LM or mntp collator
    that reads the same blocks, wrapped in TaskCollator. An mntp task's mask rate follows the
    progress each training key carries (progress.py: the run's horizon is the data module's);
    evaluation passes none, and reads the end rate."""
    if task.objective == "prefix_lm":
        prefix = DecoderPrefixCollator if arch == "decoder" else EncoderDecoderPrefixCollator
        base = prefix(special, task.prefix_fraction)
    elif task.objective == "mntp":
        base = MNTPCollator(
            special=special,
            vocab_size=vocab_size,
            mask_rate_start=task.mask_rate_start,
            mask_rate_end=task.mask_rate_end,
            max_span_length=task.max_span_length,
            mask_replace_prob=task.data.mask_replace_prob,
            random_replace_prob=task.data.random_replace_prob,
        )
    return TaskCollator(base, task=index, objective=task.objective, arch=arch, mode_token_id=mode_token_id)
