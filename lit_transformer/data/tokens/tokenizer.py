"""Tokenizers from the `tokenizers` library: train, save, load, find special tokens, check fit.

Three kinds are trained (`tokenizer.kind`), each with every special token any objective needs:

- bpe: GPT-2 byte-level BPE. No normaliser, the full 256-byte alphabet and a ByteLevel
  decoder, so `decode(encode(x)) == x` for any Unicode string. Words are split by
  `BYTE_LEVEL_PATTERN` (GPT-2's pattern rewritten with explicit classes, see there) before the
  byte mapping, so that pack.py can split with Python's `re` and get the very same words.
- wordpiece: BERT. BertNormalizer + BertPreTokenizer, `##` continuations, `[CLS] a [SEP] b [SEP]`.
- unigram: T5 / SentencePiece style. NFKC, Metaspace `▁`, post-processor `a </s> b </s>`.

Sentinels `<extra_id_0>` ... are added as special tokens in ascending order (ids increase with
the index; T5's own vocabulary counts down, but collators only use `SpecialTokens.sentinel_ids`),
then `tokenizer.extra_special_tokens` (UL2's mode tokens), in the order listed.

Loaded tokenizers have their stored padding and truncation switched off (collators pad, and
packing must see whole documents) and `encode_special_tokens` on: text that happens to spell
`</s>` or `[MASK]` is encoded as text and never yields a control id.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from lit_transformer.data.batches.span_sizes import span_lengths
from lit_transformer.data.data_config import TokenizerConfig, check_objective
from lit_transformer.errors import DataError

ROLES = ("pad", "unk", "bos", "eos", "cls", "sep", "mask")
TRAINED_SPECIALS = {
    "bpe": {
        "pad": "<pad>",
        "unk": "<unk>",
        "bos": "<s>",
        "eos": "</s>",
        "cls": "<cls>",
        "sep": "<sep>",
        "mask": "<mask>",
    },
    "unigram": {
        "pad": "<pad>",
        "unk": "<unk>",
        "bos": "<s>",
        "eos": "</s>",
        "cls": "<cls>",
        "sep": "<sep>",
        "mask": "<mask>",
    },
    "wordpiece": {
        "pad": "[PAD]",
        "unk": "[UNK]",
        "cls": "[CLS]",
        "sep": "[SEP]",
        "mask": "[MASK]",
        "bos": "[BOS]",
        "eos": "[EOS]",
    },
}
# Spellings recognised in any tokenizer, most specific first. GPT-2's <|endoftext|> serves as both
# bos and eos; RoBERTa's <s> / </s> serve as cls / sep when no dedicated token exists.
ROLE_SPELLINGS = {
    "pad": ("[PAD]", "<pad>", "<|pad|>", "<|padding|>", "<PAD>"),
    "unk": ("[UNK]", "<unk>", "<|unk|>", "<UNK>"),
    "bos": ("<s>", "[BOS]", "<bos>", "<BOS>", "<|startoftext|>", "<|begin_of_text|>", "<|endoftext|>"),
    "eos": ("</s>", "[EOS]", "<eos>", "<EOS>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>"),
    "cls": ("[CLS]", "<cls>", "<CLS>", "<s>"),
    "sep": ("[SEP]", "<sep>", "<SEP>", "</s>"),
    "mask": ("[MASK]", "<mask>", "<|mask|>", "<MASK>"),
}
TRAIN_BATCH = 1000

# Word splitting of the trained byte-level BPE: GPT-2's pattern (Radford et al. 2019, encoder.py)
#     's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
# with the same alternatives in the same order (a space joins the word after it; a run of
# whitespace before a word leaves its last space to that word, `\s+(?!\S)`), but written only
# with explicit classes that Python's `re` and the Oniguruma engine inside `tokenizers` read
# identically, so that fast_encode.py can split with `re` and reuse each word's ids. \s, \w and
# \p{..} are avoided because the engines disagree on them (Python's \s includes \x1c-\x1f, which
# are not Unicode White_Space; `re` has no \p{..}). Code points are written \xHH below U+0080
# and \uHHHH above: Oniguruma reads \x80-\xff as raw UTF-8 bytes ("invalid code point value")
# and rejects \U, so no class names a code point above U+FFFF.
# The classes partition all code points:
# - space: ASCII whitespace plus the Unicode White_Space characters above ASCII, i.e. what
#   Oniguruma's \s (GPT-2's pattern in `tokenizers`) matches: NBSP, U+2000-U+200A, U+2028/9, U+3000...
_SPACE = r"\t\n\x0b\x0c\r \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
# - other (punctuation, symbols, controls; GPT-2's [^\s\p{L}\p{N}]): all of it in ASCII, and the
#   blocks where non-ASCII text keeps its common punctuation, so that quotes, dashes and CJK full
#   stops do not glue onto words. Each range holds no letter, mark or space (checked in
#   tests/data/test_data_fast_encode.py). Rarer symbols (arrows, math, emoji) count as letters: a
#   difference from GPT-2 that only changes where such words split, never the round trip.
_OTHER = (
    r"\x00-\x08\x0e-\x1f\x21-\x2f\x3a-\x40\x5b-\x60\x7b-\x7f"  # ASCII controls and punctuation
    r"\u0080-\u0084\u0086-\u009f"  # C1 controls (U+0085 is a space)
    r"\u00a1-\u00a9\u00ab-\u00b4\u00b6-\u00b9\u00bb-\u00bf\u00d7\u00f7"  # Latin-1: « » ° £ ² ½, not ª µ º
    r"\u2010-\u2027\u2030-\u205e"  # General Punctuation: dashes, quotes, bullets, ellipsis, primes
    r"\u3001-\u3004\u3008-\u3020"  # CJK punctuation: 、。 and the brackets 「」『』【】
    r"\uff01-\uff0f\uff1a-\uff20\uff3b-\uff40\uff5b-\uff65"
)  # fullwidth ASCII punctuation, ｡｢｣､･
# - digits: 0-9 only (GPT-2's \p{N} also takes other scripts' digits; here they are letters
#   unless listed in other). - letters: everything else, every script's letters, combining
#   marks included (GPT-2's \p{L} splits a combining accent off its letter).
BYTE_LEVEL_PATTERN = (
    rf"'(?:s|t|re|ve|m|ll|d)| ?[^{_SPACE}{_OTHER}0-9]+| ?[0-9]+| ?[{_OTHER}]+"
    rf"|[{_SPACE}]+(?![^{_SPACE}])|[{_SPACE}]+"
)


def byte_level_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """`BYTE_LEVEL_PATTERN` words, then GPT-2's byte-to-unicode mapping (without its own regex)."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(BYTE_LEVEL_PATTERN), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def sentinel(i: int) -> str:
    return f"<extra_id_{i}>"


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the special tokens by role; None where the tokenizer has none."""

    pad_id: int | None = None
    unk_id: int | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    cls_id: int | None = None
    sep_id: int | None = None
    mask_id: int | None = None
    sentinel_ids: tuple[int, ...] = ()
    # every other added special token (UL2's mode tokens, a loaded tokenizer's own controls):
    # a control id that text never yields, so masking must neither select nor insert it
    extra_ids: tuple[int, ...] = ()

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> SpecialTokens:
        ids = {}
        for role in ROLES:
            ids[f"{role}_id"] = next(
                (i for i in (tokenizer.token_to_id(s) for s in ROLE_SPELLINGS[role]) if i is not None), None
            )
        sentinels = []
        while (i := tokenizer.token_to_id(sentinel(len(sentinels)))) is not None:
            sentinels.append(i)
        known = {*ids.values(), *sentinels}
        extra = sorted(i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special and i not in known)
        return cls(**ids, sentinel_ids=tuple(sentinels), extra_ids=tuple(extra))

    @property
    def separator_id(self) -> int | None:
        """The token packed between documents: eos, else sep (BERT), else bos."""
        return next((i for i in (self.eos_id, self.sep_id, self.bos_id) if i is not None), None)

    @property
    def decoder_start_id(self) -> int | None:
        """T5 starts the decoder with pad (Raffel et al. 2020); bos where there is no pad."""
        return self.pad_id if self.pad_id is not None else self.bos_id

    def never_masked(self) -> set[int]:
        """Ids a masking collator must leave alone and never predict."""
        ids = {
            self.pad_id,
            self.bos_id,
            self.eos_id,
            self.cls_id,
            self.sep_id,
            self.mask_id,
            *self.sentinel_ids,
            *self.extra_ids,
        }
        return {i for i in ids if i is not None}


def check_extra_special_tokens(tokenizer: Tokenizer, tokens, where: str) -> dict[str, int]:
    """{token: id} of `tokens` (tokenizer.extra_special_tokens); one-line DataError naming the first
    that is not an added special token of `tokenizer` (loaded from `where`). Nothing is added to a
    loaded tokenizer: the model's vocabulary is sized from its file."""
    special = {tok.content: i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
    for token in tokens:
        if token not in special:
            raise DataError(
                f"tokenizer.extra_special_tokens: {token!r} is not a special token of {where}; add it "
                "to that tokenizer.json, or leave tokenizer.path empty to train a tokenizer with it"
            )
    return {token: special[token] for token in tokens}


def train_tokenizer(texts: Iterable[str], cfg: TokenizerConfig, *, describe: str = "the training split") -> Tokenizer:
    """Train a `cfg.kind` tokenizer on `texts` (at most `cfg.max_train_bytes` of them)."""
    names = TRAINED_SPECIALS[cfg.kind]
    specials = list(names.values()) + [sentinel(i) for i in range(cfg.num_sentinels)]
    for token in cfg.extra_special_tokens:
        if token in specials:
            raise DataError(
                f"tokenizer.extra_special_tokens: {token!r} is already a special token of a "
                f"trained {cfg.kind} tokenizer"
            )
    specials += list(cfg.extra_special_tokens)
    floor = len(specials) + (256 if cfg.kind == "bpe" else 1)
    if cfg.vocab_size < floor:
        raise DataError(
            f"tokenizer.vocab_size={cfg.vocab_size} is too small for a {cfg.kind} tokenizer with "
            f"{len(specials)} special tokens{' and 256 byte tokens' if cfg.kind == 'bpe' else ''}: use >= {floor}"
        )
    if cfg.kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = byte_level_pre_tokenizer()
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=cfg.vocab_size,
            min_frequency=cfg.min_frequency,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    elif cfg.kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token=names["unk"]))
        tok.normalizer = normalizers.BertNormalizer(lowercase=cfg.lowercase)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##")
        trainer = trainers.WordPieceTrainer(
            vocab_size=cfg.vocab_size,
            min_frequency=cfg.min_frequency,
            special_tokens=specials,
            continuing_subword_prefix="##",
            show_progress=False,
        )
    else:
        tok = Tokenizer(models.Unigram())
        steps = [normalizers.NFKC()] + ([normalizers.Lowercase()] if cfg.lowercase else [])
        tok.normalizer = normalizers.Sequence(steps)
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        trainer = trainers.UnigramTrainer(
            vocab_size=cfg.vocab_size, special_tokens=specials, unk_token=names["unk"], show_progress=False
        )
    seen = {"bytes": 0, "texts": 0}
    tok.train_from_iterator(_batches(texts, cfg.max_train_bytes, seen), trainer)
    if seen["texts"] == 0:
        raise DataError(f"no text to train the tokenizer on: {describe} holds 0 documents")
    tok = _canonical_ids(tok, len(specials))
    if cfg.kind == "wordpiece":
        cls_id, sep_id = tok.token_to_id(names["cls"]), tok.token_to_id(names["sep"])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{names['cls']} $A {names['sep']}",
            pair=f"{names['cls']} $A {names['sep']} $B:1 {names['sep']}:1",
            special_tokens=[(names["cls"], cls_id), (names["sep"], sep_id)],
        )
    elif cfg.kind == "unigram":
        eos_id = tok.token_to_id(names["eos"])
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A {names['eos']}",
            pair=f"$A {names['eos']} $B:1 {names['eos']}:1",
            special_tokens=[(names["eos"], eos_id)],
        )
    return _normalise(tok)


