"""`kind: translate`: corpus BLEU and chrF (sacrebleu, with their signatures) of the model's
translations of aligned source/target files, one sentence per line, or of the run's own `split`
(validation or test) of a seq2seq run: the measurement `objective.bleu` makes on the validation
split during training, over every sentence.

Decoding is greedy or beam search (the entry's num_beams, length_penalty, max_new_tokens, else
objective.num_beams, objective.length_penalty and data.max_target_length), in the prompt style
the registry gives the run's objective and architecture. The weights decode in their current
dtype, where they are: an evaluation in training must leave the model as it found it (bf16
decoding is the run's autocast's business, set by suite.run_suite). `evaluate` may ask for another
dtype, device and batching (`decode_with`): the evaluation then decodes a cast copy. The entry's
`mode_token` leads every prompt, as a mixture's TaskCollator led the inputs in training.
"""

from __future__ import annotations

import copy
from itertools import islice

from lit_transformer.errors import RunError
from lit_transformer.evaluation.batch_generate import (
    BATCH_ROWS,
    BATCH_TOKENS,
    BatchGenerator,
    ContextNotes,
    Decoding,
    decoding_device,
    decoding_dtype,
    translation_scores,
)
from lit_transformer.evaluation.choice import ModeToken
from lit_transformer.evaluation.eval_target import EvalTarget
from lit_transformer.recipe import registry
from lit_transformer.recipe.eval_schema import EvalConfig
from lit_transformer.recipe.registry import PromptStyle
from lit_transformer.recipe.schema import RunConfig

# what a call reports: the scores and their size; the rest of what translation_scores returns is
# kept on the evaluation as `details` (the signatures are strings, and training logs no speeds)
REPORTED = ("bleu", "chrf", "sentences")
DETAILS = ("bleu_signature", "chrf_signature", "dtype", "device", "sentences_per_s", "tokens_per_s")


class Translate:
    """Aligned sentence pairs, read once; calling it decodes the sources and scores the outputs."""

    def __init__(self, entry: EvalConfig, cfg: RunConfig):
        self.entry, self.cfg = entry, cfg
        self.pairs = read_pairs(entry, cfg)
        self.decoding = Decoding(
            max_new_tokens=entry.max_new_tokens or cfg.data.max_target_length,
            num_beams=entry.num_beams if entry.num_beams is not None else cfg.objective.num_beams,
            length_penalty=entry.length_penalty if entry.length_penalty is not None else cfg.objective.length_penalty,
        )
        self.details: dict[str, str | float] = {}  # DETAILS of the last call
        self.batching = dict(batch_size=BATCH_ROWS, batch_tokens=BATCH_TOKENS)
        self.cast: tuple[str, str] | None = None  # (dtype, device) of a decoding copy (decode_with)
        self.progress_bar = False
        self.mode_token = ModeToken(entry)
        if cfg.model.arch is not None:  # known before training (a fine-tuning recipe's comes with its source)
            self.style(cfg.model.arch)

    def style(self, arch: str) -> PromptStyle:
        """How the run's objective prompts a model of `arch`; an error where it writes no text."""
        style = registry.spec(self.cfg.objective.name).prompt_for(arch)
        if style is None:
            raise RunError(
                f"eval.{self.entry.name}: kind translate needs a model that writes text (an encoder-decoder, "
                f"or a decoder that generates); a {self.cfg.objective.name} {arch} model does not"
            )
        return style

    def decode_with(
        self, *, batch_size: int | None, batch_tokens: int | None, dtype: str, device: str, progress_bar: bool
    ) -> None:
        """Decode a copy of the weights in `dtype` on `device` (decoding_dtype, decoding_device:
        "auto" picks), in batches of these limits: `evaluate`'s flags, outside training."""
        decoding_dtype(dtype, decoding_device(device))  # a bad name fails before any model is loaded
        self.batching = dict(batch_size=batch_size, batch_tokens=batch_tokens)
        self.cast, self.progress_bar = (dtype, device), progress_bar

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        style = self.style(target.arch)
        model = target.model
        if self.cast is not None:
            where = decoding_device(self.cast[1])
            model = copy.deepcopy(model).to(device=where, dtype=decoding_dtype(self.cast[0], where))
        generate = BatchGenerator(
            model,
            target.tokenizer,
            target.special,
            style,
            self.decoding,
            **self.batching,
            notes=ContextNotes(lines=[]),
            mode_token_id=self.mode_token.id(target.tokenizer),
        )
        scores = translation_scores(generate, iter(self.pairs), progress_bar=self.progress_bar)
        self.details = {k: scores[k] for k in DETAILS}
        return {k: float(scores[k]) for k in REPORTED}


def read_pairs(entry: EvalConfig, cfg: RunConfig) -> list[tuple[str, str]]:
    """(source, reference) lines of entry.files and entry.target_files, file by file, read as the
    data pipeline reads aligned files (a pair with a blank side is skipped), or the pairs of the
    run's own split; the first max_examples."""
    from lit_transformer.data.sources.files import ReadStats, aligned_lines, count_lines, resolve_files
    from lit_transformer.errors import DataError

    if entry.split is not None:
        return split_pairs(entry, cfg)
    try:
        sources = resolve_files(entry.files, f"eval.{entry.name}.files")
        targets = resolve_files(entry.target_files, f"eval.{entry.name}.target_files")
    except DataError as error:
        raise RunError(str(error)) from None
    if len(sources) != len(targets):
        raise RunError(
            f"eval.{entry.name}: files match {len(sources)} file(s) but target_files match {len(targets)}; "
            "each source file needs its aligned reference file"
        )
    for src, tgt in zip(sources, targets):
        n_src, n_tgt = count_lines(src), count_lines(tgt)
        if n_src != n_tgt:
            raise RunError(
                f"eval.{entry.name}: {src} has {n_src} lines but its target_files {tgt} has {n_tgt}; "
                "line i of one must translate line i of the other"
            )
    stats = ReadStats()
    pairs = (
        pair for src, tgt in zip(sources, targets) for pair in aligned_lines(src, tgt, cfg.data.max_line_bytes, stats)
    )
    out = list(islice(pairs, entry.max_examples))
    if not out:
        raise RunError(f"eval.{entry.name}: no sentence pairs in {[str(p) for p in sources]}")
    return out


def split_pairs(entry: EvalConfig, cfg: RunConfig) -> list[tuple[str, str]]:
    """The first max_examples (source, target) pairs of the run's own split, as training reads them."""
    from lit_transformer.data.sources.corpus import build_sources
    from lit_transformer.data.sources.files import ReadStats
    from lit_transformer.errors import DataError

    where = f"eval.{entry.name}.split={entry.split}"
    try:
        source = build_sources(cfg.data, registry.spec(cfg.objective.name).data).get(entry.split)
        if source is None:
            named = " (the recipe names no data.test_files)" if entry.split == "test" else ""
            raise RunError(f"{where}: the run's data has no {entry.split} split{named}")
        out = list(islice(source.iterate(ReadStats()), entry.max_examples))
    except DataError as error:
        raise RunError(f"{where}: {error}") from None
    # a seq2seq run's split yields (source, target); documents and labelled rows are no pairs
    if not out or not all(isinstance(p, tuple) and len(p) == 2 for p in out):
        raise RunError(f"{where}: the split of this {cfg.objective.name} run holds no sentence pairs")
    return out


def build(entry: EvalConfig, cfg: RunConfig) -> Translate:
    """The translate evaluation of `entry` for a run of `cfg`."""
    return Translate(entry, cfg)
