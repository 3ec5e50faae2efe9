"""Collators: lists of examples -> dicts of tensors, with explicit randomness.

Every collator is called as `collator(examples, generators)`: one torch.Generator per example
(or one for the batch, from which each example's generator is seeded). Random collators (MLM,
span corruption) draw each example's noise from its own generator over its own length, so an
example comes out the same whatever batch, padding or rank it lands in. The data module keys
each example's generator by (seed, epoch, example index): a resumed run draws exactly the masks
it would have, and 2 ranks draw exactly the masks one process draws for the same global batch.

Batch keys (B batch, T length; training code relies on these names):
- mlm:      input_ids (B,T), attention_mask (B,T) 1 = real token, labels (B,T) -100 = not predicted
- clm:      input_ids (B,T), attention_mask (B,T), labels (B,T): labels[t] = token after input_ids[t]
- mlm, clm with data.document_mask: also document_ids (B,T) (0, 1, ... per packed document of the
            row) and position_ids (B,T) (restarting at 0 at each document start)
- span:     see span.py (input_ids, attention_mask, labels, decoder_input_ids, decoder_attention_mask)
- seq2seq:  input_ids, attention_mask (B,S); decoder_input_ids, decoder_attention_mask, labels (B,T)
- classify: input_ids, attention_mask, token_type_ids (B,T); labels (B,) long | (B,K) float | (B,) float
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from lit_transformer.data.tokens.tokenizer import SpecialTokens, tokenizer_kind
from lit_transformer.errors import DataError

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index


def batch_generator(*keys: int) -> torch.Generator:
    """A torch generator seeded by a stable hash of integer keys (seed, epoch, rank, batch)."""
    return _keyed_generator(tuple(int(k) for k in keys))


def example_generators(seed: int, epoch: int, indices) -> list[torch.Generator]:
    """One generator per example, keyed by (seed, epoch, example index) only."""
    return [_keyed_generator(("example", int(seed), int(epoch), int(i))) for i in indices]


def per_example(generators, count: int) -> list[torch.Generator]:
    """`generators` as one generator per example: a list is checked and kept; a single batch
    generator (or None: seed 0) seeds `count` new ones, one draw each."""
    if isinstance(generators, (list, tuple)):
        if len(generators) != count:
            raise ValueError(f"{len(generators)} generators for {count} examples")
        return list(generators)
    gen = generators if generators is not None else torch.Generator().manual_seed(0)
    seeds = torch.randint(2**62, (count,), generator=gen).tolist()
    return [torch.Generator().manual_seed(s) for s in seeds]


def _keyed_generator(key: tuple) -> torch.Generator:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "big") >> 1)


def pad(seqs: Sequence, value: int, dtype=torch.long) -> torch.Tensor:
    """Right-pad 1-D sequences into (B, max length). Rows of one length (packed blocks) are
    stacked in one copy: a copy per row was a measurable share of a row-mixed batch's
    collation (benchmarks/collate_speed.py)."""
    lengths = [len(s) for s in seqs]
    length = max(lengths)
    if min(lengths) == length:
        return torch.as_tensor(np.stack([np.asarray(s) for s in seqs]), dtype=dtype)  # (B, T)
    out = torch.full((len(seqs), length), value, dtype=dtype)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.as_tensor(np.asarray(s), dtype=dtype)
    return out


def _lengths_mask(seqs: Sequence, length: int) -> torch.Tensor:
    lens = torch.tensor([len(s) for s in seqs])
    return (torch.arange(length)[None, :] < lens[:, None]).long()  # (B, T)


def document_ids(ids: torch.Tensor, separator_id: int) -> torch.Tensor:
    """(B, T) packed rows -> (B, T) index of each token's document within its row. Packing ends
    every document with the separator (pack.py), so a document starts after each separator:
    the same boundaries as the token store's `doc_starts` (LMBlocks.document_ids), found from
    the tokens alone, so streaming rows get them too. The separator belongs to the document it ends."""
    ends = (ids == separator_id).long()
    return ends.cumsum(1) - ends  # separators strictly before t


def positions_in_documents(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> positions restarting at 0 at each document's first token."""
    T = doc_ids.shape[1]
    index = torch.arange(T).expand_as(doc_ids)
    first = torch.ones_like(doc_ids, dtype=torch.bool)
    first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return index - torch.where(first, index, 0).cummax(1).values