# Unigram scores are rounded to this many decimals: the trainer's parallel sums differ between
# processes in the last bits, far below any score difference that changes a segmentation.
UNIGRAM_SCORE_DECIMALS = 9
# The Unigram trainer appends the characters it must keep at the lowest score minus 1e-4 per
# character, in hash-set order: the pieces within this of the lowest score get those scores
# again, in string order.
UNIGRAM_FLOOR_BAND = 0.01


def _canonical_ids(tok: Tokenizer, n_specials: int) -> Tokenizer:
    """The same ids for the same trained vocabulary in every process. The WordPiece and Unigram
    trainers number their tokens in hash-map order (and Unigram's scores vary in the last bits),
    so two processes trained the same vocabulary with other ids, and the same recipe and seed
    trained another model. The special tokens keep their ids 0..n-1; the others follow, WordPiece's
    in string order, Unigram's by rounded score, then string. BPE's ids are already stable (its
    merges are ordered)."""
    data = json.loads(tok.to_str())
    model = data["model"]
    if model["type"] == "WordPiece":
        ranked = sorted(model["vocab"].items(), key=lambda item: item[1])
        rest = sorted(token for token, _ in ranked[n_specials:])
        model["vocab"] = {token: i for i, token in enumerate([t for t, _ in ranked[:n_specials]] + rest)}
    elif model["type"] == "Unigram":
        unk = model["vocab"][model["unk_id"]][0] if model.get("unk_id") is not None else None
        pieces = [[piece, round(score, UNIGRAM_SCORE_DECIMALS)] for piece, score in model["vocab"]]
        rest = sorted(pieces[n_specials:], key=lambda p: (-p[1], p[0]))
        if rest:
            floor = [p for p in rest if p[1] < rest[-1][1] + UNIGRAM_FLOOR_BAND]
            scores = [score for _, score in floor]  # descending
            rest = rest[: len(rest) - len(floor)] + [[piece, score] for (piece, _), score in zip(sorted(floor), scores)]
        model["vocab"] = pieces[:n_specials] + rest
        if unk is not None:
            model["unk_id"] = next(i for i, (piece, _) in enumerate(model["vocab"]) if piece == unk)
    else:
        return tok
    return Tokenizer.from_str(json.dumps(data))


def _batches(texts: Iterable[str], max_bytes: int | None, seen: dict) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        size = len(text.encode("utf-8", "surrogatepass"))
        if max_bytes is not None and seen["bytes"] + size > max_bytes:
            room = max_bytes - seen["bytes"]
            if room > 0:
                batch.append(text.encode("utf-8", "surrogatepass")[:room].decode("utf-8", "ignore"))
                seen["texts"] += 1
            break
        seen["bytes"] += size
        seen["texts"] += 1
        batch.append(text)
        if len(batch) >= TRAIN_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _normalise(tok: Tokenizer) -> Tokenizer:
    tok.no_padding()
    tok.no_truncation()
    tok.encode_special_tokens = True
    return tok


def load_tokenizer(path) -> Tokenizer:
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"tokenizer.path: no such file: {str(path)!r}")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:
        raise DataError(f"tokenizer.path: {path} is not a tokenizers tokenizer.json ({exc})") from exc
    return _normalise(tok)


def tokenizer_from_str(text: str) -> Tokenizer:
    return _normalise(Tokenizer.from_str(text))


def save_tokenizer(tok: Tokenizer, path) -> Path:
    """Write tokenizer.json atomically (temp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tokenizer-", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(tok.to_str(pretty=True))
    os.replace(tmp, path)
    return path


def tokenizer_kind(tok: Tokenizer) -> dict:
    """Model type and pre-tokenizer type, read from the serialised form."""
    d = json.loads(tok.to_str())
    pre = d.get("pre_tokenizer") or {}
    pre_types = {p.get("type") for p in pre.get("pretokenizers", [])} | {pre.get("type")}
    return {"model": d["model"]["type"], "pre_tokenizers": pre_types - {None}}


def check_tokenizer(
    tokenizer: Tokenizer,
    objective: str,
    model_vocab_size: int | None = None,
    *,
    block_size: int | None = None,
    noise_density: float = 0.15,
    mean_span_length: float = 3.0,
) -> SpecialTokens:
    """Fail with one line when `tokenizer` cannot serve `objective`; return its special tokens."""
    check_objective(objective)
    sp = SpecialTokens.from_tokenizer(tokenizer)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if model_vocab_size is not None and vocab > model_vocab_size:
        raise DataError(
            f"tokenizer has {vocab} tokens but the model's embedding has model.vocab_size={model_vocab_size}; "
            f"set model.vocab_size >= {vocab}"
        )

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise DataError(
                f"tokenizer has no {what}, which objective {objective!r} needs; train one "
                "(leave tokenizer.path empty) or load a tokenizer.json that has it"
            )

    if objective == "mlm":
        need(sp.mask_id is not None, f"mask token ({' or '.join(ROLE_SPELLINGS['mask'][:2])})")
        need(sp.separator_id is not None, "document separator (</s>, [SEP] or <|endoftext|>)")
    elif objective == "clm":
        need(sp.separator_id is not None, "end-of-document token (</s> or <|endoftext|>)")
    elif objective == "span":
        need(bool(sp.sentinel_ids), "sentinel tokens (<extra_id_0>, <extra_id_1>, ...)")
        need(sp.eos_id is not None, "eos token (</s>)")
        need(sp.decoder_start_id is not None, "pad token (<pad>, the decoder start)")
        if block_size is not None:
            spans = span_lengths(block_size, noise_density, mean_span_length).noise_spans
            if len(sp.sentinel_ids) < spans:
                raise DataError(
                    f"span corruption of data.block_size={block_size} needs {spans} sentinel tokens "
                    f"but the tokenizer has {len(sp.sentinel_ids)} (raise tokenizer.num_sentinels)"
                )
    elif objective == "seq2seq":
        need(sp.pad_id is not None, "pad token ([PAD] or <pad>)")
        need(sp.eos_id is not None or sp.sep_id is not None, "eos token (</s>)")
    else:
        need(sp.pad_id is not None, "pad token ([PAD] or <pad>)")
        need(
            tokenizer.post_processor is not None or sp.sep_id is not None or sp.eos_id is not None,
            "segment separator ([SEP], <sep> or </s>)",
        )
    return sp