def with_documents(
    batch: dict[str, torch.Tensor], full_ids: torch.Tensor, separator_id: int | None, width: int
) -> dict[str, torch.Tensor]:
    """Add document_ids and position_ids (B, width) computed over `full_ids` (the unmasked rows)."""
    doc = document_ids(full_ids, separator_id)[:, :width]
    batch["document_ids"] = doc
    batch["position_ids"] = positions_in_documents(doc)
    return batch


def word_start_table(tokenizer) -> torch.Tensor:
    """(V,) bool: does this token begin a word? For whole-word masking.

    WordPiece marks continuations with '##'; byte-level BPE marks a word start with a leading
    space 'Ġ' (newline 'Ċ' and tab 'ĉ' also start one); Metaspace (SentencePiece) with '▁'.
    Any other tokenizer: every token is its own word.
    """
    kind = tokenizer_kind(tokenizer)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    table = torch.ones(tokenizer.get_vocab_size(with_added_tokens=True), dtype=torch.bool)
    if kind["model"] == "WordPiece":
        rule = lambda tok: not tok.startswith("##")  # noqa: E731
    elif "ByteLevel" in kind["pre_tokenizers"]:
        rule = lambda tok: tok[:1] in ("Ġ", "Ċ", "ĉ")  # noqa: E731
    elif "Metaspace" in kind["pre_tokenizers"]:
        rule = lambda tok: tok.startswith("▁")  # noqa: E731
    else:
        return table
    for tok, i in vocab.items():
        if i < len(table):
            table[i] = rule(tok)
    for added in tokenizer.get_added_tokens_decoder().values():  # special tokens are words of their own
        i = tokenizer.token_to_id(added.content)
        if i is not None and i < len(table):
            table[i] = True
    return table


def masking_ids(special: SpecialTokens, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids never masked nor predicted, (V',) ids a random replacement draws from): the special
    tokens, and every other id of the vocabulary."""
    never = torch.tensor(sorted(special.never_masked()), dtype=torch.long)
    keep = torch.ones(vocab_size, dtype=torch.bool)
    keep[never[never < vocab_size]] = False
    return never, torch.nonzero(keep).squeeze(1)


class MLMCollator:
    """BERT masking (Devlin et al. 2019, 3.1): select `probability` of the eligible tokens;
    of those, `mask_replace_prob` become the mask token, `random_replace_prob` a random
    non-special token, the rest stay. Special tokens and padding are never selected."""

    def __init__(
        self,
        *,
        special: SpecialTokens,
        vocab_size: int,
        probability: float = 0.15,
        mask_replace_prob: float = 0.8,
        random_replace_prob: float = 0.1,
        word_starts: torch.Tensor | None = None,
        document_mask: bool = False,
    ):
        if special.mask_id is None:
            raise DataError("masked LM needs a mask token ([MASK] or <mask>) in the tokenizer")
        self.special = special
        self.probability = probability
        self.mask_replace_prob = mask_replace_prob
        self.random_replace_prob = random_replace_prob
        self.word_starts = word_starts  # None: token-level masking
        self.never, self.random_ids = masking_ids(special, vocab_size)
        self.pad_id = special.pad_id if special.pad_id is not None else 0
        self.separator_id = _separator(special, document_mask)

    def __call__(self, examples, generators=None) -> dict[str, torch.Tensor]:
        gens = per_example(generators, len(examples))
        ids = pad(examples, self.pad_id)  # (B, T)
        B, T = ids.shape
        attention_mask = _lengths_mask(examples, T)  # (B, T)
        eligible = attention_mask.bool() & ~torch.isin(ids, self.never)
        # each row's draws come from its own generator over its own length (padding draws nothing)
        pick = torch.ones(B, T + 1)  # (B, T+1): per word (whole-word) or per token; 1 = not picked
        r = torch.zeros(B, T)  # (B, T): mask / random / keep
        random_tokens = torch.zeros(B, T, dtype=torch.long)
        for row, (example, gen) in enumerate(zip(examples, gens)):
            n = len(example)
            words = n + 1 if self.word_starts is not None else n
            pick[row, :words] = torch.rand(words, generator=gen)
            r[row, :n] = torch.rand(n, generator=gen)
            random_tokens[row, :n] = self.random_ids[torch.randint(len(self.random_ids), (n,), generator=gen)]
        if self.word_starts is not None:
            starts = self.word_starts[ids] | ~eligible
            starts[:, 1:] |= ~eligible[:, :-1]  # a word never continues across a special token
            word = torch.cumsum(starts.long(), dim=1)  # (B, T) word index, 1-based
            selected = (pick < self.probability).gather(1, word) & eligible
        else:
            selected = (pick[:, :T] < self.probability) & eligible
        labels = torch.where(selected, ids, torch.full_like(ids, IGNORE_INDEX))
        to_mask = selected & (r < self.mask_replace_prob)
        to_random = selected & (r >= self.mask_replace_prob) & (r < self.mask_replace_prob + self.random_replace_prob)
        input_ids = ids.clone()
        input_ids[to_mask] = self.special.mask_id
        input_ids[to_random] = random_tokens[to_random]
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        if self.separator_id is not None:  # boundaries from the unmasked tokens
            with_documents(batch, ids, self.separator_id, T)
        return batch


class CLMCollator:
    """Blocks of T+1 tokens -> inputs tokens[:-1], labels tokens[1:] (already shifted)."""

    def __init__(self, *, special: SpecialTokens, document_mask: bool = False):
        self.pad_id = special.pad_id if special.pad_id is not None else 0
        self.separator_id = _separator(special, document_mask)

    def __call__(self, examples, generators=None) -> dict[str, torch.Tensor]:
        ids = pad(examples, self.pad_id)  # (B, T+1)
        real = _lengths_mask(examples, ids.shape[1])  # (B, T+1)
        labels = ids[:, 1:].masked_fill(real[:, 1:] == 0, IGNORE_INDEX)  # (B, T)
        batch = {"input_ids": ids[:, :-1], "attention_mask": real[:, :-1], "labels": labels}
        if self.separator_id is not None:
            # The separator ending a document still predicts the next document's first token:
            # as a BOS would, from nothing of that document (the mask hides the previous one).
            with_documents(batch, ids, self.separator_id, ids.shape[1] - 1)
        return batch


def _separator(special: SpecialTokens, document_mask: bool) -> int | None:
    """The token that ends every packed document, when document masking is on."""
    if not document_mask:
        return None
    if special.separator_id is None:
        raise DataError("data.document_mask needs the eos/sep token that separates packed documents")
    return special.separator_id


class Seq2SeqCollator:
    """(source ids, target ids), both ending in eos -> encoder inputs, teacher-forced decoder inputs."""

    def __init__(self, *, special: SpecialTokens):
        if special.pad_id is None:
            raise DataError("seq2seq needs a pad token ([PAD] or <pad>) in the tokenizer")
        self.pad_id = special.pad_id
        self.start_id = special.decoder_start_id

    def __call__(self, examples, generators=None) -> dict[str, torch.Tensor]:
        sources = [ex[0] for ex in examples]
        targets = [ex[1] for ex in examples]
        input_ids = pad(sources, self.pad_id)  # (B, S)
        target = pad(targets, self.pad_id)  # (B, T)
        decoder_mask = _lengths_mask(targets, target.shape[1])  # (B, T)
        start = torch.full((len(examples), 1), self.start_id, dtype=torch.long)
        decoder_input_ids = torch.cat([start, target[:, :-1]], dim=1)  # (B, T)
        return {
            "input_ids": input_ids,
            "attention_mask": _lengths_mask(sources, input_ids.shape[1]),
            "decoder_input_ids": decoder_input_ids,
            "decoder_attention_mask": decoder_mask,
            "labels": target.masked_fill(decoder_mask == 0, IGNORE_INDEX),
        }


class ClassifyCollator:
    """{'ids', 'type_ids', 'label'} examples -> padded batch; labels by task."""

    def __init__(self, *, special: SpecialTokens, task: str = "single_label"):
        if special.pad_id is None:
            raise DataError("classification needs a pad token ([PAD] or <pad>) in the tokenizer")
        self.pad_id = special.pad_id
        self.task = task

    def __call__(self, examples, generators=None) -> dict[str, torch.Tensor]:
        ids = [ex["ids"] for ex in examples]
        input_ids = pad(ids, self.pad_id)  # (B, T)
        labels = [ex["label"] for ex in examples]
        if self.task == "single_label":
            label_tensor = torch.tensor(np.asarray(labels), dtype=torch.long)  # (B,)
        elif self.task == "multi_label":
            label_tensor = torch.tensor(np.stack(labels), dtype=torch.float32)  # (B, K) multi-hot
        else:
            label_tensor = torch.tensor(np.asarray(labels), dtype=torch.float32)  # (B,)
        return {
            "input_ids": input_ids,
            "attention_mask": _lengths_mask(ids, input_ids.shape[1]),
            "token_type_ids": pad([ex["type_ids"] for ex in examples], 0),
            "labels": label_tensor,
        }
